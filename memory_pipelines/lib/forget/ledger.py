"""The deletion ledger: the durable record of forgetting. Requests (accepted and hidden from every
read at once), job states, audit rows, proofs and what is pending, in the control plane.

States: REQUESTED -> FROZEN -> DELETING -> VERIFYING -> COMPLETE, or BLOCKED from any of the
middle three. A job never reaches COMPLETE while a target is not DONE; a retry resumes
idempotently. Jobs, audit rows, the outbox and proofs hold ids, HMACs and counts, never text.
The cascade that moves jobs through these states is `cascade.py`.

This module alone writes control.deletion_jobs (tests/unit/test_deletion_jobs_writer.py): the
cascade, the freeze's targets (`targets.py`), the physical erasure (`erasure.py`) and a restore's
safety net (lib/backups/restore_replay.py's `JobRecords`) record a job through its functions, each
in the caller's transaction.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from datetime import UTC, date, datetime, timedelta
from typing import Any, cast

import psycopg
from psycopg.rows import dict_row

from memory_pipelines.lib.forget import gate, guarantees, switches
from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import MemoryPipelinesError, NotFoundError, ValidationError
from memory_pipelines.lib.memories import crypto, ordering
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import DeletionJob, DeletionPause, DeletionProof, DeletionRequest, KeysShredded
from memory_pipelines.lib.stores import registry
from memory_pipelines.lib.stores.adapter import Source
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "DEADLINE_DAYS",
    "LEGACY_SEALED",
    "NEAR_DEADLINE",
    "OPEN_STATES",
    "POLICY_VERSION",
    "REBUILT_PREFIX",
    "DeletionBlocked",
    "DeletionLedger",
    "DeletionRequests",
    "fix_target_counts",
    "mark_erased",
    "rebuilt_counts",
    "record_found",
]

POLICY_VERSION = "deletion-policy-2026-11"
# Days to complete by basis; a regulator's clock, not a target (we finish in seconds).
DEADLINE_DAYS = {"gdpr-art17": 30, "ccpa": 45, "user-request": 30, "retention": 30, "offboarding": 30}
# A job this close to its deadline (or past it) fails the `deletions_on_track` check.
NEAR_DEADLINE = timedelta(days=3)
OPEN_STATES = ("REQUESTED", "FROZEN", "DELETING", "VERIFYING", "BLOCKED")
# Key prefix, in a job's `found`, of the records a store rebuilt without the scope instead of deleting.
REBUILT_PREFIX = "rebuilt:"
# Key, in a job's `found`, of its target versions sealed under a key their deletion does not destroy
# (counted at the first freeze: lib/forget/targets.py).
LEGACY_SEALED = "legacySealed"


class DeletionBlocked(MemoryPipelinesError):
    """A store step or the verification failed; the job is BLOCKED with an error code per target."""

    exit_code = 8

    def __init__(self, store: str, code: str, detail: str) -> None:
        super().__init__(store, f"{code}: {detail}")
        self.code = code


def _now() -> datetime:
    return datetime.now(UTC)


class DeletionLedger:
    """The deletion control plane: reads (jobs, proofs, pending batches) and the job-state writes of a
    forget run (states, audit rows, store targets, proofs); needs only the memory store."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    @staticmethod
    def job_row(conn: psycopg.Connection, job_id: str) -> DeletionJob:
        validation.check_id("job_id", job_id)
        with conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute("SELECT * FROM control.deletion_jobs WHERE job_id = %s", (job_id,)).fetchone()
        if row is None:
            raise NotFoundError("job_id", f"no deletion job {job_id!r}")
        return _with_pause(conn, _job_of(row))

    @staticmethod
    def job_rows(conn: psycopg.Connection, job_ids: list[str]) -> list[DeletionJob]:
        """`job_row` of each of `job_ids`, in their order, from one query."""
        for job_id in job_ids:
            validation.check_id("job_id", job_id)
        with conn.cursor(row_factory=dict_row) as cur:
            rows = {
                row["job_id"]: row
                for row in cur.execute("SELECT * FROM control.deletion_jobs WHERE job_id = ANY(%s)", (list(job_ids),))
            }
        for job_id in job_ids:
            if job_id not in rows:
                raise NotFoundError("job_id", f"no deletion job {job_id!r}")
        jobs = [_job_of(rows[job_id]) for job_id in job_ids]
        open_tenants = sorted({job["tenant_id"] for job in jobs if job["state"] != "COMPLETE"})
        held = {tenant: switches.active_pause(conn, tenant) for tenant in open_tenants}  # one read per tenant
        for job in jobs:
            if job["state"] != "COMPLETE" and held.get(job["tenant_id"]) is not None:
                job["paused"] = cast(DeletionPause, held[job["tenant_id"]])
        return jobs

    def status(self, *, job_id: str) -> DeletionJob:
        with self.store.transaction() as conn:
            return self.job_row(conn, job_id)

    def proof(self, *, job_id: str) -> DeletionProof:
        with self.store.transaction() as conn:
            job = self.job_row(conn, job_id)
            row = conn.execute("SELECT proof FROM control.deletion_jobs WHERE job_id = %s", (job_id,)).fetchone()
        if row is None or row[0] is None:
            raise NotFoundError("job_id", f"job {job_id} is {job['state']}; a proof exists once it is COMPLETE")
        stored: DeletionProof = row[0]  # the jsonb column, decoded: a dict
        return stored.copy()

    def list_jobs(self, *, state: str | None = None, tenant_id: str | None = None) -> list[DeletionJob]:
        if state is not None and state not in (*OPEN_STATES, "COMPLETE"):
            raise ValidationError("state", f"must be one of {', '.join((*OPEN_STATES, 'COMPLETE'))}")
        validation.check_optional_id("tenant", tenant_id)
        with self.store.transaction() as conn:
            ids = [
                r[0]
                for r in conn.execute(
                    "SELECT job_id FROM control.deletion_jobs WHERE (%s::text IS NULL OR state = %s)"
                    " AND (%s::text IS NULL OR tenant_id = %s) ORDER BY created_at",
                    (state, state, tenant_id, tenant_id),
                )
            ]
            return [self.job_row(conn, job_id) for job_id in ids]

    def pending(
        self, *, tenant_id: str | None = None, states: tuple[str, ...] = ("REQUESTED",)
    ) -> dict[str, list[str]]:
        """tenant -> job ids in `states` (what the forget sensor batches)."""
        out: dict[str, list[str]] = {}
        with self.store.transaction() as conn:
            for job_tenant, job_id in conn.execute(
                "SELECT tenant_id, job_id FROM control.deletion_jobs WHERE state = ANY(%s)"
                " AND (%s::text IS NULL OR tenant_id = %s) ORDER BY created_at",
                (list(states), tenant_id, tenant_id),
            ):
                out.setdefault(job_tenant, []).append(job_id)
        return out

    def ledger(self, *, tenant_id: str | None = None, paused: bool = True) -> list[dict[str, Any]]:
        """Every open job as ids, state, ledger sequence, attempts and times (what the forget sensor
        reads); `paused` False leaves out the jobs of tenants whose deletion work is paused."""
        validation.check_optional_id("tenant", tenant_id)
        with self.store.transaction() as conn, conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(
                "SELECT job_id, tenant_id, state, seq, attempts, next_attempt_at, deadline, updated_at,"
                " targets::text LIKE '%%FAILED:VERIFICATION\\_%%' AS verification_failed"
                " FROM control.deletion_jobs WHERE state <> 'COMPLETE' AND (%s::text IS NULL OR tenant_id = %s)"
                " ORDER BY seq NULLS FIRST, created_at",
                (tenant_id, tenant_id),
            ).fetchall()
            if paused or not rows:
                return rows
            held = switches.paused_tenants(conn, sorted({row["tenant_id"] for row in rows}))
        return [row for row in rows if row["tenant_id"] not in held]

    def forget_running(self, *, tenant_id: str) -> bool:
        """Whether a live process holds the tenant's forget run lock now (a forget or a restore).

        A session lock dies with its connection, so a run worker killed mid-forget holds nothing: the
        forget sensor uses this to tell a dead worker from a slow one."""
        key = ordering.run_lock(tenant_id)
        with psycopg.connect(self.store.conninfo, autocommit=True) as conn:
            row = conn.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 2))", (key,)).fetchone()
            free = bool(row and row[0])
            if free:
                conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 2))", (key,))
        return not free

    def attention(self, *, tenant_id: str | None = None, now: datetime | None = None) -> dict[str, dict[str, Any]]:
        """tenant -> open jobs that need a person: BLOCKED, within NEAR_DEADLINE of their deadline, or past it."""
        now = now or _now()
        out: dict[str, dict[str, Any]] = {}
        for row in self.ledger(tenant_id=tenant_id):
            entry = out.setdefault(row["tenant_id"], {"open": 0, "blocked": [], "near_deadline": [], "overdue": []})
            entry["open"] += 1
            if row["state"] == "BLOCKED":
                entry["blocked"].append(row["job_id"])
            if row["deadline"] <= now:
                entry["overdue"].append(row["job_id"])
            elif row["deadline"] - now < NEAR_DEADLINE:
                entry["near_deadline"].append(row["job_id"])
        return out

    # -- job-state writes (the cascade's record) -----------------------------------------------

    @staticmethod
    def audit(
        conn: psycopg.Connection, job_id: str, tenant_id: str, event: str, state: str, detail: dict[str, Any]
    ) -> None:
        """One audit row of a job (ids, states and counts only)."""
        conn.execute(
            "INSERT INTO control.audit (job_id, tenant_id, event, state, detail) VALUES (%s, %s, %s, %s, %s)",
            (job_id, tenant_id, event, state, json.dumps(detail)),
        )

    @staticmethod
    def audit_many(
        conn: psycopg.Connection, jobs: list[DeletionJob], event: str, state: str, details: list[dict[str, Any]]
    ) -> None:
        """One audit row per job (ids, states and counts only), in job order, in one statement."""
        if not jobs:
            return
        conn.execute(
            "INSERT INTO control.audit (job_id, tenant_id, event, state, detail)"
            " SELECT x.job_id, x.tenant_id, %s, %s, x.detail::jsonb"
            " FROM unnest(%s::text[], %s::text[], %s::text[]) WITH ORDINALITY AS x(job_id, tenant_id, detail, n)"
            " ORDER BY x.n",
            (
                event,
                state,
                [job["job_id"] for job in jobs],
                [job["tenant_id"] for job in jobs],
                [json.dumps(detail) for detail in details],
            ),
        )

    def set_state(
        self, jobs: list[DeletionJob], state: str, *, conn: psycopg.Connection | None = None, **detail: Any
    ) -> None:
        """Move `jobs` to `state` (and audit it) in one statement each, in `conn`'s transaction when
        given; the dicts follow once recorded."""
        if conn is None:
            with self.store.transaction() as conn:
                self.set_state(jobs, state, conn=conn, **detail)
            return
        conn.execute(
            "UPDATE control.deletion_jobs SET state = %s, updated_at = now() WHERE job_id = ANY(%s)",
            (state, [job["job_id"] for job in jobs]),
        )
        self.audit_many(conn, jobs, "state", state, [detail] * len(jobs))
        for job in jobs:
            job["state"] = state

    @staticmethod
    def count_attempt(conn: psycopg.Connection, jobs: list[DeletionJob]) -> None:
        """One more attempt for each of `jobs` (a freeze beginning), in `conn`'s transaction."""
        conn.execute(
            "UPDATE control.deletion_jobs SET attempts = attempts + 1 WHERE job_id = ANY(%s)",
            ([j["job_id"] for j in jobs],),
        )

    @staticmethod
    def reopen_erasure(
        conn: psycopg.Connection, job_id: str, *, targets: dict[str, Any], proof: dict[str, Any], deadline: datetime
    ) -> None:
        """A COMPLETE job's physical erasure owed again by `deadline` (a restore put copies back in the
        files), with its `targets` and `proof` saying so: the write of lib/backups/restore_replay.py's
        `JobRecords`, in the restore's transaction."""
        conn.execute(
            "UPDATE control.deletion_jobs SET targets = %s, proof = %s, erased_at = NULL, erasure = NULL,"
            " erasure_deadline = %s, updated_at = now() WHERE job_id = %s",
            (json.dumps(targets), json.dumps(proof), deadline, job_id),
        )

    def block(self, jobs: list[DeletionJob], step: str, code: str) -> None:
        """Record `jobs` BLOCKED at `step` with an error code (best effort: the control plane may be down)."""
        try:
            with self.store.transaction() as conn:
                conn.execute(
                    "UPDATE control.deletion_jobs j SET state = 'BLOCKED', targets = x.targets::jsonb,"
                    " updated_at = now() FROM unnest(%s::text[], %s::text[]) AS x(job_id, targets)"
                    " WHERE j.job_id = x.job_id",
                    (
                        [job["job_id"] for job in jobs],
                        [json.dumps({**job["targets"], step: f"FAILED:{code}"}) for job in jobs],
                    ),
                )
                self.audit_many(conn, jobs, "blocked", "BLOCKED", [{"step": step, "code": code}] * len(jobs))
        except MemoryPipelinesError:
            pass  # the control plane itself is unreachable: the job stays in its last recorded state

    def record_done(
        self,
        jobs: list[DeletionJob],
        done: Mapping[str, Mapping[str, int]],
        found: Mapping[str, Mapping[str, int]] | None = None,
        *,
        state: str | None = None,
        conn: psycopg.Connection | None = None,
    ) -> None:
        """Record each store of `done` DONE for each job, with the records it reached (store -> job id
        -> count), and merge `found` (job id -> counts, e.g. records rebuilt) into the jobs' `found`:
        one statement for every job and store, in `conn`'s transaction when given. With `state`, the
        jobs move to it in the same transaction (`set_state`)."""
        if conn is None:
            with self.store.transaction() as conn:
                self.record_done(jobs, done, found, state=state, conn=conn)
            return
        updated = []
        for job in jobs:
            targets = dict(job["targets"])
            for store_name, counts in done.items():
                targets[store_name] = f"DONE:{counts.get(job['job_id'], 0)}"
            updated.append(targets)
        conn.execute(
            "UPDATE control.deletion_jobs j SET targets = x.targets::jsonb,"
            " found = CASE WHEN x.found IS NULL THEN j.found ELSE coalesce(j.found, '{}'::jsonb) || x.found::jsonb END,"
            " updated_at = now() FROM unnest(%s::text[], %s::text[], %s::text[]) AS x(job_id, targets, found)"
            " WHERE j.job_id = x.job_id",
            (
                [job["job_id"] for job in jobs],
                [json.dumps(targets) for targets in updated],
                [json.dumps(dict(found[job["job_id"]])) if found and job["job_id"] in found else None for job in jobs],
            ),
        )
        for job, targets in zip(jobs, updated, strict=True):
            job["targets"] = targets
        if state is not None:
            self.set_state(jobs, state, conn=conn)

    def record_complete(
        self,
        tenant_id: str,
        jobs: list[DeletionJob],
        targets: dict[str, set[Source]],
        verification: dict[str, Any],
        found: Mapping[str, Mapping[str, Any]] | None = None,
        *,
        erasure_hours: int,
        adapter_versions: Mapping[str, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Mark verified jobs COMPLETE with their proofs, in one transaction (one statement per kind
        of row for all the jobs); returns the proofs."""
        _require_every_store_done(jobs)
        proofs = []
        job_ids = [job["job_id"] for job in jobs]
        versions = _versions_ran(adapter_versions or {})
        with self.store.transaction() as conn:
            rows = _epochs_and_times(conn, job_ids)
            backups = _backups(conn, tenant_id)
            completed = _now()
            erase_by = completed + timedelta(hours=erasure_hours)
            # Pauses that held the tenant while any of these jobs was open: each proof lists its own.
            held = switches.pauses_between(conn, tenant_id, min(c for _, c in rows.values()), completed)
            new_targets = []
            for job in jobs:
                epoch, created = rows[job["job_id"]]
                # Not counted (a job first frozen by a release before version keys): as if all were.
                legacy = ((found or {}).get(job["job_id"]) or {}).get(LEGACY_SEALED)
                job_targets = {
                    **job["targets"],
                    "backups": _backup_status_of(
                        backups, job["scope"]["type"], legacy=len(targets[job["job_id"]]) if legacy is None else legacy
                    ),
                    # Its own target: the bytes leave every file in the tenant's erasure run (erasure.py).
                    "physical": f"PENDING:{erase_by.isoformat()}",
                }
                new_targets.append(job_targets)
                proofs.append(
                    _proof_of(
                        job,
                        tenant_id,
                        epoch,
                        len(targets[job["job_id"]]),
                        job_targets,
                        # Of DONE:n (records reached), those rebuilt without the scope rather than deleted.
                        rebuilt=rebuilt_counts((found or {}).get(job["job_id"], {})),
                        adapter_versions=versions,
                        verification=verification,
                        times=(created, completed),
                    )
                    | {
                        "guarantees": guarantees.at_completion(
                            job["scope"]["type"], legacy=None if legacy is None else int(legacy)
                        )
                    }
                    | _pauses_of(held, created)
                )
            conn.execute(
                "UPDATE control.deletion_jobs j SET state = 'COMPLETE', proof = x.proof::jsonb, completed_at = %s,"
                " targets = x.targets::jsonb, erasure_deadline = %s, updated_at = now()"
                " FROM unnest(%s::text[], %s::text[], %s::text[]) AS x(job_id, proof, targets)"
                " WHERE j.job_id = x.job_id",
                (
                    completed,
                    erase_by,
                    job_ids,
                    [json.dumps(proof) for proof in proofs],
                    [json.dumps(t) for t in new_targets],
                ),
            )
            _announce_complete(conn, tenant_id, jobs)
            self.audit_many(conn, jobs, "completed", "COMPLETE", [{"targets": t} for t in new_targets])
        for job, job_targets in zip(jobs, new_targets, strict=True):
            job["targets"] = job_targets
            job["state"] = "COMPLETE"  # only once the transaction committed
        return proofs


def _versions_ran(ran: Mapping[str, str]) -> dict[str, str]:
    """The adapter versions a batch ran (a pin included); each store's default where it did not say."""
    return {spec.name: ran.get(spec.name, spec.adapter_version) for spec in registry.stores()}


def _epochs_and_times(conn: psycopg.Connection, job_ids: list[str]) -> dict[str, tuple[int | None, datetime]]:
    rows = conn.execute(
        "SELECT job_id, subject_epoch, created_at FROM control.deletion_jobs WHERE job_id = ANY(%s)", (job_ids,)
    ).fetchall()
    return {job_id: (epoch, created) for job_id, epoch, created in rows}


def _pauses_of(held: list[dict[str, Any]], created: datetime) -> dict[str, Any]:
    """A proof's `pauses`: those of `held` still open when the job was requested (none: no key)."""
    mine = [p for p in held if p["resumedAt"] is None or datetime.fromisoformat(p["resumedAt"]) >= created]
    return {"pauses": mine} if mine else {}


def _require_every_store_done(jobs: list[DeletionJob]) -> None:
    for job in jobs:
        statuses = [str(job["targets"].get(spec.name, "PENDING")) for spec in registry.stores()]
        if not all(status.startswith("DONE:") for status in statuses):
            raise DeletionBlocked("targets", "TARGET_NOT_DONE", "a store has not confirmed its deletion")


def fix_target_counts(conn: psycopg.Connection, counts: Mapping[str, int]) -> None:
    """Record each job's target count (job_id -> versions) and that its targets are fixed from now on
    (lib/forget/targets.py's `resolve_targets`), in `conn`'s transaction."""
    conn.execute(
        "UPDATE control.deletion_jobs j SET target_count = x.n, targets_fixed = true"
        " FROM unnest(%s::text[], %s::int[]) AS x(job_id, n) WHERE j.job_id = x.job_id",
        (list(counts), list(counts.values())),
    )


def record_found(conn: psycopg.Connection, found: Mapping[str, dict[str, int]]) -> None:
    """Keep what each store held of each job's targets at its first freeze (job_id -> counts;
    lib/forget/targets.py's `found`), in `conn`'s transaction."""
    conn.execute(
        "UPDATE control.deletion_jobs j SET found = x.found::jsonb"
        " FROM unnest(%s::text[], %s::text[]) AS x(job_id, found) WHERE j.job_id = x.job_id",
        (list(found), [json.dumps(counts) for counts in found.values()]),
    )


def mark_erased(
    conn: psycopg.Connection, job_id: str, *, targets: dict[str, Any], proof: dict[str, Any], erased: datetime
) -> None:
    """A job physically erased at `erased`, with the `targets` and `proof` (its `erasure` included)
    that say so (lib/forget/erasure.py), in `conn`'s transaction."""
    conn.execute(
        "UPDATE control.deletion_jobs SET targets = %s, proof = %s, erased_at = %s, erasure = %s,"
        " updated_at = now() WHERE job_id = %s",
        (json.dumps(targets), json.dumps(proof), erased, json.dumps(proof["erasure"]), job_id),
    )


class DeletionRequests:
    """Accepts deletion requests: each resolved to a stable scope and hidden from every read in the
    transaction that records it; crypto-shredding and retention sweeps too. Reads and audits the
    jobs through `jobs` (a ledger of the same store when not given; named as `DeletionService.jobs`,
    since `ledger` is the name of the open-jobs read)."""

    def __init__(self, derived: DerivedStores, *, jobs: DeletionLedger | None = None) -> None:
        self.derived = derived
        self.store = derived.store
        self.jobs = DeletionLedger(derived.store) if jobs is None else jobs

    def request(
        self,
        *,
        tenant_id: str,
        subject: str | None = None,
        memory_id: str | None = None,
        version: int | None = None,
        all_tenant: bool = False,
        confirm: str | None = None,
        basis: str = "user-request",
        requested_by: str | None = None,
        request_key: str | None = None,
    ) -> DeletionRequest:
        """Accept a request, resolved to a stable scope, and hide that scope from every read at once.

        `request_key` makes the request idempotent for its caller whatever happened since (e.g. a
        Dagster run's root run id): the job first accepted under that key is returned again
        (`duplicate`), COMPLETE or not, and nothing new is accepted."""
        scope = _checked_scope(
            tenant_id=tenant_id,
            subject=subject,
            memory_id=memory_id,
            version=version,
            all_tenant=all_tenant,
            confirm=confirm,
            basis=basis,
            requested_by=requested_by,
            request_key=request_key,
        )
        self.store.require_tenant(tenant_id=tenant_id)
        parts = [scope, tenant_id, subject or "", memory_id or "", "" if version is None else str(version)]
        with self.store.transaction() as conn:
            # The gate's exclusive lock first: writes in flight commit before the scope is resolved
            # (so it covers them), later ones see it hidden; permits are ordered before or after
            # this closure; identical concurrent requests queue here and find the first one's job.
            gate.lock_gate_exclusive(conn, tenant_id)
            keyed = self._keyed_job(conn, tenant_id, request_key)
            if keyed is not None:
                return {**keyed, "duplicate": True}
            scope_hash, open_job = self._scope(conn, tenant_id, parts)
            if open_job is not None:
                self._key_request(conn, tenant_id, request_key, open_job["job_id"])
                return {**open_job, "duplicate": True}
            if scope == "SUBJECT" and not self._subject_exists(conn, tenant_id, subject):
                # Ids are exact: a typo ("Alice" for "alice") must not produce a proof of nothing.
                raise NotFoundError("subject", f"no subject {subject!r} in tenant {tenant_id!r}")
            versions: list[int] = []
            if scope == "MEMORY":
                assert memory_id is not None
                versions = self._memory_versions(conn, tenant_id, memory_id, version)
            job_id = self._accept(conn, tenant_id, scope, scope_hash, basis, subject, memory_id, version, versions)
            self._key_request(conn, tenant_id, request_key, job_id)
            received = {"scope": scope, "basis": basis, **({"requested_by": requested_by} if requested_by else {})}
            self.jobs.audit(conn, job_id, tenant_id, "received", "REQUESTED", received)
            return {**self.jobs.job_row(conn, job_id), "duplicate": False}

    def _accept(
        self,
        conn: psycopg.Connection,
        tenant_id: str,
        scope: str,
        scope_hash: bytes,
        basis: str,
        subject: str | None,
        memory_id: str | None,
        version: int | None,
        versions: list[int],
    ) -> str:
        """Record the new job, hide its scope and close the gate's fences on it; returns its id."""
        job_id = "del_" + uuid.uuid4().hex
        deadline = _now() + timedelta(days=DEADLINE_DAYS[basis])
        # A MEMORY job names its memory's author, for the author's export (cleared by their SUBJECT forget).
        conn.execute(
            "INSERT INTO control.deletion_jobs (job_id, tenant_id, scope, subject_id, memory_id, version,"
            " scope_hash, basis, policy_version, state, deadline, author_id) VALUES (%s, %s, %s, %s, %s, %s, %s,"
            " %s, %s, 'REQUESTED', %s, (SELECT user_id FROM memory.memories WHERE tenant_id = %s AND memory_id = %s))",
            (
                *(job_id, tenant_id, scope, subject, memory_id, version, scope_hash, basis, POLICY_VERSION, deadline),
                *(tenant_id, memory_id),
            ),
        )
        epoch = self._hide(conn, job_id, scope, tenant_id, subject, memory_id, versions, whole_memory=version is None)
        gate.close_fences(
            conn,
            tenant_id=tenant_id,
            job_id=job_id,
            subject=subject if scope == "SUBJECT" else None,
            epoch=epoch,
            versions=[(memory_id, v) for v in versions] if memory_id is not None else [],
            tenant=scope == "TENANT",
        )
        if epoch is not None:
            conn.execute("UPDATE control.deletion_jobs SET subject_epoch = %s WHERE job_id = %s", (epoch, job_id))
        conn.execute(
            "UPDATE memory.tenants SET change_seq = change_seq + 1, updated_at = now() WHERE tenant_id = %s",
            (tenant_id,),
        )
        return job_id

    def _keyed_job(self, conn: psycopg.Connection, tenant_id: str, request_key: str | None) -> DeletionJob | None:
        """The job a request with this key was answered with before, if any."""
        if request_key is None:
            return None
        row = conn.execute(
            "SELECT job_id FROM control.deletion_request_keys WHERE tenant_id = %s AND request_key = %s",
            (tenant_id, request_key),
        ).fetchone()
        return None if row is None else self.jobs.job_row(conn, row[0])

    @staticmethod
    def _key_request(conn: psycopg.Connection, tenant_id: str, request_key: str | None, job_id: str) -> None:
        if request_key is not None:
            conn.execute(
                "INSERT INTO control.deletion_request_keys (tenant_id, request_key, job_id) VALUES (%s, %s, %s)"
                " ON CONFLICT DO NOTHING",
                (tenant_id, request_key, job_id),
            )

    @staticmethod
    def _subject_exists(conn: psycopg.Connection, tenant_id: str, subject: str | None) -> bool:
        return (
            conn.execute(
                "SELECT 1 FROM memory.subjects WHERE tenant_id = %s AND user_id = %s", (tenant_id, subject)
            ).fetchone()
            is not None
        )

    def shred_keys(self, *, tenant_id: str, subject: str | None = None, confirm: str | None = None) -> KeysShredded:
        """Crypto-shred now: destroy the subject's key (or every key of the tenant) and journal it.

        The data sealed under those keys becomes unreadable at once, in the store and in every
        backup. The forget job of the same scope is requested too (hidden at once), so every derived
        copy is removed and verified by the next forget run.
        """
        if subject is None:
            job = self.request(tenant_id=tenant_id, all_tenant=True, confirm=confirm, basis="offboarding")
        else:
            job = self.request(tenant_id=tenant_id, subject=subject)
        with self.store.transaction() as conn:
            if subject is None:
                destroyed = self.store.keys.destroy_tenant_keys(conn, tenant_id)
            else:
                key_id = self.store.keys.destroy_subject_key(conn, tenant_id, subject)
                destroyed = [] if key_id is None else [key_id]
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO control.journal (tenant_id, kind, subject_id, key_id, job_id)"
                    " VALUES (%s, 'KEY_DESTROYED', %s, %s, %s)",
                    [(tenant_id, subject, key_id, job["job_id"]) for key_id in destroyed],
                )
            self.jobs.audit(conn, job["job_id"], tenant_id, "keys_shredded", job["state"], {"keys": len(destroyed)})
        try:
            # Crypto-shredding now means now: the tenant's key partitions are rewritten at once (small,
            # and no other tenant's), so no dead copy of a wrapped key waits for the erasure run.
            registry.adapter("key_store").erase(self.derived, tenant_id)
        except (MemoryPipelinesError, psycopg.Error):
            pass  # the keys are gone already; the tenant's physical erasure compacts them again
        return {"tenant_id": tenant_id, "subject": subject, "destroyed_keys": destroyed, "forget_job": job}

    def _scope(self, conn: psycopg.Connection, tenant_id: str, parts: list[str]) -> tuple[bytes, DeletionJob | None]:
        """The scope's HMAC under the control-plane key, and the job already open for it, if any."""
        scope_hash = crypto.mac(self.store.keys.control_key(conn), json.dumps(parts).encode())
        row = conn.execute(
            "SELECT job_id FROM control.deletion_jobs WHERE tenant_id = %s AND scope_hash = %s AND state <> 'COMPLETE'",
            (tenant_id, scope_hash),
        ).fetchone()
        return scope_hash, None if row is None else self.jobs.job_row(conn, row[0])

    def request_retention(
        self, *, tenant_id: str, day: date, memory_ids: list[str], categories: dict[str, int], policy_version: str
    ) -> dict[str, Any] | None:
        """Accept a retention sweep of one tenant and day: every version of `memory_ids` is tombstoned
        (hidden at once) and each memory is journalled as forgotten whole, so every restore removes
        every version of it, from any backup. None when there is nothing to remove."""
        validation.check_id("tenant", tenant_id)
        if not memory_ids:
            return None
        parts = ["RETENTION", tenant_id, day.isoformat(), policy_version]
        with self.store.transaction() as conn:
            gate.lock_gate_exclusive(conn, tenant_id)
            scope_hash, open_job = self._scope(conn, tenant_id, parts)
            if open_job is not None:
                return {**open_job, "duplicate": True}
            job_id = "del_" + uuid.uuid4().hex
            conn.execute(
                "INSERT INTO control.deletion_jobs (job_id, tenant_id, scope, scope_hash, basis, policy_version,"
                " state, deadline, sweep_date, detail) VALUES (%s, %s, 'RETENTION', %s, 'retention', %s,"
                " 'REQUESTED', %s, %s, %s)",
                (
                    job_id,
                    tenant_id,
                    scope_hash,
                    POLICY_VERSION,
                    _now() + timedelta(days=DEADLINE_DAYS["retention"]),
                    day,
                    json.dumps({"categories": categories, "retentionPolicyVersion": policy_version}),
                ),
            )
            # Set-based: a sweep can cover a large share of a tenant.
            conn.execute(
                "INSERT INTO control.tombstones (tenant_id, memory_id, version, job_id)"
                " SELECT v.tenant_id, v.memory_id, v.version, %s FROM memory.memory_versions v"
                " WHERE v.tenant_id = %s AND v.memory_id = ANY(%s) ON CONFLICT DO NOTHING",
                (job_id, tenant_id, memory_ids),
            )
            swept = conn.execute(
                "SELECT memory_id, version FROM control.tombstones WHERE job_id = %s", (job_id,)
            ).fetchall()
            gate.close_fences(conn, tenant_id=tenant_id, job_id=job_id, versions=[(m, v) for m, v in swept])
            conn.execute(
                "INSERT INTO control.journal (tenant_id, kind, memory_id, version, job_id)"
                " SELECT tenant_id, 'TOMBSTONE', memory_id, version, job_id FROM control.tombstones WHERE job_id = %s",
                (job_id,),
            )
            # A sweep removes whole memories, so it is journalled as such: tombstones cover only the
            # versions the store holds today, and a newer backup may hold one an older restore dropped.
            conn.execute(
                "INSERT INTO control.journal (tenant_id, kind, memory_id, job_id)"
                " SELECT %s, 'MEMORY_FORGOTTEN', memory_id, %s FROM control.tombstones WHERE job_id = %s"
                " GROUP BY memory_id ORDER BY memory_id",
                (tenant_id, job_id, job_id),
            )
            conn.execute(
                "UPDATE memory.tenants SET change_seq = change_seq + 1, updated_at = now() WHERE tenant_id = %s",
                (tenant_id,),
            )
            self.jobs.audit(
                conn, job_id, tenant_id, "received", "REQUESTED", {"scope": "RETENTION", "categories": categories}
            )
            return {**self.jobs.job_row(conn, job_id), "duplicate": False}

    @staticmethod
    def _memory_versions(conn: psycopg.Connection, tenant_id: str, memory_id: str, version: int | None) -> list[int]:
        rows = [
            r[0]
            for r in conn.execute(
                "SELECT v.version FROM memory.memory_versions v JOIN memory.memories m"
                " ON m.tenant_id = v.tenant_id AND m.memory_id = v.memory_id"
                " JOIN memory.subjects s ON s.tenant_id = m.tenant_id AND s.user_id = m.user_id"
                " WHERE v.tenant_id = %s AND v.memory_id = %s AND s.forgotten_at IS NULL"
                " AND NOT EXISTS (SELECT 1 FROM control.tombstones t WHERE t.tenant_id = v.tenant_id"
                " AND t.memory_id = v.memory_id AND t.version = v.version) ORDER BY v.version",
                (tenant_id, memory_id),
            )
        ]
        if not rows:
            raise NotFoundError("memory_id", f"no memory {memory_id} in tenant {tenant_id!r}")
        if version is not None:
            if version not in rows:
                raise NotFoundError("version", f"memory {memory_id} has no version {version}")
            return [version]
        return rows

    def _hide(
        self,
        conn: psycopg.Connection,
        job_id: str,
        scope: str,
        tenant_id: str,
        subject: str | None,
        memory_id: str | None,
        versions: list[int],
        *,
        whole_memory: bool = False,
    ) -> int | None:
        """Close the scope for every read in the same transaction that accepts the job."""
        if scope == "SUBJECT":
            row = conn.execute(
                "UPDATE memory.subjects SET epoch = epoch + 1, forgotten_at = now()"
                " WHERE tenant_id = %s AND user_id = %s RETURNING epoch",
                (tenant_id, subject),
            ).fetchone()
            epoch = None if row is None else int(row[0])
            conn.execute(
                "INSERT INTO control.journal (tenant_id, kind, subject_id, epoch, job_id)"
                " VALUES (%s, 'SUBJECT_EPOCH', %s, %s, %s)",
                (tenant_id, subject, epoch, job_id),
            )
            return epoch
        if scope == "MEMORY":
            if whole_memory:
                conn.execute(
                    "INSERT INTO control.journal (tenant_id, kind, memory_id, job_id)"
                    " VALUES (%s, 'MEMORY_FORGOTTEN', %s, %s)",
                    (tenant_id, memory_id, job_id),
                )
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO control.tombstones (tenant_id, memory_id, version, job_id) VALUES (%s, %s, %s, %s)"
                    " ON CONFLICT DO NOTHING",
                    [(tenant_id, memory_id, v, job_id) for v in versions],
                )
                cur.executemany(
                    "INSERT INTO control.journal (tenant_id, kind, memory_id, version, job_id)"
                    " VALUES (%s, 'TOMBSTONE', %s, %s, %s)",
                    [(tenant_id, memory_id, v, job_id) for v in versions],
                )
            return None
        conn.execute("UPDATE memory.tenants SET deleted_at = now() WHERE tenant_id = %s", (tenant_id,))
        conn.execute(
            "INSERT INTO control.journal (tenant_id, kind, job_id) VALUES (%s, 'TENANT_DELETED', %s)",
            (tenant_id, job_id),
        )
        return None


def _checked_scope(
    *,
    tenant_id: str,
    subject: str | None,
    memory_id: str | None,
    version: int | None,
    all_tenant: bool,
    confirm: str | None,
    basis: str,
    requested_by: str | None,
    request_key: str | None,
) -> str:
    """A request's scope type (SUBJECT, MEMORY or TENANT), once every argument is valid."""
    validation.check_id("tenant", tenant_id)
    validation.check_optional_id("requested_by", requested_by)
    validation.check_bool("all_tenant", all_tenant)
    validation.check_optional_str("confirm", confirm)
    if request_key is not None and not 0 < len(request_key) <= 200:
        raise ValidationError("request_key", "must be 1 to 200 characters")
    if not isinstance(basis, str) or basis not in DEADLINE_DAYS:
        raise ValidationError("basis", f"must be one of {', '.join(DEADLINE_DAYS)}")
    given = [subject is not None, memory_id is not None, all_tenant]
    if sum(given) != 1:
        raise ValidationError("scope", "give exactly one of subject, memory_id or all (the whole tenant)")
    if version is not None and memory_id is None:
        raise ValidationError("version", "is only valid with memory_id")
    if all_tenant:
        if confirm != tenant_id:
            raise ValidationError("confirm", "must repeat the tenant id to delete the whole tenant")
        return "TENANT"
    if subject is not None:
        validation.check_id("subject", subject)
        return "SUBJECT"
    validation.check_memory_id("memory_id", memory_id)
    if version is not None:
        validation.check_version(version)
    return "MEMORY"


def _job_of(row: dict[str, Any]) -> DeletionJob:
    """A job as callers see it, from its control.deletion_jobs row."""
    job: DeletionJob = {
        "job_id": row["job_id"],
        "tenant_id": row["tenant_id"],
        "state": row["state"],
        "scope": {
            "type": row["scope"],
            "subject": row["subject_id"],
            "memory_id": row["memory_id"],
            "version": row["version"],
        },
        "scope_hash": bytes(row["scope_hash"]).hex(),
        "basis": row["basis"],
        "deadline": row["deadline"].isoformat(),
        "targets": row["targets"],
        "target_versions": row["target_count"],
        "attempts": row["attempts"],
        "created_at": row["created_at"].isoformat(),
        "completed_at": None if row["completed_at"] is None else row["completed_at"].isoformat(),
    }
    if row["scope"] == "RETENTION":
        job["sweep_date"] = row["sweep_date"].isoformat()
        job.update(row["detail"])  # categories, retentionPolicyVersion
    return job


def _with_pause(conn: psycopg.Connection, job: DeletionJob) -> DeletionJob:
    """The job, with the pause that holds it when it is open and its tenant's deletion work is paused."""
    if job["state"] != "COMPLETE":
        found = switches.active_pause(conn, job["tenant_id"])
        if found is not None:
            job["paused"] = cast(DeletionPause, found)
    return job


def _announce_complete(conn: psycopg.Connection, tenant_id: str, jobs: list[DeletionJob]) -> None:
    """With the jobs COMPLETE: their subjects may be written again, and the outbox says so."""
    # Everything of the subject is gone: new writes start afresh under a new key.
    subjects = sorted({str(job["scope"]["subject"]) for job in jobs if job["scope"]["type"] == "SUBJECT"})
    if subjects:
        conn.execute(
            "UPDATE memory.subjects SET forgotten_at = NULL WHERE tenant_id = %s AND user_id = ANY(%s)",
            (tenant_id, subjects),
        )
        # Their MEMORY jobs no longer name them: their export after this lists none.
        conn.execute(
            "UPDATE control.deletion_jobs SET author_id = NULL WHERE tenant_id = %s AND author_id = ANY(%s)",
            (tenant_id, subjects),
        )
    conn.execute(
        "INSERT INTO control.outbox (job_id, tenant_id, kind, payload)"
        " SELECT x.job_id, %s, 'deletion.completed', x.payload::jsonb"
        " FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS x(job_id, payload, n) ORDER BY x.n",
        (
            tenant_id,
            [job["job_id"] for job in jobs],
            [json.dumps({"jobId": job["job_id"], "scopeHash": job["scope_hash"]}) for job in jobs],
        ),
    )


def _proof_of(
    job: DeletionJob,
    tenant_id: str,
    epoch: int | None,
    versions: int,
    targets: dict[str, Any],
    *,
    rebuilt: dict[str, int],
    adapter_versions: dict[str, str],
    verification: dict[str, Any],
    times: tuple[datetime, datetime],
) -> dict[str, Any]:
    """A COMPLETE job's proof: ids, the scope's HMAC, counts and times, never content."""
    requested, completed = times
    return {
        "jobId": job["job_id"],
        "scope": {"type": job["scope"]["type"], "tenant": tenant_id},
        "scopeHash": job["scope_hash"],
        "subjectEpoch": epoch,
        "basis": job["basis"],
        "policyVersion": POLICY_VERSION,
        "targetVersions": versions,
        "targets": targets,
        "rebuilt": rebuilt,
        "adapterVersions": adapter_versions,
        "verification": verification,
        "requestedAt": requested.isoformat(),
        "completedAt": completed.isoformat(),
        "deadline": job["deadline"],
        **(
            {"sweepDate": job["sweep_date"], "categories": job["categories"]}
            if job["scope"]["type"] == "RETENTION"
            else {}
        ),
    }


def rebuilt_counts(found: Mapping[str, Any]) -> dict[str, int]:
    """store -> records rebuilt without the scope, from a job's `found` (none recorded: {})."""
    return {k[len(REBUILT_PREFIX) :]: int(v) for k, v in found.items() if k.startswith(REBUILT_PREFIX) and int(v)}


def _backups(conn: psycopg.Connection, tenant_id: str) -> tuple[int, datetime | None]:
    """The tenant's live backups: how many, and when the last of them expires."""
    row = conn.execute(
        "SELECT count(*), max(expires_at) FROM control.backups WHERE tenant_id = %s AND expired_at IS NULL",
        (tenant_id,),
    ).fetchone()
    return (0, None) if row is None else (int(row[0]), row[1])


def _backup_status_of(backups: tuple[int, datetime | None], scope: str, *, legacy: int = 0) -> str:
    """What the tenant's live backups hold of this scope: shredded with its keys, or until they expire.

    Every scope destroys the keys its rows are sealed under (each version's own key; SUBJECT and
    TENANT every key of theirs), so every backup is unreadable for it once the keys' dead copies are
    erased from the key store's files and the KEK is rotated (PENDING_SHRED until the physical
    erasure, then SHREDDED). Only a MEMORY or RETENTION scope with `legacy` versions (sealed under
    their author's subject key before version keys, not converted yet) leaves a key alive: those rows
    stay in backups until they expire, and the restore gate's journal replay keeps them from coming back.
    """
    count, until = backups
    if scope in ("SUBJECT", "TENANT") or (count and not legacy):
        # SHREDDED only once no readable copy of the destroyed key is left: the physical erasure
        # rewrites the key store's files and scans them, then claims it.
        return f"PENDING_SHRED:{count}"
    if not count:
        return "DONE:0"
    assert until is not None  # live backups have an expiry
    return f"PENDING_EXPIRY:{until.date().isoformat()}"
