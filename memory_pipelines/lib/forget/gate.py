"""The deletion fence for in-flight agent runs: leases, single-use permits, and a linearizable gate.

An agent run opens a *lease*; every recall inside the run records *fences* on it: the exact
(memory_id, version) it read and its author's epoch at that moment. Every sink (model output,
tool dispatch, state write, memory write) asks the gate for a *permit* at the point of acceptance
and releases it when that boundary ends. The gate issues a permit only if no fence of the lease
has been closed: the author's epoch is unchanged and no version it read is tombstoned, and the
tenant is not deleted. A stale lease gets no permit, whatever the worker believes.

Linearizability: permit issuance takes the tenant's gate lock in shared mode and a deletion's
acceptance takes it exclusively, in the same PostgreSQL transaction that bumps the epoch or writes
the tombstones (`close_fences`). So each permit is ordered strictly before or after each closure;
one sequence numbers both, which lets an audit prove that no permit followed a closure of a fence
its lease holds. A closure then asks the holders of earlier, still in-flight permits to cancel;
the deletion waits (FROZEN) until they are released or cancelled, or blocks at its drain deadline.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import ConflictError, NotFoundError, ServiceError, ValidationError
from memory_pipelines.lib.memories import ordering
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import LeaseRevoked

__all__ = [
    "DEFAULT_LEASE_SECONDS",
    "SINKS",
    "Fence",
    "FenceClosed",
    "Gate",
    "Permit",
    "PermitCancelled",
    "close_fences",
    "lease_fenced",
    "lock_gate_exclusive",
]

SINKS = ("model_output", "tool_dispatch", "state_write", "memory_write", "queued_work")
DEFAULT_LEASE_SECONDS = 300


class FenceClosed(ConflictError):
    """The lease read something that has since been forgotten: its sink must not accept anything."""


class PermitCancelled(ConflictError):
    """A deletion asked this in-flight permit to stop; the cancel hooks have run."""


@dataclass(frozen=True)
class Fence:
    memory_id: str
    version: int
    author_id: str
    epoch: int


def lock_gate_exclusive(conn: psycopg.Connection, tenant_id: str) -> None:
    """Taken by a deletion's acceptance in its own transaction: permits wait, then see the closure."""
    ordering.lock_tenant_exclusive(conn, tenant_id)


def close_fences(
    conn: psycopg.Connection,
    *,
    tenant_id: str,
    job_id: str,
    subject: str | None = None,
    epoch: int | None = None,
    versions: Iterable[tuple[str, int]] = (),
    tenant: bool = False,
) -> int:
    """Record the closure (same transaction as the epoch bump or tombstones) and ask every in-flight
    permit whose lease holds an affected fence to cancel; returns how many were asked."""
    pairs = sorted(set(versions))
    if subject is not None:
        conn.execute(
            "INSERT INTO control.fence_closures (tenant_id, job_id, subject_id, epoch) VALUES (%s, %s, %s, %s)",
            (tenant_id, job_id, subject, epoch),
        )
    if pairs:
        conn.execute(
            "INSERT INTO control.fence_closures (tenant_id, job_id, memory_id, version)"
            " SELECT %s, %s, m, v FROM unnest(%s::text[], %s::int[]) AS w(m, v)",
            (tenant_id, job_id, [m for m, _ in pairs], [v for _, v in pairs]),
        )
    if tenant:
        conn.execute("INSERT INTO control.fence_closures (tenant_id, job_id) VALUES (%s, %s)", (tenant_id, job_id))
    cur = conn.execute(_CANCEL_AFFECTED, {"tenant": tenant_id, "jobs": [job_id]})
    return cur.rowcount


# Leases holding a fence that one of %(jobs)s closed: the author's epoch below the closure's, the
# exact version, or any fence of the tenant for a TENANT closure.
# Closure c closed fence f: the author's epoch below the closure's, the exact version, or any
# fence of the tenant for a TENANT closure. The one definition deletion, drain and audit share.
_CLOSES = (
    " ((c.subject_id IS NOT NULL AND c.subject_id = f.author_id AND f.epoch < c.epoch)"
    " OR (c.memory_id IS NOT NULL AND c.memory_id = f.memory_id AND c.version = f.version)"
    " OR (c.subject_id IS NULL AND c.memory_id IS NULL))"
)
_AFFECTED_LEASES = (
    "SELECT f.lease_id FROM control.lease_fences f"  # noqa: S608 - constant text; values are bound
    " JOIN control.fence_closures c ON c.tenant_id = f.tenant_id"
    " WHERE c.job_id = ANY(%(jobs)s) AND f.tenant_id = %(tenant)s AND" + _CLOSES
)
# Constant text only; every value is bound.
_CANCEL_AFFECTED = (
    "UPDATE control.permits SET cancel_requested = true"  # noqa: S608
    " WHERE tenant_id = %(tenant)s AND state = 'IN_FLIGHT' AND lease_id IN (" + _AFFECTED_LEASES + ")"
)
_IN_FLIGHT = (
    "SELECT count(*) FROM control.permits"  # noqa: S608
    " WHERE tenant_id = %(tenant)s AND state = 'IN_FLIGHT' AND lease_id IN (" + _AFFECTED_LEASES + ")"
)


@dataclass
class Permit:
    """A single-use permit for one sink boundary. `check()` raises once a deletion asked to cancel."""

    permit_id: str
    lease_id: str
    tenant_id: str
    sink: str
    seq: int
    gate: Gate
    on_cancel: list[Callable[[], None]] = field(default_factory=list)
    cancelled: bool = False

    def check(self) -> None:
        """Call between units of work (tokens, chunks): stops the sink if a deletion closed its fence."""
        if self.cancelled or self.gate._cancel_requested(self.permit_id):
            self.cancel()
            raise PermitCancelled("permit", f"a deletion closed a fence of lease {self.lease_id}; output stopped")

    def cancel(self) -> None:
        """Run the cancel hooks (stop the stream, drop buffered tokens, revoke tools) and end the permit.

        The permit ends even if a hook fails: a stuck permit would block every deletion of its fences.
        """
        if not self.cancelled:
            self.cancelled = True
            try:
                for hook in self.on_cancel:
                    hook()
            finally:
                self.gate._end(self.permit_id, "CANCELLED")


class Gate:
    """Leases and permits in PostgreSQL; the one thing an agent runtime wraps around its sinks."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self._local = threading.local()

    def _conn(self) -> psycopg.Connection:
        # One connection per thread: workers take permits concurrently, as real runtimes do.
        conn = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            conn = psycopg.connect(self.store.conninfo, autocommit=True)
            # A permit waits for a deletion's acceptance (short); never forever, e.g. if a caller
            # holds a row lock that acceptance needs in another connection.
            conn.execute("SET lock_timeout = '15s'")
            self._local.conn = conn
        return conn

    # -- leases ----------------------------------------------------------------------------------

    def open_lease(
        self, *, tenant_id: str, subject_id: str, run_id: str, ttl_seconds: int = DEFAULT_LEASE_SECONDS
    ) -> str:
        """Start an agent run's lease; fences are added by `record_reads` (recall does it)."""
        validation.check_id("tenant", tenant_id)
        validation.check_id("subject", subject_id)
        validation.check_id("run", run_id)
        if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or not 1 <= ttl_seconds <= 86_400:
            raise ValidationError("ttl_seconds", "must be an integer from 1 to 86400")
        self.store.require_tenant(tenant_id=tenant_id)
        lease_id = "lease_" + secrets.token_hex(12)
        self._conn().execute(
            "INSERT INTO control.leases (lease_id, tenant_id, subject_id, run_id, expires_at, subject_epoch)"
            " VALUES (%s, %s, %s, %s, now() + make_interval(secs => %s),"
            # A subject not yet written starts at epoch 0 when it is.
            " COALESCE((SELECT epoch FROM memory.subjects WHERE tenant_id = %s AND user_id = %s), 0))",
            (lease_id, tenant_id, subject_id, run_id, ttl_seconds, tenant_id, subject_id),
        )
        return lease_id

    def record_reads(self, *, lease_id: str, fences: Iterable[Fence]) -> int:
        """Bind the lease to what the run read (exact versions and the epochs they were read under).

        Ordered against deletions like a permit: if a fence was closed before this lands (the
        run read something that is being forgotten), the lease's in-flight permits are asked to
        cancel and FenceClosed is raised, so the read's text never reaches a sink.
        """
        rows = [(f.memory_id, f.version, f.author_id, f.epoch) for f in fences]
        lease = self.lease(lease_id)
        if not rows:
            return 0
        conn = self._conn()
        with conn.transaction():
            self._lock_shared(conn, lease["tenant_id"])
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO control.lease_fences (lease_id, tenant_id, memory_id, version, author_id, epoch)"
                    " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (lease_id, memory_id, version) DO NOTHING",
                    [(lease_id, lease["tenant_id"], *row) for row in rows],
                )
            stale = conn.execute(_STALE_FENCES, {"lease": lease_id, "tenant": lease["tenant_id"]}).fetchone()
            if lease_fenced(conn, lease_id):
                stale = (max(1, stale[0] if stale else 0),)
            if stale is not None and stale[0]:
                conn.execute(
                    "UPDATE control.permits SET cancel_requested = true WHERE lease_id = %s AND state = 'IN_FLIGHT'",
                    (lease_id,),
                )
        if stale is not None and stale[0]:
            raise FenceClosed("lease", f"lease {lease_id} read {stale[0]} version(s) that are being forgotten")
        return len(rows)

    def _lock_shared(self, conn: psycopg.Connection, tenant_id: str) -> None:
        try:
            ordering.lock_tenant_shared(conn, tenant_id)
        except psycopg.errors.LockNotAvailable as exc:
            raise ServiceError("gate", f"the gate of tenant {tenant_id!r} stayed locked: {exc}") from exc

    def revoke(self, *, lease_id: str) -> LeaseRevoked:
        """Operator action for a crashed worker: cancel the lease's in-flight permits and close it.

        Cancelled permits count as drained (expiry alone does not), so a deletion waiting on them
        can complete on its next run.
        """
        self.lease(lease_id)
        cur = self._conn().execute(
            "UPDATE control.permits SET state = 'CANCELLED', cancel_requested = true, ended_at = clock_timestamp()"
            " WHERE lease_id = %s AND state = 'IN_FLIGHT'",
            (lease_id,),
        )
        self.close_lease(lease_id=lease_id)
        return {"lease_id": lease_id, "permits_cancelled": cur.rowcount}

    def close_lease(self, *, lease_id: str) -> None:
        self._conn().execute("UPDATE control.leases SET closed_at = now() WHERE lease_id = %s", (lease_id,))

    def lease(self, lease_id: str) -> dict[str, Any]:
        """The lease's tenant, subject, run, expiry and whether it is closed or expired; NotFoundError
        when there is no such lease."""
        validation.check_id("lease", lease_id)
        row = (
            self._conn()
            .execute(
                "SELECT tenant_id, subject_id, run_id, expires_at, closed_at, expires_at < now()"
                " FROM control.leases WHERE lease_id = %s",
                (lease_id,),
            )
            .fetchone()
        )
        if row is None:
            raise NotFoundError("lease", f"no lease {lease_id!r}")
        return {
            "tenant_id": row[0],
            "subject_id": row[1],
            "run_id": row[2],
            "expires_at": row[3],
            "closed": row[4] is not None,
            "expired": bool(row[5]),
        }

    def fences(self, *, lease_id: str) -> list[Fence]:
        return [
            Fence(*r)
            for r in self._conn().execute(
                "SELECT memory_id, version, author_id, epoch FROM control.lease_fences WHERE lease_id = %s"
                " ORDER BY memory_id, version",
                (lease_id,),
            )
        ]

    # -- permits ---------------------------------------------------------------------------------

    def acquire(self, *, lease_id: str, sink: str, on_cancel: Iterable[Callable[[], None]] = ()) -> Permit:
        """A permit for one sink boundary, or FenceClosed if anything the lease read was forgotten."""
        if sink not in SINKS:
            raise ValidationError("sink", f"must be one of {', '.join(SINKS)}")
        conn = self._conn()
        with conn.transaction():
            lease = self.lease(lease_id)
            if lease["closed"] or lease["expired"]:
                raise FenceClosed("lease", f"lease {lease_id} is {'closed' if lease['closed'] else 'expired'}")
            self._lock_shared(conn, lease["tenant_id"])
            # A new statement after the lock: it sees every closure committed before we got it.
            if lease_fenced(conn, lease_id):
                raise FenceClosed("lease", f"lease {lease_id} acts for a user or tenant that is being forgotten")
            stale = conn.execute(_STALE_FENCES, {"lease": lease_id, "tenant": lease["tenant_id"]}).fetchone()
            if stale is not None and stale[0]:
                raise FenceClosed(
                    "lease", f"lease {lease_id} read {stale[0]} version(s) that have since been forgotten"
                )
            permit_id = "permit_" + secrets.token_hex(12)
            seq = conn.execute(
                "INSERT INTO control.permits (permit_id, lease_id, tenant_id, sink, state)"
                " VALUES (%s, %s, %s, %s, 'IN_FLIGHT') RETURNING seq",
                (permit_id, lease_id, lease["tenant_id"], sink),
            ).fetchone()[0]  # type: ignore[index]
        return Permit(permit_id, lease_id, lease["tenant_id"], sink, int(seq), self, list(on_cancel))

    @contextmanager
    def permit(self, *, lease_id: str, sink: str, on_cancel: Iterable[Callable[[], None]] = ()) -> Iterator[Permit]:
        """`with gate.permit(lease_id=..., sink=...) as p:` accept inside, call `p.check()` between units.

        Released when the block ends; cancelled (hooks run) if a deletion asked, or on an error.
        """
        held = self.acquire(lease_id=lease_id, sink=sink, on_cancel=on_cancel)
        try:
            yield held
        except BaseException:
            held.cancel()
            raise
        if not held.cancelled:
            self._end(held.permit_id, "RELEASED")

    def _cancel_requested(self, permit_id: str) -> bool:
        row = (
            self._conn()
            .execute("SELECT cancel_requested FROM control.permits WHERE permit_id = %s", (permit_id,))
            .fetchone()
        )
        return bool(row and row[0])

    def _end(self, permit_id: str, state: str) -> None:
        self._conn().execute(
            "UPDATE control.permits SET state = %s, ended_at = clock_timestamp()"
            " WHERE permit_id = %s AND state = 'IN_FLIGHT'",
            (state, permit_id),
        )

    # -- deletion side -----------------------------------------------------------------------------

    def in_flight(self, *, tenant_id: str, job_ids: list[str]) -> int:
        """Permits still in flight on leases holding a fence these jobs closed (expired leases count)."""
        row = self._conn().execute(_IN_FLIGHT, {"tenant": tenant_id, "jobs": job_ids}).fetchone()
        return int(row[0]) if row else 0

    def wait_drained(self, *, tenant_id: str, job_ids: list[str], timeout: float) -> int:
        """Wait until no such permit is in flight; returns how many are left at the deadline (0: drained)."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.in_flight(tenant_id=tenant_id, job_ids=job_ids)
            if left == 0 or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)

    def audit(self, *, tenant_id: str | None = None) -> dict[str, int]:
        """Permits issued after a closure of a fence their lease held (must be 0), and totals."""
        row = self._conn().execute(_AUDIT, {"tenant": tenant_id}).fetchone()
        assert row is not None
        return {"permits": int(row[0]), "closures": int(row[1]), "permits_after_closure": int(row[2])}


# Fences of the lease that a later deletion closed: the author's epoch moved on or the author is
# gone, the version is tombstoned, or the tenant was deleted (or is behind a restore's gate).
_STALE_FENCES = (
    "SELECT count(*) FROM control.lease_fences f"
    " LEFT JOIN memory.subjects s ON s.tenant_id = f.tenant_id AND s.user_id = f.author_id"
    " WHERE f.lease_id = %(lease)s AND (s.user_id IS NULL OR s.epoch <> f.epoch"
    " OR EXISTS (SELECT 1 FROM control.tombstones t WHERE t.tenant_id = f.tenant_id"
    "   AND t.memory_id = f.memory_id AND t.version = f.version)"
    " OR EXISTS (SELECT 1 FROM memory.tenants x WHERE x.tenant_id = %(tenant)s"
    "   AND (x.deleted_at IS NOT NULL OR x.restoring_since IS NOT NULL)))"
)
_LEASE_FENCED = (
    "SELECT x.tenant_id IS NULL OR x.deleted_at IS NOT NULL OR x.restoring_since IS NOT NULL"
    " OR s.forgotten_at IS NOT NULL OR (l.subject_epoch IS NOT NULL AND COALESCE(s.epoch, 0) <> l.subject_epoch)"
    " FROM control.leases l LEFT JOIN memory.tenants x ON x.tenant_id = l.tenant_id"
    " LEFT JOIN memory.subjects s ON s.tenant_id = l.tenant_id AND s.user_id = l.subject_id"
    " WHERE l.lease_id = %s"
)
_AUDIT = (
    "SELECT (SELECT count(*) FROM control.permits"  # noqa: S608 - constant text; values are bound
    " WHERE %(tenant)s::text IS NULL OR tenant_id = %(tenant)s),"
    " (SELECT count(*) FROM control.fence_closures WHERE %(tenant)s::text IS NULL OR tenant_id = %(tenant)s),"
    " (SELECT count(DISTINCT p.permit_id) FROM control.permits p"
    "  JOIN control.lease_fences f ON f.lease_id = p.lease_id"
    "  JOIN control.fence_closures c ON c.tenant_id = f.tenant_id AND c.seq < p.seq AND"
    + _CLOSES
    + "  WHERE %(tenant)s::text IS NULL OR p.tenant_id = %(tenant)s)"
)


def lease_fenced(conn: psycopg.Connection, lease_id: str) -> bool:
    """The lease's own scope closed: its tenant deleted or being restored, or its subject being
    forgotten (or forgotten since the lease opened), even if the run has read nothing yet."""
    row = conn.execute(_LEASE_FENCED, (lease_id,)).fetchone()
    return row is None or bool(row[0])
