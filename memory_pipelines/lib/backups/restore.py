"""Restores: requested (for the restore sensor), run behind the tenant's restore gate as one
transaction that commits only once verified, reported COMPLETE or BLOCKED; and the queries of
control.restores the sensors and the CLI read.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from memory_pipelines.lib.backups import restore_replay
from memory_pipelines.lib.backups.base import BackupContext
from memory_pipelines.lib.backups.listing import BackupListing
from memory_pipelines.lib.backups.restore_load import RestoreLoading
from memory_pipelines.lib.infra import faults, validation
from memory_pipelines.lib.infra.errors import ConflictError, MemoryPipelinesError, NotFoundError, ValidationError
from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories import ordering
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import RestoreReport, RestoreRequest, TenantReopened

__all__ = [
    "RESTORE_ID_RE",
    "BackupRestore",
    "check_restore_id",
    "completed_restores",
    "restore_report",
    "restored_sequences",
    "restores",
]

# Generated ids are r_ and 16 hex digits; a caller may choose its own of this form.
RESTORE_ID_RE = re.compile(r"r_[a-z0-9][a-z0-9_-]{0,61}")


def check_restore_id(value: object) -> str:
    """`value` if it has the form of a restore id, else a ValidationError naming `restore_id`."""
    if not isinstance(value, str) or not RESTORE_ID_RE.fullmatch(value):
        raise ValidationError(
            "restore_id",
            f"malformed restore id {str(value)[:80]!r}: expected r_ and up to 62 of a-z, 0-9, _ and -"
            " (or none, for a new id)",
        )
    return value


def _restore_id_clash(row: tuple[Any, ...] | None, tenant_id: str, backup_id: str, restore_id: str) -> str | None:
    """Why `restore_id` cannot name this restore (None when it can: it is new, or it is this very
    restore's request or a retry of it after BLOCKED or INTERRUPTED). Another tenant is never named."""
    if row is None:
        return None
    owner, backup, state = row
    if owner != tenant_id:
        return f"restore_id {restore_id} is taken by another restore; leave it empty for a new id"
    if backup == backup_id and state in ("REQUESTED", "BLOCKED", "INTERRUPTED"):
        return None
    return (
        f"restore_id {restore_id} is taken by a {state} restore of {tenant_id!r} from {backup};"
        " leave it empty for a new id"
    )


class BackupRestore:
    """Requests, runs and reopens restores: `listing` checks the backup, `loading` loads it, and
    `job_records` (the deletion ledger) records a job's erasure owed again when a restore brings back
    rows a finished erasure had removed."""

    def __init__(
        self,
        context: BackupContext,
        *,
        listing: BackupListing,
        loading: RestoreLoading,
        job_records: restore_replay.JobRecords,
    ) -> None:
        self.context = context
        self.store = context.store
        self.listing = listing
        self.loading = loading
        self.job_records = job_records

    def request_restore(self, *, tenant_id: str, backup_id: str, restore_id: str | None = None) -> RestoreRequest:
        """Record a restore for the restore sensor to run; the backup and the restore id are checked now.
        A `restore_id` already naming another restore is refused (ConflictError), never reused."""
        if restore_id is not None:
            check_restore_id(restore_id)
        self.listing.backup_row(tenant_id, backup_id)
        restore_id = restore_id or "r_" + secrets.token_hex(8)
        with self.store.transaction() as conn:
            inserted = conn.execute(
                "INSERT INTO control.restores (restore_id, tenant_id, backup_id, state) VALUES (%s, %s, %s,"
                " 'REQUESTED') ON CONFLICT (restore_id) DO NOTHING RETURNING restore_id",
                (restore_id, tenant_id, backup_id),
            ).fetchone()
            if inserted is None:
                row = conn.execute(
                    "SELECT tenant_id, backup_id, state FROM control.restores WHERE restore_id = %s", (restore_id,)
                ).fetchone()
                clash = _restore_id_clash(row, tenant_id, backup_id, restore_id)
                if clash is not None or (row is not None and row[2] != "REQUESTED"):
                    raise ConflictError("restore_id", clash or f"restore_id {restore_id} is taken")
        return {"restore_id": restore_id, "tenant_id": tenant_id, "backup_id": backup_id, "state": "REQUESTED"}

    def check_restore_id(self, *, tenant_id: str, backup_id: str, restore_id: str) -> str:
        """`restore_id` if it may name a restore of `backup_id` into `tenant_id` now: well formed, and
        new or this restore's own request. Raises ValidationError or ConflictError naming `restore_id`."""
        check_restore_id(restore_id)
        with self.store.transaction() as conn:
            row = conn.execute(
                "SELECT tenant_id, backup_id, state FROM control.restores WHERE restore_id = %s", (restore_id,)
            ).fetchone()
        clash = _restore_id_clash(row, tenant_id, backup_id, restore_id)
        if clash is not None:
            raise ConflictError("restore_id", clash)
        return restore_id

    def restore(
        self,
        *,
        tenant_id: str,
        backup_id: str,
        restore_id: str | None = None,
        lock_timeout: float = 60.0,
        progress: Progress = no_progress,
    ) -> RestoreReport:
        """Load a backup into the tenant behind the restore gate, replay the journals, verify, reopen;
        `progress` hears of each chunk of rows loaded ("restore rows") and each replay step ("restore replay").

        The backup's rows are staged in temporary tables, the deletion journal removes there what it
        forgot and the consent journal reapplies changes made since the backup; only what survives
        reaches the tenant's tables, where the rules run again (expected to remove nothing) and are
        verified. All of it is one transaction: a restore that fails verification (or fails at all)
        rolls back to the tenant's rows as they were, is reported BLOCKED, and keeps the gate closed
        until a later restore succeeds or `reopen` is called. Never interleaves with a forget run of
        the tenant (same advisory lock); waits up to `lock_timeout` seconds. A `restore_id` naming
        another restore is refused (ConflictError) before anything is touched.
        """
        manifest = self.listing.backup_row(tenant_id, backup_id)
        if restore_id is not None:
            self.check_restore_id(tenant_id=tenant_id, backup_id=backup_id, restore_id=restore_id)
        with self._tenant_lock(tenant_id, lock_timeout), self.context.scratch(tenant_id) as scratch:
            self._require_restorable(tenant_id)
            tables = self.loading.fetch_and_open(manifest, scratch)
            restore_id = restore_id or "r_" + secrets.token_hex(8)
            with self.store.transaction() as conn:
                # Closing the gate waits for every write in flight (they hold the lock shared) and is
                # seen by every later one: a restore never meets a write that began before it closed.
                ordering.lock_tenant_exclusive(conn, tenant_id)
                self._claim(conn, tenant_id, backup_id, restore_id)
                conn.execute("UPDATE memory.tenants SET restoring_since = now() WHERE tenant_id = %s", (tenant_id,))
            faults.point("restore.gate_closed")
            report: RestoreReport = {"restore_id": restore_id, "tenant_id": tenant_id, "backup_id": backup_id}
            owed: restore_replay.Owed = {}
            try:
                with self.store.transaction() as conn:
                    self.loading.load_and_replay(conn, tenant_id, manifest, tables, report, owed, progress)
                    report["verification"] = restore_replay.verify(conn, tenant_id)
                    if any(report["verification"].values()):
                        raise _VerificationFailed  # rolls the load back: forgotten rows never commit
                    # The sequence the restore leaves: the partitions sensor leaves this change to the
                    # backfill sensor (one rebuild, not a second one by eager automation).
                    report["change_seq"] = conn.execute(
                        "UPDATE memory.tenants SET restoring_since = NULL, change_seq = change_seq + 1,"
                        " updated_at = now() WHERE tenant_id = %s RETURNING change_seq",
                        (tenant_id,),
                    ).fetchone()[0]  # type: ignore[index]
                    report["state"] = "COMPLETE"
                    # Held to commit: numbers become visible in commit order, never a lower one later.
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_COMPLETION_LOCK,))
                    conn.execute(
                        "UPDATE control.restores SET state = 'COMPLETE', report = %s, completed_at = now(),"
                        " completion_seq = nextval('control.restore_completion_seq') WHERE restore_id = %s",
                        (json.dumps(report), restore_id),
                    )
            except _VerificationFailed:
                self._mark_blocked(restore_id, report)
                return report
            except MemoryPipelinesError:
                self._mark_blocked(restore_id, report)
                raise
            except Exception as exc:
                self._mark_blocked(restore_id, {**report, "error": type(exc).__name__})
                raise
            finally:
                # Committed or rolled back, rows the safety net deleted left dead tuples: erase them.
                if owed:
                    self._owe_erasure(tenant_id, restore_id, owed, report)
        return report

    def _claim(self, conn: psycopg.Connection, tenant_id: str, backup_id: str, restore_id: str) -> None:
        """Make `restore_id` this restore's (RUNNING), in the transaction that closes the gate; a
        restore id naming another restore is refused, never taken over."""
        inserted = conn.execute(
            "INSERT INTO control.restores (restore_id, tenant_id, backup_id, state) VALUES (%s, %s, %s,"
            " 'RUNNING') ON CONFLICT (restore_id) DO NOTHING RETURNING restore_id",
            (restore_id, tenant_id, backup_id),
        ).fetchone()
        if inserted is not None:
            return
        row = conn.execute(
            "SELECT tenant_id, backup_id, state FROM control.restores WHERE restore_id = %s FOR UPDATE",
            (restore_id,),
        ).fetchone()
        clash = _restore_id_clash(row, tenant_id, backup_id, restore_id)
        if clash is not None:
            raise ConflictError("restore_id", clash)
        conn.execute("UPDATE control.restores SET state = 'RUNNING' WHERE restore_id = %s", (restore_id,))

    def _owe_erasure(self, tenant_id: str, restore_id: str, owed: restore_replay.Owed, report: RestoreReport) -> None:
        erasure_hours = Settings.from_env().erasure_hours
        with self.store.transaction() as conn:
            report["erasure_owed"] = restore_replay.owe_erasure(
                conn, tenant_id, restore_id, owed, erasure_hours=erasure_hours, jobs=self.job_records
            )
            conn.execute(
                "UPDATE control.restores SET report = report || %s WHERE restore_id = %s",
                (json.dumps({"erasure_owed": report["erasure_owed"]}), restore_id),
            )

    def _require_restorable(self, tenant_id: str) -> None:
        """The tenant exists and is not deleted; a gate left closed by a BLOCKED restore is no obstacle."""
        with self.store.transaction() as conn:
            row = conn.execute("SELECT deleted_at FROM memory.tenants WHERE tenant_id = %s", (tenant_id,)).fetchone()
        if row is None:
            raise NotFoundError("tenant", f"unknown tenant {tenant_id!r}")
        if row[0] is not None:
            raise NotFoundError("tenant", f"tenant {tenant_id!r} was deleted")

    def reopen(self, *, tenant_id: str) -> TenantReopened:
        """Open a tenant whose gate a BLOCKED restore left closed; its rows are those before that restore."""
        validation.check_id("tenant", tenant_id)
        with self.store.transaction() as conn:
            row = conn.execute(
                "UPDATE memory.tenants SET restoring_since = NULL, change_seq = change_seq + 1 WHERE tenant_id = %s"
                " AND restoring_since IS NOT NULL RETURNING tenant_id",
                (tenant_id,),
            ).fetchone()
        if row is None:
            self.store.require_tenant(tenant_id=tenant_id)  # an unknown tenant is not found, not "already open"
        return {"tenant_id": tenant_id, "reopened": row is not None}

    def _mark_blocked(self, restore_id: str, report: RestoreReport) -> None:
        # The load rolled back; the gate stays closed until a restore succeeds or `reopen`.
        with self.store.transaction() as conn:
            conn.execute(
                "UPDATE control.restores SET state = 'BLOCKED', report = %s WHERE restore_id = %s",
                (json.dumps({**report, "state": "BLOCKED"}), restore_id),
            )
        report["state"] = "BLOCKED"

    @contextmanager
    def _tenant_lock(self, tenant_id: str, timeout: float) -> Iterator[None]:
        lock_key = ordering.run_lock(tenant_id)
        conn = psycopg.connect(self.store.conninfo, autocommit=True)
        try:
            deadline = time.monotonic() + timeout
            while not conn.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 2))", (lock_key,)).fetchone()[
                0  # type: ignore[index]
            ]:
                if time.monotonic() >= deadline:
                    raise ConflictError(
                        "tenant", f"a forget run of {tenant_id!r} is in progress; restore again when it ends"
                    )
                time.sleep(0.2)
            try:
                yield
            finally:
                conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 2))", (lock_key,))
        finally:
            conn.close()


class _VerificationFailed(Exception):
    """Forgotten rows left after the replay: the restore transaction must not commit."""


def restores(store: MemoryStore, *, states: tuple[str, ...]) -> list[dict[str, Any]]:
    """Restores in `states`, oldest first (what the restore sensors act on)."""
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT restore_id, tenant_id, backup_id, state, completed_at FROM control.restores"
            " WHERE state = ANY(%s) ORDER BY created_at",
            (list(states),),
        ).fetchall()
    return [
        {"restore_id": r[0], "tenant_id": r[1], "backup_id": r[2], "state": r[3], "completed_at": r[4]} for r in rows
    ]


# Any constant: the same in every process that completes a restore.
_COMPLETION_LOCK = 7_150_433_212


def completed_restores(store: MemoryStore, *, after: int) -> list[dict[str, Any]]:
    """COMPLETE restores numbered above `after`, in completion order (the backfill sensor's cursor)."""
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT restore_id, tenant_id, completion_seq FROM control.restores"
            " WHERE state = 'COMPLETE' AND completion_seq > %s ORDER BY completion_seq",
            (after,),
        ).fetchall()
    return [{"restore_id": r[0], "tenant_id": r[1], "completion_seq": int(r[2])} for r in rows]


def restored_sequences(store: MemoryStore) -> dict[str, int]:
    """tenant -> the change sequence its latest COMPLETE restore left (a backfill rebuilds that one)."""
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT DISTINCT ON (tenant_id) tenant_id, (report->>'change_seq')::bigint FROM control.restores"
            " WHERE state = 'COMPLETE' AND completion_seq IS NOT NULL ORDER BY tenant_id, completion_seq DESC"
        ).fetchall()
    return {r[0]: int(r[1]) for r in rows if r[1] is not None}


def restore_report(store: MemoryStore, *, restore_id: str) -> dict[str, Any] | None:
    """The report a restore recorded (ids and counts), or None if it has not finished."""
    with store.transaction() as conn:
        row = conn.execute("SELECT state, report FROM control.restores WHERE restore_id = %s", (restore_id,)).fetchone()
    if row is None or row[0] not in ("COMPLETE", "BLOCKED"):
        return None
    return {**row[1], "state": row[0]}
