"""derivedFrom lineage: every derived record points at the exact (memory_id, version) pairs it came from.

Deletion (and "why did the assistant answer this way") walks these edges; nothing is found by
searching for text. Edges are written in the same transaction as the derived record where the
store is PostgreSQL, and idempotently (upsert, then reconcile) for Chroma.
"""

from __future__ import annotations

from collections.abc import Iterable

import psycopg

from memory_pipelines.lib.results import LineageRecord, RecordSource
from memory_pipelines.lib.stores.registry import require_writable

__all__ = [
    "Source",
    "derived_of_memory",
    "insert_edges",
    "pair_arrays",
    "record_counts",
    "record_edges",
    "records_of_ids",
    "records_of_store",
    "remove_records",
    "sources_of_record",
]

Source = tuple[str, int]  # (memory_id, version)


def pair_arrays(sources: Iterable[Source]) -> tuple[list[str], list[int]]:
    """(memory_ids, versions) arrays for `unnest(%s::text[], %s::int[])`: one parameter pair for any set size."""
    listed = sorted(sources)
    return [m for m, _ in listed], [v for _, v in listed]


def record_edges(
    conn: psycopg.Connection, *, tenant_id: str, store: str, record_id: str, sources: Iterable[Source]
) -> int:
    """Replace the sources of one derived record; returns the number of edges now recorded."""
    conn.execute(
        "DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s AND record_id = %s",
        (tenant_id, store, record_id),
    )
    return insert_edges(
        conn, tenant_id=tenant_id, store=store, records=[(record_id, source) for source in sorted(set(sources))]
    )


def insert_edges(conn: psycopg.Connection, *, tenant_id: str, store: str, records: Iterable[tuple[str, Source]]) -> int:
    """Bulk (record_id, source) edges, idempotent (e.g. one per vector, posting set or analytics row)."""
    rows = [(tenant_id, store, record_id, memory_id, version) for record_id, (memory_id, version) in records]
    if not rows:
        return 0  # nothing written (a rebuild left empty by a deletion): no gate to pass
    require_writable(conn, store, tenant_id)
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO derived.lineage (tenant_id, store, record_id, source_memory_id, source_version)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
            rows,
        )
    return len(rows)


def remove_records(conn: psycopg.Connection, *, tenant_id: str, store: str, record_ids: Iterable[str]) -> int:
    ids = list(record_ids)
    if not ids:
        return 0
    cur = conn.execute(
        "DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s AND record_id = ANY(%s)",
        (tenant_id, store, ids),
    )
    return cur.rowcount


def records_of_ids(conn: psycopg.Connection, *, tenant_id: str, store: str, record_ids: list[str]) -> list[str]:
    """Which of `record_ids` already have lineage in `store`."""
    return [
        r[0]
        for r in conn.execute(
            "SELECT DISTINCT record_id FROM derived.lineage"
            " WHERE tenant_id = %s AND store = %s AND record_id = ANY(%s)",
            (tenant_id, store, record_ids),
        )
    ]


def records_of_store(conn: psycopg.Connection, *, tenant_id: str, store: str) -> dict[str, set[Source]]:
    """record_id -> its sources, for one store of one tenant."""
    out: dict[str, set[Source]] = {}
    for record_id, memory_id, version in conn.execute(
        "SELECT record_id, source_memory_id, source_version FROM derived.lineage WHERE tenant_id = %s AND store = %s",
        (tenant_id, store),
    ):
        out.setdefault(record_id, set()).add((memory_id, version))
    return out


def derived_of_memory(conn: psycopg.Connection, *, tenant_id: str, memory_id: str) -> list[LineageRecord]:
    """Every derived record of every version of a memory."""
    return [
        {"store": store, "record_id": record_id, "memory_id": memory_id, "version": version}
        for store, record_id, version in conn.execute(
            "SELECT store, record_id, source_version FROM derived.lineage"
            " WHERE tenant_id = %s AND source_memory_id = %s ORDER BY source_version, store, record_id",
            (tenant_id, memory_id),
        )
    ]


def sources_of_record(conn: psycopg.Connection, *, tenant_id: str, store: str, record_id: str) -> list[RecordSource]:
    return [
        {"memory_id": memory_id, "version": version}
        for memory_id, version in conn.execute(
            "SELECT source_memory_id, source_version FROM derived.lineage"
            " WHERE tenant_id = %s AND store = %s AND record_id = %s ORDER BY source_memory_id, source_version",
            (tenant_id, store, record_id),
        )
    ]


def record_counts(conn: psycopg.Connection, *, tenant_id: str) -> dict[str, int]:
    """store -> number of derived records of one tenant that have lineage (the tenant's data map)."""
    return {
        store: int(n)
        for store, n in conn.execute(
            "SELECT store, count(DISTINCT record_id) FROM derived.lineage WHERE tenant_id = %s GROUP BY store",
            (tenant_id,),
        )
    }
