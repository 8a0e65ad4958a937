"""Forgetting: deletion jobs that hide at once, cascade through every registered store via lineage,
erase physically, destroy keys, verify (exact ids and paraphrase probes) and prove.

States: REQUESTED -> FROZEN -> DELETING -> VERIFYING -> COMPLETE, or BLOCKED from any of the
middle three. A job never reaches COMPLETE while a target is not DONE; a retry resumes
idempotently. Jobs, audit rows, the outbox and proofs hold ids, HMACs and counts, never text.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any, NoReturn

import psycopg
from psycopg.rows import dict_row

from memory_pipelines.lib.forget import gate
from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import MemoryPipelinesError, NotFoundError, ServiceError, ValidationError
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.stores import bytescan, lineage, registry
from memory_pipelines.lib.stores.adapter import Context, ever_restored
from memory_pipelines.lib.stores.derived import DerivedStores

# Paraphrase probes per run: every target up to this many, a random sample above (exact-id checks
# stay exhaustive). Each probe is a nearest-neighbour query; a batch of 100 subjects has 10,000.
MAX_PROBES = 2_000
POLICY_VERSION = "deletion-policy-2026-11"
# Days to complete by basis; a regulator's clock, not a target (we finish in seconds).
DEADLINE_DAYS = {"gdpr-art17": 30, "ccpa": 45, "user-request": 30, "retention": 30, "offboarding": 30}
# A job this close to its deadline (or past it) fails the `deletions_on_track` check.
NEAR_DEADLINE = timedelta(days=3)
MAX_BACKOFF = timedelta(hours=1)
OPEN_STATES = ("REQUESTED", "FROZEN", "DELETING", "VERIFYING", "BLOCKED")
Source = tuple[str, int]
Hook = Callable[[str, list[str]], None]


@dataclass
class Probes:
    """Recall probes of the deleted content; held in memory for one run, never stored."""

    texts: list[str]
    vectors: list[Any]
    stored: dict[str, Any] = field(default_factory=dict)  # the index's own vectors read for them, by record id
    targets: int = 0  # versions the probes were drawn from (more than the probes when sampled)


@dataclass
class Batch:
    """One run of a tenant's deletion jobs between `begin` and `release`; lives in one process only.

    It holds the tenant's run lock (an advisory lock on `lock_conn`) and the paraphrase probes, which
    are plaintext: never persist a batch, log it or hand it to anything that serialises it.
    """

    tenant_id: str
    jobs: list[dict[str, Any]]
    lock_conn: psycopg.Connection | None = None
    lock_key: str = ""
    fixed: dict[str, set[Source]] = field(default_factory=dict)
    targets: dict[str, set[Source]] = field(default_factory=dict)
    found: dict[str, dict[str, int]] = field(default_factory=dict)
    probes: Probes = field(default_factory=lambda: Probes(texts=[], vectors=[]), repr=False)
    deleted: dict[str, set[str]] = field(default_factory=dict)  # store -> records this run deleted
    verification: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def job_ids(self) -> list[str]:
        """Ids of the jobs this batch runs (COMPLETE ones were left out at `begin`)."""
        return [job["job_id"] for job in self.jobs]


class DeletionBlocked(MemoryPipelinesError):
    """A store step or the verification failed; the job is BLOCKED with an error code per target."""

    exit_code = 8

    def __init__(self, store: str, code: str, detail: str) -> None:
        super().__init__(store, f"{code}: {detail}")
        self.code = code


def _now() -> datetime:
    return datetime.now(UTC)


def _error_code(store: str, exc: BaseException) -> str:
    if isinstance(exc, DeletionBlocked):
        return exc.code
    if isinstance(exc, psycopg.OperationalError) or type(exc).__name__ == "ServiceError":
        return f"{store.upper()}_UNAVAILABLE"
    return f"{store.upper()}_{type(exc).__name__.upper()}"


class DeletionLedger:
    """Reads the deletion control plane (jobs, proofs, pending batches); needs only the memory store."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    @staticmethod
    def _job(conn: psycopg.Connection, job_id: str) -> dict[str, Any]:
        validation.check_id("job_id", job_id)
        with conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute("SELECT * FROM control.deletion_jobs WHERE job_id = %s", (job_id,)).fetchone()
        if row is None:
            raise NotFoundError("job_id", f"no deletion job {job_id!r}")
        return {
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
            **({"sweep_date": row["sweep_date"].isoformat(), **row["detail"]} if row["scope"] == "RETENTION" else {}),
        }

    def status(self, *, job_id: str) -> dict[str, Any]:
        with self.store.transaction() as conn:
            return self._job(conn, job_id)

    def proof(self, *, job_id: str) -> dict[str, Any]:
        with self.store.transaction() as conn:
            job = self._job(conn, job_id)
            row = conn.execute("SELECT proof FROM control.deletion_jobs WHERE job_id = %s", (job_id,)).fetchone()
        if row is None or row[0] is None:
            raise NotFoundError("job_id", f"job {job_id} is {job['state']}; a proof exists once it is COMPLETE")
        return dict(row[0])

    def list_jobs(self, *, state: str | None = None, tenant_id: str | None = None) -> list[dict[str, Any]]:
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
            return [self._job(conn, job_id) for job_id in ids]

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

    def ledger(self, *, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """Every open job as ids, state, ledger sequence, attempts and times (what the forget sensor reads)."""
        validation.check_optional_id("tenant", tenant_id)
        with self.store.transaction() as conn, conn.cursor(row_factory=dict_row) as cur:
            return cur.execute(
                "SELECT job_id, tenant_id, state, seq, attempts, next_attempt_at, deadline, updated_at,"
                " targets::text LIKE '%%FAILED:VERIFICATION\\_%%' AS verification_failed"
                " FROM control.deletion_jobs WHERE state <> 'COMPLETE' AND (%s::text IS NULL OR tenant_id = %s)"
                " ORDER BY seq NULLS FIRST, created_at",
                (tenant_id, tenant_id),
            ).fetchall()

    def forget_running(self, *, tenant_id: str) -> bool:
        """Whether a live process holds the tenant's forget run lock now (a forget or a restore).

        A session lock dies with its connection, so a run worker killed mid-forget holds nothing: the
        forget sensor uses this to tell a dead worker from a slow one."""
        key = f"forget\x1f{tenant_id}"
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


def backoff(attempts: int) -> timedelta:
    """How long a BLOCKED job waits before its next attempt: 1 minute, doubling, at most 1 hour
    (the same rule as the ledger trigger of migration 0009)."""
    return min(MAX_BACKOFF, timedelta(minutes=1) * 2 ** min(max(attempts, 1) - 1, 12))


# A non-fresh forget run (relaunch, retry) waits this long after the tenant's last run ended, so a
# run that fails before reaching the jobs is not relaunched in a tight loop.
RELAUNCH_GRACE = timedelta(minutes=1)
MAX_RELAUNCH_GRACE = timedelta(hours=1)
# A job left FROZEN, DELETING or VERIFYING this long with no run in progress was orphaned by a run
# that died; a relaunch resumes it (the tenant run lock makes a needless one a no-op).
STALL_GRACE = timedelta(minutes=5)
# How long a new request waits before the sensor runs it: `forget --wait` requests, then submits its
# own run (a code server starts first, a few seconds); the sensor leaves the job to that run.
REQUEST_SETTLE = timedelta(seconds=30)
_IN_FLIGHT = ("FROZEN", "DELETING", "VERIFYING")
# Key prefix, in a job's `found`, of the records a store rebuilt without the scope instead of deleting.
REBUILT_PREFIX = "rebuilt:"


@dataclass(frozen=True)
class PlannedRun:
    """One forget run the sensor should request: a tenant, its job ids and a run key."""

    tenant_id: str
    job_ids: list[str]
    run_key: str
    reason: str


@dataclass(frozen=True)
class LastRun:
    """The tenant's latest forget run as the sensor sees it: `active`, `failed` or `succeeded`."""

    run_id: str
    status: str
    ended_at: datetime | None
    failures: int = 0  # consecutive failed forget runs of the tenant, this one included


def relaunch_grace(last: LastRun) -> timedelta:
    """How long after a tenant's last forget run ended before its jobs are run again: a minute, doubling
    per consecutive failed run up to an hour, so a run that fails before it records anything (a worker
    that never starts, the database away) is not relaunched every minute forever."""
    return min(RELAUNCH_GRACE * 2 ** max(last.failures - 1, 0), MAX_RELAUNCH_GRACE)


def plan_forget_runs(
    rows: list[dict[str, Any]],
    *,
    cursor: int,
    last_runs: dict[str, LastRun],
    now: datetime,
    claimed: frozenset[str] | set[str] = frozenset(),
    settle: timedelta = REQUEST_SETTLE,
) -> tuple[list[PlannedRun], int]:
    """Which forget runs to request from the open jobs of `DeletionLedger.ledger`, and the new cursor.

    New requests (REQUESTED, seq > cursor) get one run per tenant, keyed by their highest seq, once
    they are `settle` old; they queue behind a run in progress. A job a forget run not yet ended
    names (`claimed`: e.g. the run of `forget --wait`) is that run's, never launched again. With no
    run of the tenant in progress, a BLOCKED job whose backoff ended, and a job still REQUESTED (or
    left in flight) after the tenant's last run ended, get a run keyed by the last run's id as well,
    so each failed run is relaunched once. The cursor stays below a request that has not settled.
    """
    fresh: dict[str, list[dict[str, Any]]] = {}
    again: dict[str, list[dict[str, Any]]] = {}
    unsettled: list[int] = []
    for row in rows:
        tenant, seq, state = row["tenant_id"], row["seq"], row["state"]
        if row["job_id"] in claimed:
            continue
        if state == "REQUESTED" and seq is not None and seq > cursor:
            if now - row["updated_at"] < settle:
                unsettled.append(seq)  # its requester may be submitting its own run right now
            else:
                fresh.setdefault(tenant, []).append(row)
            continue
        last = last_runs.get(tenant)
        waiting = last is not None and (
            last.status == "active" or (last.ended_at is not None and now - last.ended_at < relaunch_grace(last))
        )
        if waiting:
            continue
        # A job blocked by its verification found forgotten data: a person looks first (`deletion retry`),
        # since a retry after the primary rows are gone has no text left to build paraphrase probes from.
        due = (
            (
                state == "BLOCKED"
                and not row.get("verification_failed")
                and (row["next_attempt_at"] is None or row["next_attempt_at"] <= now)
            )
            or state == "REQUESTED"
            or (state in _IN_FLIGHT and now - row["updated_at"] >= STALL_GRACE)
        )
        if due:
            again.setdefault(tenant, []).append(row)
    planned = [
        PlannedRun(
            t,
            [r["job_id"] for r in jobs + again.pop(t, [])],  # due retries of the tenant ride along
            f"forget:{t}:{max(r['seq'] for r in jobs)}",
            "requested",
        )
        for t, jobs in sorted(fresh.items())
    ]
    for tenant, jobs in sorted(again.items()):
        last = last_runs.get(tenant)
        top = max((r["seq"] or 0) for r in jobs)
        planned.append(
            PlannedRun(
                tenant,
                [r["job_id"] for r in jobs],
                f"forget:{tenant}:{top}:after:{last.run_id if last else 'none'}",
                "retry" if all(r["state"] == "BLOCKED" for r in jobs) else "relaunch",
            )
        )
    requested = [r["seq"] for r in rows if r["seq"] is not None and r["state"] == "REQUESTED"]
    # Requests launched now that sit above a held-back one come again next tick as claimed (their run
    # exists by then), so holding the cursor never launches them twice.
    new_cursor = min(unsettled) - 1 if unsettled else max([cursor, *requested])
    return planned, max(cursor, new_cursor)


class DeletionService(DeletionLedger):
    """Accepts deletion requests and runs them. `hooks` let fault-injection tests act between steps."""

    def __init__(
        self,
        derived: DerivedStores,
        *,
        hooks: dict[str, Hook] | None = None,
        drain_timeout: float = 30.0,
        erasure_hours: int | None = None,
    ) -> None:
        super().__init__(derived.store)
        self.derived = derived
        # Read when the service is made (never at import): MEMORY_PIPELINES_ERASURE_HOURS.
        self.erasure_hours = Settings.from_env().erasure_hours if erasure_hours is None else erasure_hours
        self.hooks = hooks or {}
        self.gate = gate.Gate(derived.store)
        self.drain_timeout = drain_timeout

    # -- requests ------------------------------------------------------------------------------

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
    ) -> dict[str, Any]:
        """Accept a request, resolved to a stable scope, and hide that scope from every read at once.

        `request_key` makes the request idempotent for its caller whatever happened since (e.g. a
        Dagster run's root run id): the job first accepted under that key is returned again
        (`duplicate`), COMPLETE or not, and nothing new is accepted."""
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
            scope = "TENANT"
            if confirm != tenant_id:
                raise ValidationError("confirm", "must repeat the tenant id to delete the whole tenant")
        elif subject is not None:
            scope = "SUBJECT"
            validation.check_id("subject", subject)
        else:
            scope = "MEMORY"
            validation.check_memory_id("memory_id", memory_id)
            if version is not None:
                validation.check_version(version)
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
            job_id = "del_" + uuid.uuid4().hex
            deadline = _now() + timedelta(days=DEADLINE_DAYS[basis])
            conn.execute(
                "INSERT INTO control.deletion_jobs (job_id, tenant_id, scope, subject_id, memory_id, version,"
                " scope_hash, basis, policy_version, state, deadline) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s,"
                " 'REQUESTED', %s)",
                (job_id, tenant_id, scope, subject, memory_id, version, scope_hash, basis, POLICY_VERSION, deadline),
            )
            epoch = self._hide(
                conn, job_id, scope, tenant_id, subject, memory_id, versions, whole_memory=version is None
            )
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
            self._key_request(conn, tenant_id, request_key, job_id)
            received = {"scope": scope, "basis": basis, **({"requested_by": requested_by} if requested_by else {})}
            self._audit(conn, job_id, tenant_id, "received", "REQUESTED", received)
            return {**self._job(conn, job_id), "duplicate": False}

    def _keyed_job(self, conn: psycopg.Connection, tenant_id: str, request_key: str | None) -> dict[str, Any] | None:
        """The job a request with this key was answered with before, if any."""
        if request_key is None:
            return None
        row = conn.execute(
            "SELECT job_id FROM control.deletion_request_keys WHERE tenant_id = %s AND request_key = %s",
            (tenant_id, request_key),
        ).fetchone()
        return None if row is None else self._job(conn, row[0])

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

    def shred_keys(self, *, tenant_id: str, subject: str | None = None, confirm: str | None = None) -> dict[str, Any]:
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
            self._audit(conn, job["job_id"], tenant_id, "keys_shredded", job["state"], {"keys": len(destroyed)})
        try:
            # Crypto-shredding now means now: the tenant's key partitions are rewritten at once (small,
            # and no other tenant's), so no dead copy of a wrapped key waits for the erasure run.
            registry.adapter("key_store").erase(self.derived, tenant_id)
        except (MemoryPipelinesError, psycopg.Error):
            pass  # the keys are gone already; the tenant's physical erasure compacts them again
        return {"tenant_id": tenant_id, "subject": subject, "destroyed_keys": destroyed, "forget_job": job}

    def _scope(self, conn: psycopg.Connection, tenant_id: str, parts: list[str]) -> tuple[bytes, dict[str, Any] | None]:
        """The scope's HMAC under the control-plane key, and the job already open for it, if any."""
        scope_hash = crypto.mac(self.store.keys.control_key(conn), json.dumps(parts).encode())
        row = conn.execute(
            "SELECT job_id FROM control.deletion_jobs WHERE tenant_id = %s AND scope_hash = %s AND state <> 'COMPLETE'",
            (tenant_id, scope_hash),
        ).fetchone()
        return scope_hash, None if row is None else self._job(conn, row[0])

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
            self._audit(
                conn, job_id, tenant_id, "received", "REQUESTED", {"scope": "RETENTION", "categories": categories}
            )
            return {**self._job(conn, job_id), "duplicate": False}

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

    # -- running ---------------------------------------------------------------------------------

    def _audit(
        self, conn: psycopg.Connection, job_id: str, tenant_id: str, event: str, state: str, detail: dict[str, Any]
    ) -> None:
        conn.execute(
            "INSERT INTO control.audit (job_id, tenant_id, event, state, detail) VALUES (%s, %s, %s, %s, %s)",
            (job_id, tenant_id, event, state, json.dumps(detail)),
        )

    def _set_state(self, jobs: list[dict[str, Any]], state: str, **detail: Any) -> None:
        with self.store.transaction() as conn:
            for job in jobs:
                conn.execute(
                    "UPDATE control.deletion_jobs SET state = %s, updated_at = now() WHERE job_id = %s",
                    (state, job["job_id"]),
                )
                self._audit(conn, job["job_id"], job["tenant_id"], "state", state, detail)
                job["state"] = state

    def _hook(self, step: str, jobs: list[dict[str, Any]]) -> None:
        if step in self.hooks:
            self.hooks[step](step, [job["job_id"] for job in jobs])

    def run_batch(self, *, tenant_id: str, job_ids: list[str]) -> dict[str, Any]:
        """Run deletion jobs of one tenant together: each store is visited once for the whole batch.

        One runner per tenant at a time (a session advisory lock): a sensor-launched run and a
        `forget --wait` never interleave; the second finds the jobs COMPLETE and returns. The
        phases are `begin`, `delete_store` per registered store, `verify`, `complete`, `release`.
        """
        batch = self.begin(tenant_id=tenant_id, job_ids=job_ids)
        try:
            if batch.jobs:
                for spec in registry.stores():
                    self.delete_store(batch, spec.name)
                self.verify(batch)
                self.complete(batch)
            return self.summary(batch)
        finally:
            self.release(batch)

    def begin(self, *, tenant_id: str, job_ids: list[str]) -> Batch:
        """Take the tenant's run lock, freeze the jobs, wait for permits to drain, fix targets and probes.

        The returned batch holds the lock on its own connection until `release`; it holds the
        paraphrase probes (plaintext) in memory only. No jobs left to run: a batch with none.
        """
        validation.check_id("tenant", tenant_id)
        for job_id in job_ids:
            validation.check_id("job_id", job_id)
        lock_key = f"forget\x1f{tenant_id}"
        try:
            lock_conn = psycopg.connect(self.store.conninfo, autocommit=True)
        except psycopg.OperationalError as exc:
            raise DeletionBlocked("postgres", "POSTGRES_UNAVAILABLE", str(exc)) from exc
        batch = Batch(tenant_id=tenant_id, jobs=[], lock_conn=lock_conn, lock_key=lock_key)
        try:
            # Seed 2 is the tenant run lock (seed 0: per-subject write locks, seed 1: the gate).
            lock_conn.execute("SELECT pg_advisory_lock(hashtextextended(%s, 2))", (lock_key,))
            self._freeze(batch, job_ids)
        except BaseException:
            self.release(batch)
            raise
        return batch

    def _freeze(self, batch: Batch, job_ids: list[str]) -> None:
        tenant_id = batch.tenant_id
        with self.store.transaction() as conn:
            jobs = [self._job(conn, job_id) for job_id in job_ids]
        for job in jobs:
            if job["tenant_id"] != tenant_id:
                raise ValidationError("job_id", f"job {job['job_id']} belongs to another tenant")
        jobs = [job for job in jobs if job["state"] != "COMPLETE"]
        for job in jobs:
            # A retry starts from the stores' last statuses; failures of other steps are history (audit).
            job["targets"] = {k: v for k, v in job["targets"].items() if registry.is_registered(k)}
        batch.jobs = jobs
        if not jobs:
            return
        with self.store.transaction() as conn:
            conn.execute(
                "UPDATE control.deletion_jobs SET attempts = attempts + 1 WHERE job_id = ANY(%s)",
                ([j["job_id"] for j in jobs],),
            )
        step = "freeze"
        try:
            started = time.perf_counter()
            self._set_state(jobs, "FROZEN")
            step = "gate"
            # Permits issued before the fence closed must be released or cancelled first; an expired
            # lease does not count as drained, and a drain deadline is a block, never completion.
            left = self.gate.wait_drained(
                tenant_id=tenant_id, job_ids=[j["job_id"] for j in jobs], timeout=self.drain_timeout
            )
            if left:
                raise DeletionBlocked("gate", "UNDRAINED_PERMITS", f"{left} permit(s) still in flight")
            step = "freeze"
            batch.fixed = self._resolve_targets(tenant_id, jobs)
            # Copies of versions the scope covers whose primary row a restore dropped go too; they are
            # looked up at every run, and are not targets of the proof (no row, no key of theirs).
            batch.targets = self._with_orphans(tenant_id, jobs, batch.fixed)
            batch.found = self._found(tenant_id, jobs, batch.targets)
            batch.probes = self._probes(tenant_id, set().union(*batch.targets.values()))
            self._fingerprint(batch)
            batch.timings["freeze"] = time.perf_counter() - started
            self._hook("frozen", jobs)
            self._set_state(jobs, "DELETING")
        except Exception as exc:
            self._fail(batch, step, exc)

    @staticmethod
    def _hold(batch: Batch) -> None:
        """The batch still holds the tenant's run lock. Store connections come from a pool that
        replaces dropped ones, so a lost session would otherwise go unnoticed: no step runs, and
        nothing becomes COMPLETE, without the lock."""
        conn = batch.lock_conn
        try:
            if conn is None or conn.closed or conn.broken:
                raise psycopg.OperationalError("its connection is closed")
            conn.execute("SELECT 1")
        except psycopg.Error as exc:
            raise DeletionBlocked("postgres", "RUN_LOCK_LOST", f"the tenant's forget run lock was lost: {exc}") from exc

    def _fail(self, batch: Batch, step: str, exc: Exception) -> NoReturn:
        code = _error_code(step, exc)
        if code == "RUN_LOCK_LOST" or code.endswith("_UNAVAILABLE"):
            self.store.close()  # its idle connections may be dead too: record BLOCKED on a fresh one
        self._block(batch.jobs, step, code)
        raise DeletionBlocked(step, code, f"{type(exc).__name__}: {exc}") from exc

    def delete_store(self, batch: Batch, store_name: str) -> int:
        """Delete every record of one registered store derived from the batch's targets; returns the count."""
        if not registry.is_registered(store_name):
            raise ValidationError("store", f"no registered store {store_name!r}")
        if not batch.jobs:
            return 0
        try:
            self._hold(batch)
            started = time.perf_counter()
            self._delete_in(store_name, batch)
            batch.timings[store_name] = time.perf_counter() - started
            # DONE:n counts what existed when the job first froze, so a retry after a lost
            # answer still reports what was deleted (the adapters are idempotent and find 0).
            self._record_targets(batch.jobs, store_name, {job_id: f[store_name] for job_id, f in batch.found.items()})
            self._hook(f"deleted:{store_name}", batch.jobs)
        except Exception as exc:
            self._fail(batch, store_name, exc)
        return sum(f[store_name] for f in batch.found.values())

    def verify(self, batch: Batch) -> dict[str, Any]:
        """Exact-id queries on every store and paraphrase probes; drops the probes once used."""
        if not batch.jobs:
            return {}
        try:
            self._hold(batch)
            self._set_state(batch.jobs, "VERIFYING")
            started = time.perf_counter()
            batch.verification = self._verify(batch)
            batch.timings["verify"] = time.perf_counter() - started
            batch.probes = Probes(texts=[], vectors=[])
            self._hook("verified", batch.jobs)
        except Exception as exc:
            self._fail(batch, "verify", exc)
        return batch.verification

    def complete(self, batch: Batch) -> list[dict[str, Any]]:
        """Mark the verified jobs COMPLETE and return their proofs (ids, HMACs and counts only)."""
        if not batch.jobs:
            return []
        try:
            if batch.verification is None:
                raise DeletionBlocked("verify", "NOT_VERIFIED", "the batch was not verified")
            self._hold(batch)
            return self._complete(batch.tenant_id, batch.jobs, batch.fixed, batch.verification, batch.found)
        except Exception as exc:
            self._fail(batch, "verify", exc)

    def release(self, batch: Batch) -> None:
        """Drop the probes and give the tenant's run lock back (idempotent)."""
        batch.probes = Probes(texts=[], vectors=[])
        conn, batch.lock_conn = batch.lock_conn, None
        if conn is None:
            return
        # A session that died has released its advisory lock already; nothing to undo then.
        try:
            conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 2))", (batch.lock_key,))
        except psycopg.Error:
            pass
        conn.close()

    @staticmethod
    def summary(batch: Batch) -> dict[str, Any]:
        """What a batch did: job states, records per store (as first found), seconds per phase."""
        return {
            "tenant_id": batch.tenant_id,
            "jobs": {job["job_id"]: job["state"] for job in batch.jobs},
            # Records deleted per store: those reached, less those rebuilt without the scope.
            "stores": (
                {
                    spec.name: sum(f[spec.name] - rebuilt_counts(f).get(spec.name, 0) for f in batch.found.values())
                    for spec in registry.stores()
                }
                if batch.jobs
                else {}
            ),
            "rebuilt": {
                name: n
                for name in registry.names()
                if (n := sum(rebuilt_counts(f).get(name, 0) for f in batch.found.values()))
            },
            **({"seconds": {name: round(value, 4) for name, value in batch.timings.items()}} if batch.jobs else {}),
        }

    def _probes(self, tenant_id: str, sources: set[Source]) -> Probes:
        """Paraphrase probes, built in memory from each target before deletion and discarded after.

        The texts feed the keyword probes; the semantic probes reuse each target's stored vector
        (the embedding of that very text) and embed only targets that have none, such as
        superseded versions.
        """
        chosen = sorted(sources)
        if len(chosen) > MAX_PROBES:
            # A retention sweep or a large batch: exact-id checks stay exhaustive, paraphrase probes
            # are a random sample (the proof says how many, of how many).
            chosen = sorted(random.sample(chosen, MAX_PROBES))
        texts = self.store.open_texts(tenant_id=tenant_id, sources=chosen, skip_unreadable=True)
        try:
            if self.derived.vectors.existing(tenant_id) is None:
                # No index: nothing a vector could find.
                return Probes(texts=list(texts.values()), vectors=[], targets=len(sources))
            stored = self.derived.vectors.vectors_of(tenant_id, [f"{m}:{v}" for m, v in sorted(texts)])
        except ServiceError:
            stored = {}  # Chroma down: embed every probe; the Chroma step itself will block the job
        missing = [source for source in sorted(texts) if f"{source[0]}:{source[1]}" not in stored]
        vectors = list(stored.values())
        if missing:
            vectors += list(self.derived.vectors.embedder.embed([texts[source] for source in missing]))
        return Probes(texts=list(texts.values()), vectors=vectors, stored=stored, targets=len(sources))

    def _block(self, jobs: list[dict[str, Any]], step: str, code: str) -> None:
        try:
            with self.store.transaction() as conn:
                for job in jobs:
                    targets = dict(job["targets"])
                    targets[step] = f"FAILED:{code}"
                    conn.execute(
                        "UPDATE control.deletion_jobs SET state = 'BLOCKED', targets = %s, updated_at = now()"
                        " WHERE job_id = %s",
                        (json.dumps(targets), job["job_id"]),
                    )
                    self._audit(
                        conn, job["job_id"], job["tenant_id"], "blocked", "BLOCKED", {"step": step, "code": code}
                    )
        except MemoryPipelinesError:
            pass  # the control plane itself is unreachable: the job stays in its last recorded state

    def _resolve_targets(self, tenant_id: str, jobs: list[dict[str, Any]]) -> dict[str, set[Source]]:
        """job_id -> exact (memory_id, version) set, fixed at the first run and reused on resume."""
        out: dict[str, set[Source]] = {}
        with self.store.transaction() as conn:
            for job in jobs:
                is_fixed = conn.execute(
                    "SELECT targets_fixed FROM control.deletion_jobs WHERE job_id = %s", (job["job_id"],)
                ).fetchone()
                if is_fixed is not None and is_fixed[0]:
                    fixed = conn.execute(
                        "SELECT memory_id, version FROM control.deletion_targets WHERE job_id = %s", (job["job_id"],)
                    ).fetchall()
                    out[job["job_id"]] = {(m, v) for m, v in fixed}
                    continue
                scope = job["scope"]
                if scope["type"] == "SUBJECT":
                    query = (
                        "SELECT v.memory_id, v.version FROM memory.memory_versions v JOIN memory.memories m"
                        " ON m.tenant_id = v.tenant_id AND m.memory_id = v.memory_id"
                        " WHERE v.tenant_id = %s AND m.user_id = %s"
                    )
                    rows = conn.execute(query, (tenant_id, scope["subject"])).fetchall()
                elif scope["type"] in ("MEMORY", "RETENTION"):
                    rows = conn.execute(
                        "SELECT memory_id, version FROM control.tombstones WHERE job_id = %s", (job["job_id"],)
                    ).fetchall()
                else:
                    rows = conn.execute(
                        "SELECT memory_id, version FROM memory.memory_versions WHERE tenant_id = %s", (tenant_id,)
                    ).fetchall()
                with conn.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO control.deletion_targets (job_id, memory_id, version) VALUES (%s, %s, %s)"
                        " ON CONFLICT DO NOTHING",
                        [(job["job_id"], m, v) for m, v in rows],
                    )
                conn.execute(
                    "UPDATE control.deletion_jobs SET target_count = %s, targets_fixed = true WHERE job_id = %s",
                    (len(rows), job["job_id"]),
                )
                out[job["job_id"]] = {(m, v) for m, v in rows}
        return out

    def _with_orphans(
        self, tenant_id: str, jobs: list[dict[str, Any]], fixed: dict[str, set[Source]]
    ) -> dict[str, set[Source]]:
        with self.store.transaction() as conn:
            orphans = self._orphans(conn, tenant_id)
        return {
            job["job_id"]: fixed[job["job_id"]]
            | self._covered(orphans, job["scope"], {m for m, _ in fixed[job["job_id"]]})
            for job in jobs
        }

    @staticmethod
    def _orphans(conn: psycopg.Connection, tenant_id: str) -> list[tuple[str, int, str | None]]:
        """Versions with derived records but no primary row any more (a restore removed them after
        they were indexed, summarised or cached), each with its memory's author (None: memory gone).

        Only a restore makes them, so a tenant never restored skips the scan of its lineage; one scan
        a batch otherwise. The anti-join runs first and each orphan's memory is one primary-key probe,
        so a plan built on a new tenant's stale statistics stays linear (a join of lineage to the
        tenant's memories by tenant alone took minutes at 10,000 memories)."""
        if not ever_restored(conn, tenant_id):
            return []
        rows = conn.execute(
            "WITH o AS MATERIALIZED (SELECT DISTINCT l.source_memory_id, l.source_version FROM derived.lineage l"
            " WHERE l.tenant_id = %(t)s AND NOT EXISTS (SELECT 1 FROM memory.memory_versions v"
            "  WHERE v.tenant_id = %(t)s AND v.memory_id = l.source_memory_id AND v.version = l.source_version))"
            " SELECT o.source_memory_id, o.source_version, m.user_id FROM o LEFT JOIN LATERAL"
            " (SELECT m.user_id FROM memory.memories m WHERE m.tenant_id = %(t)s AND m.memory_id = o.source_memory_id"
            "  OFFSET 0) m ON true",
            {"t": tenant_id},
        ).fetchall()
        return [(str(m), int(v), user) for m, v, user in rows]

    @staticmethod
    def _covered(
        orphans: list[tuple[str, int, str | None]], scope: dict[str, Any], memory_ids: set[str]
    ) -> set[Source]:
        """The orphans a scope covers: a subject's (or the tenant's) forget takes those whose memory is
        theirs or gone with an unknown author; a memory's or a sweep's, those of its memories."""
        subject = scope["subject"] if scope["type"] == "SUBJECT" else None
        return {
            (m, v)
            for m, v, author in orphans
            if scope["type"] == "TENANT" or m in memory_ids or (subject is not None and author in (None, subject))
        }

    def _found(
        self, tenant_id: str, jobs: list[dict[str, Any]], targets: dict[str, set[Source]]
    ) -> dict[str, dict[str, int]]:
        """job_id -> store -> records that existed at the job's first freeze (kept across retries)."""
        out: dict[str, dict[str, int]] = {}
        with self.store.transaction() as conn:
            for job in jobs:
                row = conn.execute(
                    "SELECT found FROM control.deletion_jobs WHERE job_id = %s", (job["job_id"],)
                ).fetchone()
                if row is not None and row[0] is not None:
                    out[job["job_id"]] = dict(row[0])
                    continue
                ctx = Context(derived=self.derived, tenant_id=tenant_id, jobs=[job], everything=targets[job["job_id"]])
                counts = {spec.name: len(registry.adapter(spec.name).find(conn, ctx)) for spec in registry.stores()}
                conn.execute(
                    "UPDATE control.deletion_jobs SET found = %s WHERE job_id = %s", (json.dumps(counts), job["job_id"])
                )
                out[job["job_id"]] = counts
        return out

    # -- stores, through their adapters -------------------------------------------------------

    def _context(self, batch: Batch, store_name: str | None = None) -> Context:
        return Context(
            derived=self.derived,
            tenant_id=batch.tenant_id,
            jobs=batch.jobs,
            everything=set().union(*batch.targets.values()),
            records=batch.deleted.get(store_name, set()) if store_name else set(),
        )

    def _delete_in(self, store_name: str, batch: Batch) -> None:
        """Delete every record of `store_name` derived from the targets (counts come from `_found`).

        A record also derived from versions outside the targets (a team summary of other members too)
        is rebuilt without them, not deleted: how many were is recorded per job (`rebuilt:<store>` in
        `found`), so the proof's DONE:n (records reached) tells deleted from rebuilt records."""
        adapter = registry.adapter(store_name)
        ctx = self._context(batch)
        with self.store.transaction() as conn:
            ctx.records = adapter.find(conn, ctx)
            shared = _shared_records(conn, batch.tenant_id, store_name, ctx.records, ctx.everything)
            reached = self._reached(conn, batch, store_name, shared)
        adapter.delete(ctx)
        batch.deleted[store_name] = batch.deleted.get(store_name, set()) | ctx.records  # verified by this run
        if shared:
            with self.store.transaction() as conn:
                kept = _records_left(conn, batch.tenant_id, store_name, shared)
                for job_id, records in reached.items():
                    key = f"{REBUILT_PREFIX}{store_name}"
                    batch.found.setdefault(job_id, {})[key] = len(kept & records)
                    conn.execute(
                        "UPDATE control.deletion_jobs SET found = coalesce(found, '{}'::jsonb) || %s::jsonb"
                        " WHERE job_id = %s",
                        (json.dumps({key: len(kept & records)}), job_id),
                    )

    def _reached(
        self, conn: psycopg.Connection, batch: Batch, store_name: str, shared: set[str]
    ) -> dict[str, set[str]]:
        """job_id -> those of `shared` the job's own targets reach (one job: all of them)."""
        if not shared or len(batch.jobs) == 1:
            return {job["job_id"]: shared for job in batch.jobs}
        adapter = registry.adapter(store_name)
        return {
            job["job_id"]: shared
            & adapter.find(
                conn,
                Context(
                    derived=self.derived, tenant_id=batch.tenant_id, jobs=[job], everything=batch.targets[job["job_id"]]
                ),
            )
            for job in batch.jobs
        }

    def _fingerprint(self, batch: Batch) -> None:
        """Keyed fingerprints of what each store holds of the targets, for the physical erasure's
        byte scan (the bytes themselves are never kept). Taken once per job and store, before that
        store deletes; a store that is down now is fingerprinted at the next freeze (its own step
        blocks the job meanwhile). Each store that had nothing leaves a 0 row (never scanned for)."""
        with self.store.transaction() as conn:
            taken = set(
                conn.execute(
                    "SELECT DISTINCT job_id, store FROM control.erasure_fingerprints WHERE job_id = ANY(%s)",
                    (batch.job_ids,),
                ).fetchall()
            )
            base = bytescan.base_from_key(self.store.keys.control_key(conn))
        rows: list[tuple[str, str, int]] = []
        with self.store.transaction() as conn:
            for spec in registry.stores():
                adapter = registry.adapter(spec.name)
                jobs = [
                    job
                    for job in batch.jobs
                    if (job["job_id"], spec.name) not in taken
                    and not str(job["targets"].get(spec.name, "")).startswith("DONE:")
                ]
                ctxs = [
                    Context(
                        derived=self.derived,
                        tenant_id=batch.tenant_id,
                        jobs=[job],
                        everything=batch.targets[job["job_id"]],
                        vectors=batch.probes.stored,
                    )
                    for job in jobs
                ]
                try:
                    for ctx in ctxs:
                        ctx.records = adapter.find(conn, ctx)
                    # One read of the store for the whole batch where the adapter can (Chroma: a
                    # get per job was most of a 100-subject freeze), else one per job.
                    many = getattr(adapter, "fingerprints_many", None)
                    windows = many(conn, ctxs) if many else [adapter.fingerprints(conn, ctx) for ctx in ctxs]
                except ServiceError:
                    continue
                for job, found in zip(jobs, windows, strict=True):
                    fingerprints = set(bytescan.fingerprints(found, base)) | {0}
                    rows += [(job["job_id"], spec.name, fp) for fp in sorted(fingerprints)]
            # COPY: a batch of 100 subjects has about 100,000 rows, and row-by-row inserts took seconds.
            conn.execute(
                "CREATE TEMP TABLE IF NOT EXISTS erasure_fingerprints_in"
                " (job_id text, store text, fingerprint bigint) ON COMMIT DELETE ROWS"
            )
            with conn.cursor() as cur, cur.copy("COPY erasure_fingerprints_in FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
            conn.execute(
                "INSERT INTO control.erasure_fingerprints (job_id, store, fingerprint)"
                " SELECT job_id, store, fingerprint FROM erasure_fingerprints_in ON CONFLICT DO NOTHING"
            )

    def _record_targets(self, jobs: list[dict[str, Any]], store_name: str, counts: dict[str, int]) -> None:
        with self.store.transaction() as conn:
            for job in jobs:
                targets = dict(job["targets"])
                targets[store_name] = f"DONE:{counts.get(job['job_id'], 0)}"
                job["targets"] = targets
                conn.execute(
                    "UPDATE control.deletion_jobs SET targets = %s, updated_at = now() WHERE job_id = %s",
                    (json.dumps(targets), job["job_id"]),
                )

    # -- verification and proof ---------------------------------------------------------------

    def _verify(self, batch: Batch) -> dict[str, Any]:
        """Exact-id queries on every store plus paraphrase probes; any hit blocks the job."""
        probes = batch.probes
        leftovers: dict[str, int] = {}
        probe_hits = 0
        for spec in registry.stores():
            adapter = registry.adapter(spec.name)
            ctx = self._context(batch, spec.name)
            leftovers[spec.name] = adapter.count(ctx)
            probe_hits += adapter.verify(ctx, probes)
        ctx = self._context(batch)
        with self.store.transaction() as conn:
            row = conn.execute(_LINEAGE_LEFT, (*lineage.pair_arrays(sorted(ctx.everything)), ctx.tenant_id)).fetchone()
        leftovers["lineage"] = int(row[0]) if row else 0
        leftovers["paraphrase_probes"] = probe_hits
        bad = {store: n for store, n in leftovers.items() if n}
        if bad:
            store, count = next(iter(bad.items()))
            raise DeletionBlocked(store, f"VERIFICATION_{store.upper()}", f"{count} record(s) of forgotten data found")
        return {
            "exact_id_queries": {store: 0 for store in leftovers if store != "paraphrase_probes"},
            "paraphrase_probes": {"probes": len(probes.texts), "of": probes.targets, "hits": 0},
        }

    def _complete(
        self,
        tenant_id: str,
        jobs: list[dict[str, Any]],
        targets: dict[str, set[Source]],
        verification: dict[str, Any],
        found: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        proofs = []
        with self.store.transaction() as conn:
            for job in jobs:
                statuses = [str(job["targets"].get(spec.name, "PENDING")) for spec in registry.stores()]
                if not all(status.startswith("DONE:") for status in statuses):
                    raise DeletionBlocked("targets", "TARGET_NOT_DONE", "a store has not confirmed its deletion")
                completed = _now()
                row = conn.execute(
                    "SELECT subject_epoch, created_at FROM control.deletion_jobs WHERE job_id = %s", (job["job_id"],)
                ).fetchone()
                assert row is not None
                erase_by = completed + timedelta(hours=self.erasure_hours)
                job["targets"] = {
                    **job["targets"],
                    "backups": _backup_status(conn, tenant_id, job["scope"]["type"]),
                    # Its own target: the bytes leave every file in the tenant's erasure run (erasure.py).
                    "physical": f"PENDING:{erase_by.isoformat()}",
                }
                proof = {
                    "jobId": job["job_id"],
                    "scope": {"type": job["scope"]["type"], "tenant": tenant_id},
                    "scopeHash": job["scope_hash"],
                    "subjectEpoch": row[0],
                    "basis": job["basis"],
                    "policyVersion": POLICY_VERSION,
                    "targetVersions": len(targets[job["job_id"]]),
                    "targets": job["targets"],
                    # Of DONE:n (records reached), those rebuilt without the scope rather than deleted.
                    "rebuilt": rebuilt_counts((found or {}).get(job["job_id"], {})),
                    "adapterVersions": {spec.name: spec.adapter_version for spec in registry.stores()},
                    "verification": verification,
                    "requestedAt": row[1].isoformat(),
                    "completedAt": completed.isoformat(),
                    "deadline": job["deadline"],
                    **(
                        {"sweepDate": job["sweep_date"], "categories": job["categories"]}
                        if job["scope"]["type"] == "RETENTION"
                        else {}
                    ),
                }
                conn.execute(
                    "UPDATE control.deletion_jobs SET state = 'COMPLETE', proof = %s, completed_at = %s,"
                    " targets = %s, erasure_deadline = %s, updated_at = now() WHERE job_id = %s",
                    (json.dumps(proof), completed, json.dumps(job["targets"]), erase_by, job["job_id"]),
                )
                if job["scope"]["type"] == "SUBJECT":
                    # Everything of the subject is gone: new writes start afresh under a new key.
                    conn.execute(
                        "UPDATE memory.subjects SET forgotten_at = NULL WHERE tenant_id = %s AND user_id = %s",
                        (tenant_id, job["scope"]["subject"]),
                    )
                conn.execute(
                    "INSERT INTO control.outbox (job_id, tenant_id, kind, payload)"
                    " VALUES (%s, %s, 'deletion.completed', %s)",
                    (job["job_id"], tenant_id, json.dumps({"jobId": job["job_id"], "scopeHash": job["scope_hash"]})),
                )
                self._audit(conn, job["job_id"], tenant_id, "completed", "COMPLETE", {"targets": job["targets"]})
                proofs.append(proof)
        for job in jobs:
            job["state"] = "COMPLETE"  # only once the transaction committed
        return proofs


def _shared_records(
    conn: psycopg.Connection, tenant_id: str, store: str, records: set[str], targets: set[Source]
) -> set[str]:
    """Those of `records` also derived from a version that is not a target: rebuilt, not deleted."""
    if not records:
        return set()
    rows = conn.execute(
        "SELECT DISTINCT l.record_id FROM derived.lineage l WHERE l.tenant_id = %s AND l.store = %s"
        " AND l.record_id = ANY(%s) AND NOT EXISTS (SELECT 1 FROM unnest(%s::text[], %s::int[])"
        " AS w(memory_id, version) WHERE w.memory_id = l.source_memory_id AND w.version = l.source_version)",
        (tenant_id, store, sorted(records), *lineage.pair_arrays(sorted(targets))),
    ).fetchall()
    return {r[0] for r in rows}


def _records_left(conn: psycopg.Connection, tenant_id: str, store: str, records: set[str]) -> set[str]:
    """Those of `records` the store still holds (by lineage) after its deletion: the rebuilt ones."""
    rows = conn.execute(
        "SELECT DISTINCT record_id FROM derived.lineage WHERE tenant_id = %s AND store = %s AND record_id = ANY(%s)",
        (tenant_id, store, sorted(records)),
    ).fetchall()
    return {r[0] for r in rows}


def rebuilt_counts(found: Mapping[str, Any]) -> dict[str, int]:
    """store -> records rebuilt without the scope, from a job's `found` (none recorded: {})."""
    return {k[len(REBUILT_PREFIX) :]: int(v) for k, v in found.items() if k.startswith(REBUILT_PREFIX) and int(v)}


# Lineage edges of any store still reaching a target (every adapter drops its own; this checks all).
_LINEAGE_LEFT = (
    "SELECT count(*) FROM derived.lineage x JOIN unnest(%s::text[], %s::int[])"
    " AS w(memory_id, version) ON x.source_memory_id = w.memory_id AND x.source_version = w.version"
    " WHERE x.tenant_id = %s"
)


def _backup_status(conn: psycopg.Connection, tenant_id: str, scope: str) -> str:
    """What the tenant's live backups hold of this scope: shredded with its key, or until they expire.

    SUBJECT and TENANT scopes destroy the key their rows are sealed under, so every backup is
    unreadable for them once the key's dead copies are erased from the key store's files
    (PENDING_SHRED until the physical erasure, then SHREDDED). A MEMORY or RETENTION scope leaves
    the key alive: the rows stay in backups until they expire, and the restore gate's journal
    replay keeps them from coming back.
    """
    row = conn.execute(
        "SELECT count(*), max(expires_at) FROM control.backups WHERE tenant_id = %s AND expired_at IS NULL",
        (tenant_id,),
    ).fetchone()
    count, until = (0, None) if row is None else row
    if scope in ("SUBJECT", "TENANT"):
        # SHREDDED only once no readable copy of the destroyed key is left: the physical erasure
        # rewrites the key store's files and scans them, then claims it.
        return f"PENDING_SHRED:{count}"
    return "DONE:0" if not count else f"PENDING_EXPIRY:{until.date().isoformat()}"
