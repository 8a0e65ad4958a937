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
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any, NoReturn

import psycopg
from psycopg.rows import dict_row

from memory_pipelines.lib import crypto, gate, lineage, registry, validation
from memory_pipelines.lib.analytics import STORE as ANALYTICS_STORE
from memory_pipelines.lib.derived import DerivedStores
from memory_pipelines.lib.errors import MemoryPipelinesError, NotFoundError, ServiceError, ValidationError
from memory_pipelines.lib.recall import CACHE_STORE
from memory_pipelines.lib.store import MemoryStore, repair_heads
from memory_pipelines.lib.summaries import SUBJECT_STORE, TEAM_STORE
from memory_pipelines.lib.vectors import vacuum_sqlite

SWEEP_PROBES = 2_000
PRIMARY_BATCH = 5_000
POLICY_VERSION = "deletion-policy-2026-11"
# Days to complete by basis; a regulator's clock, not a target (we finish in seconds).
DEADLINE_DAYS = {"gdpr-art17": 30, "ccpa": 45, "user-request": 30, "retention": 30, "offboarding": 30}
# A job this close to its deadline (or past it) fails the `deletions_on_track` check.
NEAR_DEADLINE = timedelta(days=3)
MAX_BACKOFF = timedelta(hours=1)
OPEN_STATES = ("REQUESTED", "FROZEN", "DELETING", "VERIFYING", "BLOCKED")
_SUMMARY_SCOPES = {SUBJECT_STORE: "subject", TEAM_STORE: "team"}
Source = tuple[str, int]
Hook = Callable[[str, list[str]], None]


@dataclass
class Probes:
    """Recall probes of the deleted content; held in memory for one run, never stored."""

    texts: list[str]
    vectors: list[Any]


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
    erased_snapshots: set[str] = field(default_factory=set)
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
_IN_FLIGHT = ("FROZEN", "DELETING", "VERIFYING")


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
    rows: list[dict[str, Any]], *, cursor: int, last_runs: dict[str, LastRun], now: datetime
) -> tuple[list[PlannedRun], int]:
    """Which forget runs to request from the open jobs of `DeletionLedger.ledger`, and the new cursor.

    New requests (REQUESTED, seq > cursor) get one run per tenant at once, keyed by their highest
    seq; they queue behind a run in progress. With no run of the tenant in progress, a BLOCKED job
    whose backoff ended, and a job still REQUESTED (or left in flight) after the tenant's last run
    ended, get a run keyed by the last run's id as well, so each failed run is relaunched once.
    """
    fresh: dict[str, list[dict[str, Any]]] = {}
    again: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        tenant, seq, state = row["tenant_id"], row["seq"], row["state"]
        if state == "REQUESTED" and seq is not None and seq > cursor:
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
    new_cursor = max([cursor, *(r["seq"] for r in rows if r["seq"] is not None and r["state"] == "REQUESTED")])
    return planned, new_cursor


class DeletionService(DeletionLedger):
    """Accepts deletion requests and runs them. `hooks` let fault-injection tests act between steps."""

    def __init__(
        self, derived: DerivedStores, *, hooks: dict[str, Hook] | None = None, drain_timeout: float = 30.0
    ) -> None:
        super().__init__(derived.store)
        self.derived = derived
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
    ) -> dict[str, Any]:
        """Accept a request, resolved to a stable scope, and hide that scope from every read at once."""
        validation.check_id("tenant", tenant_id)
        validation.check_optional_id("requested_by", requested_by)
        if basis not in DEADLINE_DAYS:
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
            scope_hash, open_job = self._scope(conn, tenant_id, parts)
            if open_job is not None:
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
            received = {"scope": scope, "basis": basis, **({"requested_by": requested_by} if requested_by else {})}
            self._audit(conn, job_id, tenant_id, "received", "REQUESTED", received)
            return {**self._job(conn, job_id), "duplicate": False}

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
            self._vacuum_full(list(_KEY_TABLES))
        except psycopg.OperationalError:
            pass  # the keys are gone already; the forget job's key step compacts the tables again
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
        (hidden at once, and replayed by restores). None when there is nothing to remove."""
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
                for spec in registry.STORES:
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
            job["targets"] = {k: v for k, v in job["targets"].items() if k in registry.BY_NAME}
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
            sweep = any(job["scope"]["type"] == "RETENTION" for job in jobs)
            batch.probes = self._probes(tenant_id, set().union(*batch.targets.values()), sweep=sweep)
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
        if store_name not in registry.BY_NAME:
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
            return self._complete(batch.tenant_id, batch.jobs, batch.fixed, batch.verification)
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
            "stores": (
                {spec.name: sum(f[spec.name] for f in batch.found.values()) for spec in registry.STORES}
                if batch.jobs
                else {}
            ),
            **({"seconds": {name: round(value, 4) for name, value in batch.timings.items()}} if batch.jobs else {}),
        }

    def _probes(self, tenant_id: str, sources: set[Source], *, sweep: bool = False) -> Probes:
        """Paraphrase probes, built in memory from each target before deletion and discarded after.

        The texts feed the keyword probes; the semantic probes reuse each target's stored vector
        (the embedding of that very text) and embed only targets that have none, such as
        superseded versions.
        """
        chosen = sorted(sources)
        if sweep and len(chosen) > SWEEP_PROBES:
            # A retention sweep can remove a large share of a tenant: exact-id checks stay
            # exhaustive, paraphrase probes are a random sample (the proof says how many).
            chosen = sorted(random.sample(chosen, SWEEP_PROBES))
        texts = self.store.open_texts(tenant_id=tenant_id, sources=chosen, skip_unreadable=True)
        try:
            if self.derived.vectors.existing(tenant_id) is None:
                return Probes(texts=list(texts.values()), vectors=[])  # no index: nothing a vector could find
            stored = self.derived.vectors.vectors_of(tenant_id, [f"{m}:{v}" for m, v in sorted(texts)])
        except ServiceError:
            stored = {}  # Chroma down: embed every probe; the Chroma step itself will block the job
        missing = [source for source in sorted(texts) if f"{source[0]}:{source[1]}" not in stored]
        vectors = list(stored.values())
        if missing:
            vectors += list(self.derived.vectors.embedder.embed([texts[source] for source in missing]))
        return Probes(texts=list(texts.values()), vectors=vectors)

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
            return {
                job["job_id"]: fixed[job["job_id"]]
                | self._orphans(conn, tenant_id, job["scope"], {m for m, _ in fixed[job["job_id"]]})
                for job in jobs
            }

    @staticmethod
    def _orphans(conn: psycopg.Connection, tenant_id: str, scope: dict[str, Any], memory_ids: set[str]) -> set[Source]:
        """Versions with derived records but no primary row any more (a restore removed them after
        they were indexed, summarised or cached) that this scope covers: their copies go too.

        A subject's (or the tenant's) forget takes those whose memory is theirs or gone with an
        unknown author; a memory's or a sweep's, those of its memories.
        """
        rows = conn.execute(
            "SELECT DISTINCT l.source_memory_id, l.source_version FROM derived.lineage l"
            " LEFT JOIN memory.memories m ON m.tenant_id = l.tenant_id AND m.memory_id = l.source_memory_id"
            " WHERE l.tenant_id = %(t)s AND NOT EXISTS (SELECT 1 FROM memory.memory_versions v"
            "  WHERE v.tenant_id = l.tenant_id AND v.memory_id = l.source_memory_id AND v.version = l.source_version)"
            " AND (%(all)s OR l.source_memory_id = ANY(%(ids)s)"
            "  OR (%(subject)s::text IS NOT NULL AND (m.memory_id IS NULL OR m.user_id = %(subject)s)))",
            {
                "t": tenant_id,
                "all": scope["type"] == "TENANT",
                "ids": sorted(memory_ids),
                "subject": scope["subject"] if scope["type"] == "SUBJECT" else None,
            },
        ).fetchall()
        return {(m, v) for m, v in rows}

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
                sources = targets[job["job_id"]]
                counts = {
                    spec.name: len(self._linked(conn, tenant_id, _LINEAGE_STORE[spec.name], sources))
                    for spec in registry.STORES
                    if spec.name in _LINEAGE_STORE
                }
                counts["primary"] = len(sources)
                scope = job["scope"]
                if scope["type"] == "SUBJECT":
                    counts["key_store"] = conn.execute(
                        "SELECT count(*) FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = %s",
                        (tenant_id, scope["subject"]),
                    ).fetchone()[0]  # type: ignore[index]
                elif scope["type"] == "TENANT":
                    counts["key_store"] = sum(
                        conn.execute(query, (tenant_id,)).fetchone()[0]  # type: ignore[index]
                        for query in _COUNT_TENANT_KEYS
                    )
                else:
                    counts["key_store"] = 0
                conn.execute(
                    "UPDATE control.deletion_jobs SET found = %s WHERE job_id = %s", (json.dumps(counts), job["job_id"])
                )
                out[job["job_id"]] = counts
        return out

    # -- store adapters -------------------------------------------------------------------------

    def _linked(self, conn: psycopg.Connection, tenant_id: str, store: str, sources: set[Source]) -> set[str]:
        if not sources:
            return set()
        wanted = sorted(sources)
        return {
            r[0]
            for r in conn.execute(
                "SELECT DISTINCT l.record_id FROM derived.lineage l"
                " JOIN unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
                " ON l.source_memory_id = w.memory_id AND l.source_version = w.version"
                " WHERE l.tenant_id = %s AND l.store = %s",
                (*lineage.pair_arrays(wanted), tenant_id, store),
            )
        }

    def _delete_in(self, store_name: str, batch: Batch) -> None:
        """Delete every record of `store_name` derived from the targets (counts come from `_found`)."""
        tenant_id, targets = batch.tenant_id, batch.targets
        everything = set().union(*targets.values())
        records: set[str] = set()
        if store_name in _LINEAGE_STORE:
            with self.store.transaction() as conn:
                records = self._linked(conn, tenant_id, _LINEAGE_STORE[store_name], everything)
        getattr(self, f"_delete_{store_name}")(tenant_id, batch.jobs, targets, everything, records)
        if store_name == "prompt_snapshots":
            batch.erased_snapshots |= records  # checked by this batch's verification

    def _delete_recall_cache(
        self, tenant_id: str, jobs: Any, targets: Any, everything: set[Source], records: set[str]
    ) -> None:
        with self.store.transaction() as conn:
            conn.execute(
                "DELETE FROM derived.recall_cache WHERE tenant_id = %s AND encode(cache_key, 'hex') = ANY(%s)",
                (tenant_id, sorted(records)),
            )
            conn.execute(
                "DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s AND record_id = ANY(%s)",
                (tenant_id, CACHE_STORE, sorted(records)),
            )

    def _delete_prompt_snapshots(
        self, tenant_id: str, jobs: Any, targets: Any, everything: set[Source], records: set[str]
    ) -> None:
        # A snapshot holding any forgotten version goes whole: it is one sealed prompt.
        with self.store.transaction() as conn:
            if _tenant_scope(jobs):
                conn.execute("DELETE FROM derived.prompt_snapshots WHERE tenant_id = %s", (tenant_id,))
                conn.execute(
                    "DELETE FROM derived.lineage WHERE tenant_id = %s AND store = 'prompt_snapshots'", (tenant_id,)
                )
                return
            conn.execute(
                "DELETE FROM derived.prompt_snapshots WHERE tenant_id = %s AND snapshot_id = ANY(%s)",
                (tenant_id, sorted(records)),
            )
            conn.execute(
                "DELETE FROM derived.lineage WHERE tenant_id = %s AND store = 'prompt_snapshots'"
                " AND record_id = ANY(%s)",
                (tenant_id, sorted(records)),
            )

    def _delete_chroma(
        self, tenant_id: str, jobs: Any, targets: Any, everything: set[Source], records: set[str]
    ) -> None:
        vectors = self.derived.vectors
        if _tenant_scope(jobs):
            vectors.drop(tenant_id)
            if vectors.path is not None:
                vacuum_sqlite(vectors.path / "chroma.sqlite3")
            return
        ids = sorted(records | {f"{m}:{v}" for m, v in everything})
        vectors.erase(tenant_id, ids)
        with self.store.transaction() as conn:
            conn.execute(
                "DELETE FROM derived.lineage WHERE tenant_id = %s AND store = 'chroma' AND record_id = ANY(%s)",
                (tenant_id, ids),
            )

    def _delete_keyword_index(
        self, tenant_id: str, jobs: Any, targets: Any, everything: set[Source], records: set[str]
    ) -> None:
        wanted = sorted(everything)
        with self.store.transaction() as conn:
            conn.execute(
                "DELETE FROM derived.keyword_postings p USING unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
                " WHERE p.tenant_id = %s AND p.memory_id = w.memory_id AND p.version = w.version",
                (*lineage.pair_arrays(wanted), tenant_id),
            )
            conn.execute(
                "DELETE FROM derived.lineage WHERE tenant_id = %s AND store = 'keyword_index' AND record_id = ANY(%s)",
                (tenant_id, sorted(records)),
            )

    def _delete_summaries(self, scope: str, tenant_id: str, jobs: list[dict[str, Any]], records: set[str]) -> None:
        if _tenant_scope(jobs):
            with self.store.transaction() as conn:
                conn.execute("DELETE FROM derived.summaries WHERE tenant_id = %s AND scope = %s", (tenant_id, scope))
                conn.execute(
                    "DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s",
                    (tenant_id, SUBJECT_STORE if scope == "subject" else TEAM_STORE),
                )
            return
        # Hidden sources are already excluded from current versions: a sync of the summaries whose
        # lineage reaches a target (records "subject:<id>" / "team:<id>") rebuilds them without it,
        # and removes those left with no source.
        touched = sorted(record.partition(":")[2] for record in records)
        if touched:
            self.derived.summaries.sync(tenant_id=tenant_id, scope=scope, scope_ids=touched)

    def _delete_subject_summaries(
        self, tenant_id: str, jobs: Any, targets: Any, everything: set[Source], records: set[str]
    ) -> None:
        self._delete_summaries("subject", tenant_id, jobs, records)

    def _delete_team_summaries(
        self, tenant_id: str, jobs: Any, targets: Any, everything: set[Source], records: set[str]
    ) -> None:
        self._delete_summaries("team", tenant_id, jobs, records)

    def _delete_analytics(
        self, tenant_id: str, jobs: Any, targets: Any, everything: set[Source], records: set[str]
    ) -> None:
        if _tenant_scope(jobs):
            self.derived.analytics.drop(store=self.store, tenant_id=tenant_id)
        elif any(job["scope"]["type"] == "MEMORY" for job in jobs):
            # Deleting a current version makes an older one current: the partition must show it.
            self.derived.analytics.rebuild(store=self.store, tenant_id=tenant_id)
        else:
            self.derived.analytics.remove(store=self.store, tenant_id=tenant_id, sources=everything)

    def _delete_primary(
        self,
        tenant_id: str,
        jobs: list[dict[str, Any]],
        targets: dict[str, set[Source]],
        everything: set[Source],
        records: set[str],
    ) -> None:
        wanted = sorted(everything)
        # Batches by key range (the pairs sorted by key), each in its own short transaction: a large
        # sweep never holds one huge lock, and every batch is idempotent on a retry.
        for start in range(0, len(wanted), PRIMARY_BATCH):
            self._delete_primary_batch(tenant_id, wanted[start : start + PRIMARY_BATCH])
        with self.store.transaction() as conn:
            for job in jobs:
                if job["scope"]["type"] == "SUBJECT":
                    conn.execute(
                        "DELETE FROM memory.team_members WHERE tenant_id = %s AND user_id = %s",
                        (tenant_id, job["scope"]["subject"]),
                    )
                elif job["scope"]["type"] == "TENANT":
                    for query in _TENANT_ROWS:
                        conn.execute(query, (tenant_id,))
        self._vacuum_full(_tables_to_compact(jobs))

    def _delete_primary_batch(self, tenant_id: str, wanted: list[Source]) -> None:
        with self.store.transaction() as conn:
            conn.execute(
                "DELETE FROM memory.memory_versions v USING unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
                " WHERE v.tenant_id = %s AND v.memory_id = w.memory_id AND v.version = w.version",
                (*lineage.pair_arrays(wanted), tenant_id),
            )
            repair_heads(conn, tenant_id=tenant_id, memory_ids=sorted({m for m, _ in wanted}))
            conn.execute(
                "DELETE FROM derived.lineage l USING unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
                " WHERE l.tenant_id = %s AND l.source_memory_id = w.memory_id AND l.source_version = w.version",
                (*lineage.pair_arrays(wanted), tenant_id),
            )

    def _delete_key_store(
        self, tenant_id: str, jobs: list[dict[str, Any]], targets: Any, everything: set[Source], records: set[str]
    ) -> None:
        with self.store.transaction() as conn:
            for job in jobs:
                scope = job["scope"]
                destroyed: list[str] = []
                if scope["type"] == "SUBJECT":
                    key_id = self.store.keys.destroy_subject_key(conn, tenant_id, scope["subject"])
                    destroyed = [] if key_id is None else [key_id]
                elif scope["type"] == "TENANT":
                    destroyed = self.store.keys.destroy_tenant_keys(conn, tenant_id)
                with conn.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO control.journal (tenant_id, kind, subject_id, key_id, job_id)"
                        " VALUES (%s, 'KEY_DESTROYED', %s, %s, %s)",
                        [(tenant_id, scope["subject"], key_id, job["job_id"]) for key_id in destroyed],
                    )
        self._vacuum_full(list(_KEY_TABLES))

    def _vacuum_full(self, tables: list[str]) -> None:
        from psycopg import sql

        with psycopg.connect(self.store.conninfo, autocommit=True) as conn:
            # VACUUM FULL queues for an ACCESS EXCLUSIVE lock, and every reader of the table queues
            # behind it: a long reader elsewhere must block this job (retried later), not everyone.
            conn.execute("SET lock_timeout = '10s'")
            for table in tables:
                schema, name = table.split(".")
                conn.execute(sql.SQL("VACUUM FULL {}.{}").format(sql.Identifier(schema), sql.Identifier(name)))

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
        tenant_id, jobs, targets, probes = batch.tenant_id, batch.jobs, batch.targets, batch.probes
        everything = set().union(*targets.values())
        wanted = sorted(everything)
        ids = [f"{m}:{v}" for m, v in wanted]
        leftovers: dict[str, int] = {}
        with self.store.transaction() as conn:
            arrays = (*lineage.pair_arrays(wanted), tenant_id)
            for store_name, query in _LEFTOVER_QUERIES.items():
                leftovers[store_name] = conn.execute(query, arrays).fetchone()[0]  # type: ignore[index]
            keys_left = 0
            for job in jobs:
                scope = job["scope"]
                if scope["type"] == "SUBJECT":
                    keys_left += conn.execute(
                        "SELECT count(*) FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = %s",
                        (tenant_id, scope["subject"]),
                    ).fetchone()[0]  # type: ignore[index]
                elif scope["type"] == "TENANT":
                    keys_left += conn.execute(
                        "SELECT (SELECT count(*) FROM keystore.tenant_keys WHERE tenant_id = %s)"
                        " + (SELECT count(*) FROM keystore.subject_keys WHERE tenant_id = %s)",
                        (tenant_id, tenant_id),
                    ).fetchone()[0]  # type: ignore[index]
            leftovers["key_store"] = keys_left
        col = self.derived.vectors.existing(tenant_id)
        found = (
            self.derived.vectors._call("verifying", lambda: col.get(ids=ids, include=[])["ids"])
            if ids and col is not None
            else []
        )
        leftovers["chroma"] = len(found)
        with self.store.transaction() as conn:
            leftovers["prompt_snapshots"] = conn.execute(
                "SELECT count(*) FROM derived.prompt_snapshots WHERE tenant_id = %s AND snapshot_id = ANY(%s)",
                (tenant_id, sorted(batch.erased_snapshots)),
            ).fetchone()[0]  # type: ignore[index]
        table = self.derived.analytics.read_partition(tenant_id)
        if table is not None:
            rows = {
                f"{m}:{v}" for m, v in zip(table["memory_id"].to_pylist(), table["version"].to_pylist(), strict=True)
            }
            leftovers["analytics"] = len(rows & set(ids))
        else:
            leftovers["analytics"] = 0
        probe_hits = sum(
            1
            for hits in self.derived.vectors.query_vectors(tenant_id=tenant_id, vectors=probes.vectors, limit=10)
            for source in hits
            if source in everything
        )
        probe_hits += self.derived.keywords.probe_hits(tenant_id=tenant_id, texts=probes.texts, sources=everything)
        leftovers["paraphrase_probes"] = probe_hits
        bad = {store: n for store, n in leftovers.items() if n}
        if bad:
            store, count = next(iter(bad.items()))
            raise DeletionBlocked(store, f"VERIFICATION_{store.upper()}", f"{count} record(s) of forgotten data found")
        return {
            "exact_id_queries": {store: 0 for store in leftovers if store != "paraphrase_probes"},
            "paraphrase_probes": {"probes": len(probes.texts), "hits": 0},
        }

    def _complete(
        self, tenant_id: str, jobs: list[dict[str, Any]], targets: dict[str, set[Source]], verification: dict[str, Any]
    ) -> list[dict[str, Any]]:
        proofs = []
        with self.store.transaction() as conn:
            for job in jobs:
                statuses = [str(job["targets"].get(spec.name, "PENDING")) for spec in registry.STORES]
                if not all(status.startswith("DONE:") for status in statuses):
                    raise DeletionBlocked("targets", "TARGET_NOT_DONE", "a store has not confirmed its deletion")
                completed = _now()
                row = conn.execute(
                    "SELECT subject_epoch, created_at FROM control.deletion_jobs WHERE job_id = %s", (job["job_id"],)
                ).fetchone()
                assert row is not None
                job["targets"] = {**job["targets"], "backups": _backup_status(conn, tenant_id, job["scope"]["type"])}
                proof = {
                    "jobId": job["job_id"],
                    "scope": {"type": job["scope"]["type"], "tenant": tenant_id},
                    "scopeHash": job["scope_hash"],
                    "subjectEpoch": row[0],
                    "basis": job["basis"],
                    "policyVersion": POLICY_VERSION,
                    "targetVersions": len(targets[job["job_id"]]),
                    "targets": job["targets"],
                    "adapterVersions": {spec.name: spec.adapter_version for spec in registry.STORES},
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
                    " updated_at = now() WHERE job_id = %s",
                    (json.dumps(proof), completed, job["job_id"]),
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


_LINEAGE_STORE = {
    "prompt_snapshots": "prompt_snapshots",
    "chroma": "chroma",
    "keyword_index": "keyword_index",
    "analytics": ANALYTICS_STORE,
    "recall_cache": CACHE_STORE,
    "subject_summaries": SUBJECT_STORE,
    "team_summaries": TEAM_STORE,
}
# Exact-id verification: rows of the target (memory_id, version) pairs left in each table.
_LEFTOVER_QUERIES = {
    "primary": "SELECT count(*) FROM memory.memory_versions x JOIN unnest(%s::text[], %s::int[])"
    " AS w(memory_id, version) ON x.memory_id = w.memory_id AND x.version = w.version WHERE x.tenant_id = %s",
    "keyword_index": "SELECT count(*) FROM derived.keyword_postings x JOIN unnest(%s::text[], %s::int[])"
    " AS w(memory_id, version) ON x.memory_id = w.memory_id AND x.version = w.version WHERE x.tenant_id = %s",
    "lineage": "SELECT count(*) FROM derived.lineage x JOIN unnest(%s::text[], %s::int[])"
    " AS w(memory_id, version) ON x.source_memory_id = w.memory_id AND x.source_version = w.version"
    " WHERE x.tenant_id = %s",
}
# Compacted after every key destruction, so no wrapped copy lingers in their heap files.
_KEY_TABLES = ("keystore.subject_keys", "keystore.team_keys", "keystore.tenant_keys")
_COUNT_TENANT_KEYS = (
    "SELECT count(*) FROM keystore.subject_keys WHERE tenant_id = %s",
    "SELECT count(*) FROM keystore.team_keys WHERE tenant_id = %s",
    "SELECT count(*) FROM keystore.tenant_keys WHERE tenant_id = %s",
)


def _backup_status(conn: psycopg.Connection, tenant_id: str, scope: str) -> str:
    """What the tenant's live backups hold of this scope: shredded with its key, or until they expire.

    SUBJECT and TENANT scopes destroy the key their rows are sealed under, so every backup is
    unreadable for them at once. A MEMORY or RETENTION scope leaves the key alive: the rows stay in
    backups until they expire, and the restore gate's journal replay keeps them from coming back.
    """
    row = conn.execute(
        "SELECT count(*), max(expires_at) FROM control.backups WHERE tenant_id = %s AND expired_at IS NULL",
        (tenant_id,),
    ).fetchone()
    count, until = (0, None) if row is None else row
    if scope in ("SUBJECT", "TENANT"):
        return f"SHREDDED:{count}"
    return "DONE:0" if not count else f"PENDING_EXPIRY:{until.date().isoformat()}"


def _tables_to_compact(jobs: list[dict[str, Any]]) -> list[str]:
    """Tables whose dead tuples would still be readable after this batch, so VACUUM FULL must rewrite them.

    Text and its MAC are sealed under the author's subject key, so SUBJECT and TENANT scopes shred
    them with the key; a MEMORY scope leaves that key alive. Keyword MACs use a tenant subkey and team
    summaries a team key, both alive unless the tenant goes. Ids-only tables (memories, lineage,
    recall cache) hold no content. Compaction is the costly part of a cascade, so it is kept to these.
    """
    kinds = {job["scope"]["type"] for job in jobs}
    tables = []
    if kinds & {"MEMORY", "RETENTION"}:
        tables.append("memory.memory_versions")
    if kinds & {"MEMORY", "RETENTION", "SUBJECT"}:
        tables += ["derived.keyword_postings", "derived.summaries", "derived.prompt_snapshots"]
    return tables


def _tenant_scope(jobs: list[dict[str, Any]]) -> bool:
    return any(job["scope"]["type"] == "TENANT" for job in jobs)


_TENANT_ROWS = (
    "DELETE FROM memory.team_members WHERE tenant_id = %s",
    "DELETE FROM memory.teams WHERE tenant_id = %s",
    "DELETE FROM memory.subjects WHERE tenant_id = %s AND NOT EXISTS (SELECT 1 FROM memory.memories m"
    " WHERE m.tenant_id = memory.subjects.tenant_id AND m.user_id = memory.subjects.user_id)",
    "DELETE FROM derived.summaries WHERE tenant_id = %s",
    "DELETE FROM derived.summary_modes WHERE tenant_id = %s",
    "DELETE FROM derived.recall_cache WHERE tenant_id = %s",
    "DELETE FROM derived.prompt_snapshots WHERE tenant_id = %s",
    "DELETE FROM derived.lineage WHERE tenant_id = %s",
)
