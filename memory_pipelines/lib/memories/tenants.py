"""Tenants and their subjects: creating a tenant, its sharing mode, the change sequence every write
bumps (what sensors watch), and the checks every operation starts with (the tenant exists, is not
deleted, is not behind the restore gate; a subject is not being forgotten).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import ConflictError, NotFoundError
from memory_pipelines.lib.memories import consent, ordering
from memory_pipelines.lib.memories.connections import Connections
from memory_pipelines.lib.memories.records import iso
from memory_pipelines.lib.results import TenantInfo, TenantMode, TestTenant

__all__ = [
    "Tenants",
    "bump",
    "ensure_subject",
    "ensure_tenant",
    "reopen_if_restore_died",
    "tenant_mode",
]


# The tenant made when new and its row read, in one round trip (a write waits on each). The statement's
# SELECT does not see a row its own INSERT made (one snapshot): that row comes from RETURNING.
_ENSURE_TENANT = (
    "WITH made AS (INSERT INTO memory.tenants (tenant_id) VALUES (%(t)s) ON CONFLICT (tenant_id) DO NOTHING"
    " RETURNING sharing_mode, deleted_at, restoring_since)"
    " SELECT true, sharing_mode, deleted_at, restoring_since FROM made UNION ALL"
    " SELECT false, sharing_mode, deleted_at, restoring_since FROM memory.tenants WHERE tenant_id = %(t)s"
)


# A restore closes its tenant's gate while holding the tenant's run lock (a session lock, released when
# its process dies): a gate closed by a RUNNING restore whose lock can be taken was left by a dead one.
# Then, in the caller's transaction, the restore is INTERRUPTED and the gate opens on the rows the tenant
# had (a restore loads in one transaction, which died with it). Never waits: a held lock is a live run.
_REOPEN_IF_RESTORE_DIED = (
    "WITH free AS (SELECT pg_try_advisory_xact_lock(hashtextextended(%(lock)s, 2)) AS got),"
    " stuck AS (UPDATE control.restores r SET state = 'INTERRUPTED',"
    "  report = r.report || jsonb_build_object('state', 'INTERRUPTED', 'interrupted_at', now())"
    "  FROM free WHERE free.got AND r.tenant_id = %(t)s AND r.state = 'RUNNING' RETURNING r.restore_id)"
    " UPDATE memory.tenants t SET restoring_since = NULL, change_seq = t.change_seq + 1, updated_at = now()"
    " WHERE t.tenant_id = %(t)s AND t.restoring_since IS NOT NULL AND EXISTS (SELECT 1 FROM stuck)"
    " RETURNING t.tenant_id"
)


def reopen_if_restore_died(conn: psycopg.Connection, tenant_id: str) -> bool:
    """Open the tenant's gate if the restore that closed it died (see _REOPEN_IF_RESTORE_DIED); True when
    it did. A gate a BLOCKED restore closed stays closed (`reopen` or a later restore opens it)."""
    row = conn.execute(_REOPEN_IF_RESTORE_DIED, {"t": tenant_id, "lock": ordering.run_lock(tenant_id)}).fetchone()
    return row is not None


def _usable_mode(tenant_id: str, row: Sequence[Any] | None) -> str:
    """The sharing mode of a tenant row (sharing_mode, deleted_at, restoring_since) that may be used."""
    if row is None:
        raise NotFoundError("tenant", f"unknown tenant {tenant_id!r}")
    if row[1] is not None:
        raise NotFoundError("tenant", f"tenant {tenant_id!r} was deleted")
    if row[2] is not None:
        # The restore gate: nothing is read or written until the journal replay is verified.
        raise ConflictError(
            "tenant", f"tenant {tenant_id!r} is being restored; it reopens once the restore is verified"
        )
    return str(row[0])


def bump(conn: psycopg.Connection, tenant_id: str) -> None:
    """Advance the tenant's change sequence (what sensors watch): every change of its memories calls it."""
    conn.execute(
        "UPDATE memory.tenants SET change_seq = change_seq + 1, updated_at = now() WHERE tenant_id = %s",
        (tenant_id,),
    )


def ensure_tenant(conn: psycopg.Connection, tenant_id: str) -> None:
    """Make the tenant when new (its id checked); refuse one deleted or behind the restore gate."""
    row = conn.execute(_ENSURE_TENANT, {"t": tenant_id}).fetchone()
    if row is None or row[3] is not None:  # made meanwhile (waited for), or behind the restore gate
        tenant_mode(conn, tenant_id)
        return
    if row[0]:
        validation.check_new_tenant(tenant_id)  # raising rolls the insert back
    _usable_mode(tenant_id, row[1:])  # refuses a deleted tenant


def ensure_subject(conn: psycopg.Connection, tenant_id: str, user_id: str) -> None:
    """Make the subject when new; refuse one being forgotten."""
    row = conn.execute(
        "INSERT INTO memory.subjects (tenant_id, user_id) VALUES (%s, %s)"
        " ON CONFLICT (tenant_id, user_id) DO UPDATE SET user_id = EXCLUDED.user_id RETURNING forgotten_at",
        (tenant_id, user_id),
    ).fetchone()
    if row is not None and row[0] is not None:
        raise ConflictError("user", f"subject {user_id!r} is being forgotten; writes resume when that job completes")


def tenant_mode(conn: psycopg.Connection, tenant_id: str) -> str:
    """The sharing mode of a tenant that may be used now; refuses one unknown, deleted or being restored."""
    select = "SELECT sharing_mode, deleted_at, restoring_since FROM memory.tenants WHERE tenant_id = %s"
    row = conn.execute(select, (tenant_id,)).fetchone()
    if row is not None and row[2] is not None and reopen_if_restore_died(conn, tenant_id):
        row = conn.execute(select, (tenant_id,)).fetchone()
    return _usable_mode(tenant_id, row)


def _set_mode(conn: psycopg.Connection, tenant_id: str, sharing_mode: str) -> None:
    # A change is journalled with it, so no restore of an older backup undoes it (lib/memories/consent.py).
    row = conn.execute(
        "SELECT sharing_mode FROM memory.tenants WHERE tenant_id = %s FOR UPDATE", (tenant_id,)
    ).fetchone()
    conn.execute(
        "UPDATE memory.tenants SET sharing_mode = %s, updated_at = now() WHERE tenant_id = %s",
        (sharing_mode, tenant_id),
    )
    if row is not None and row[0] != sharing_mode:
        consent.record(conn, tenant_id, "SHARING_MODE", mode=sharing_mode)


class Tenants:
    """Tenants, their sharing mode and change sequence: made, changed and read on `connections`."""

    def __init__(self, connections: Connections) -> None:
        self.connections = connections

    def create_tenant(self, *, tenant_id: str, sharing_mode: str = "strict") -> TenantMode:
        """Create a tenant (idempotent); an existing tenant keeps its data and gets `sharing_mode`."""
        validation.check_id("tenant", tenant_id)
        validation.check_sharing_mode(sharing_mode)
        with self.connections.transaction() as conn:
            ensure_tenant(conn, tenant_id)
            _set_mode(conn, tenant_id, sharing_mode)
            bump(conn, tenant_id)
        return {"tenant_id": tenant_id, "sharing_mode": sharing_mode}

    def set_test_tenant(self, *, tenant_id: str, test: bool = True) -> TestTenant:
        """Mark a tenant as a test tenant (made if absent), or not: stores registered `onboarding`
        receive only test tenants' memories (lib/stores/registry.py)."""
        validation.check_id("tenant", tenant_id)
        with self.connections.transaction() as conn:
            ensure_tenant(conn, tenant_id)
            conn.execute("UPDATE memory.tenants SET test_tenant = %s WHERE tenant_id = %s", (test, tenant_id))
        return {"tenant_id": tenant_id, "test": test}

    def set_sharing_mode(self, *, tenant_id: str, sharing_mode: str) -> TenantMode:
        validation.check_id("tenant", tenant_id)
        validation.check_sharing_mode(sharing_mode)
        with self.connections.transaction() as conn:
            tenant_mode(conn, tenant_id)
            _set_mode(conn, tenant_id, sharing_mode)
            bump(conn, tenant_id)
        return {"tenant_id": tenant_id, "sharing_mode": sharing_mode}

    def tenants(self) -> list[TenantInfo]:
        """Every tenant with its sharing mode and counts (no text)."""
        with self.connections.transaction() as conn:
            rows = conn.execute(
                """
                SELECT t.tenant_id, t.sharing_mode, t.change_seq, t.created_at,
                       (SELECT count(*) FROM memory.memories m WHERE m.tenant_id = t.tenant_id) AS memories,
                       (SELECT count(*) FROM memory.subjects s WHERE s.tenant_id = t.tenant_id) AS subjects,
                       (SELECT count(*) FROM memory.teams tm WHERE tm.tenant_id = t.tenant_id) AS teams
                FROM memory.tenants t WHERE t.deleted_at IS NULL ORDER BY t.tenant_id
                """
            ).fetchall()
        return [
            {
                "tenant_id": r[0],
                "sharing_mode": r[1],
                "change_seq": r[2],
                "created_at": iso(r[3]),
                "memories": r[4],
                "subjects": r[5],
                "teams": r[6],
            }
            for r in rows
        ]

    def tenant_watermarks(self) -> dict[str, int]:
        """tenant -> change sequence; grows with every write, so a sensor can tell what changed.

        Tenants behind the restore gate are left out: they show again, with a new sequence, once
        the restore reopens them.
        """
        with self.connections.transaction() as conn:
            return {
                r[0]: int(r[1])
                for r in conn.execute(
                    "SELECT tenant_id, change_seq FROM memory.tenants WHERE deleted_at IS NULL"
                    " AND restoring_since IS NULL"
                )
            }

    def tenant_exists(self, *, tenant_id: str) -> bool:
        with self.connections.transaction() as conn:
            return (
                conn.execute("SELECT 1 FROM memory.tenants WHERE tenant_id = %s", (tenant_id,)).fetchone() is not None
            )

    def require_tenant(self, *, tenant_id: str) -> str:
        """The tenant's sharing mode; NotFoundError('tenant') when it does not exist."""
        validation.check_id("tenant", tenant_id)
        with self.connections.transaction() as conn:
            return tenant_mode(conn, tenant_id)

    def change_seq(self, *, tenant_id: str) -> int:
        with self.connections.transaction() as conn:
            row = conn.execute("SELECT change_seq FROM memory.tenants WHERE tenant_id = %s", (tenant_id,)).fetchone()
        if row is None:
            raise NotFoundError("tenant", f"unknown tenant {tenant_id!r}")
        return int(row[0])
