"""What orders what: one lock per tenant in PostgreSQL, and the check every derived write makes under it.

A deletion's acceptance (epoch bump, tombstones, tenant mark) and a restore closing its gate take
the tenant's gate lock exclusively, in the transaction that commits them. Every memory write,
rollback and derived-store build takes it shared in the transaction that commits its output, and
only then checks what it read. So each write is ordered strictly before an acceptance (and the
cascade that follows finds its output by lineage) or after it (and sees the scope hidden).

A build reads its inputs, works (embeds, summarises: seconds), then commits. `hidden_sources`,
run after the shared lock, says which of the versions it read were forgotten in the meantime;
their output is discarded. Derived writes never create keys.
"""

from __future__ import annotations

from collections.abc import Iterable

import psycopg

__all__ = [
    "GATE_PREFIX",
    "Source",
    "guard_build",
    "hidden_sources",
    "lock_tenant_exclusive",
    "lock_tenant_shared",
    "lock_writer",
    "run_lock",
    "tenant_closed",
]

GATE_PREFIX = "gate\x1f"
Source = tuple[str, int]


def run_lock(tenant_id: str) -> str:
    """The key of the tenant's run lock (hashtextextended(key, 2), a session lock): held by a forget
    run, an erasure and a restore for as long as each runs, so none interleaves with another."""
    return f"forget\x1f{tenant_id}"


def lock_tenant_shared(conn: psycopg.Connection, tenant_id: str) -> None:
    """Writers, builds and permits: held until the transaction ends; waits for an acceptance in progress."""
    conn.execute("SELECT pg_advisory_xact_lock_shared(hashtextextended(%s, 1))", (GATE_PREFIX + tenant_id,))


def lock_writer(conn: psycopg.Connection, tenant_id: str, user_id: str) -> None:
    """A single write: the tenant's gate shared, then its author's write lock (two identical concurrent
    writes make one memory), both until the transaction ends, in one round trip."""
    # A select list is evaluated left to right: the gate first, as everywhere else.
    conn.execute(
        "SELECT pg_advisory_xact_lock_shared(hashtextextended(%s, 1)), pg_advisory_xact_lock(hashtextextended(%s, 0))",
        (GATE_PREFIX + tenant_id, f"{tenant_id}\x1f{user_id}"),
    )


def lock_tenant_exclusive(conn: psycopg.Connection, tenant_id: str) -> None:
    """A deletion's acceptance or a restore closing its gate: waits for every write in flight to commit."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 1))", (GATE_PREFIX + tenant_id,))


# Versions (with the author epoch they were read under, or NULL) that are gone or hidden now: the
# row is gone, the version is tombstoned, its author is being forgotten or moved to a later epoch,
# or the tenant is deleted or behind a restore's gate. Constant text; every value is bound.
_HIDDEN = (
    "SELECT w.memory_id, w.version FROM unnest(%(m)s::text[], %(v)s::int[], %(e)s::bigint[]) AS w(memory_id, version,"
    " epoch)"
    " LEFT JOIN memory.memory_versions v ON v.tenant_id = %(t)s AND v.memory_id = w.memory_id"
    "  AND v.version = w.version"
    " LEFT JOIN memory.memories m ON m.tenant_id = %(t)s AND m.memory_id = w.memory_id"
    " LEFT JOIN memory.subjects s ON s.tenant_id = %(t)s AND s.user_id = m.user_id"
    " WHERE v.memory_id IS NULL OR s.user_id IS NULL OR s.forgotten_at IS NOT NULL"
    " OR (w.epoch IS NOT NULL AND s.epoch <> w.epoch)"
    " OR EXISTS (SELECT 1 FROM control.tombstones x WHERE x.tenant_id = %(t)s AND x.memory_id = w.memory_id"
    "  AND x.version = w.version)"
    " OR NOT EXISTS (SELECT 1 FROM memory.tenants o WHERE o.tenant_id = %(t)s AND o.deleted_at IS NULL"
    "  AND o.restoring_since IS NULL)"
)

_HIDDEN_PRESENT = (
    "SELECT * FROM ("  # noqa: S608 - constant text; values are bound
    + _HIDDEN
    + ") h WHERE EXISTS (SELECT 1 FROM memory.memory_versions p"
    " WHERE p.tenant_id = %(t)s AND p.memory_id = h.memory_id AND p.version = h.version)"
)


def tenant_closed(conn: psycopg.Connection, tenant_id: str) -> bool:
    """True when the tenant is deleted (or unknown) or behind a restore's gate."""
    row = conn.execute(
        "SELECT deleted_at IS NOT NULL OR restoring_since IS NOT NULL FROM memory.tenants WHERE tenant_id = %s",
        (tenant_id,),
    ).fetchone()
    return row is None or bool(row[0])


def hidden_sources(
    conn: psycopg.Connection,
    tenant_id: str,
    sources: Iterable[Source | tuple[str, int, int | None]],
    *,
    missing_is_hidden: bool = True,
) -> set[Source]:
    """Which of `sources` ((memory_id, version) or (memory_id, version, epoch read)) are forgotten now.

    Call it after `lock_tenant_shared` in the transaction that writes the derived output; every
    source counts as hidden when the tenant is closed. With `missing_is_hidden=False`, versions
    whose row is gone (deleted by a finished cascade, or removed by a restore) are not reported:
    a sync removes their leftovers itself, as no deletion job is pending for them.
    """
    rows = [(s[0], s[1], s[2] if len(s) > 2 else None) for s in sources]
    if not rows:
        return set()
    query = _HIDDEN if missing_is_hidden else _HIDDEN_PRESENT
    found = conn.execute(
        query, {"m": [r[0] for r in rows], "v": [r[1] for r in rows], "e": [r[2] for r in rows], "t": tenant_id}
    ).fetchall()
    return {(m, v) for m, v in found}


def guard_build(
    conn: psycopg.Connection,
    tenant_id: str,
    sources: Iterable[Source | tuple[str, int, int | None]],
    *,
    missing_is_hidden: bool = True,
) -> set[Source]:
    """Lock shared, then return the hidden subset of `sources`: the one call a derived write makes."""
    lock_tenant_shared(conn, tenant_id)
    return hidden_sources(conn, tenant_id, sources, missing_is_hidden=missing_is_hidden)
