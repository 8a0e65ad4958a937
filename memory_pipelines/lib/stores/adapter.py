"""What every store's deletion adapter does, and the batch context deletion hands it.

An adapter finds a store's records derived from target versions (by lineage), deletes them through
the store's own API, counts what is left by exact id, answers paraphrase probes, gives the windows
its byte scan looks for, and erases the tenant's deleted records physically (a rewrite kept out of
the cascade). `deletion.py` only orchestrates; adding a store is one adapter and one registry entry.

Set-based by design: a batch reads the lineage of all its targets, for every store, in one query
(`lineage_map`, handed to adapters as `Context.lineage`, which `Context.linked` answers from), and an
adapter whose exact-id count is one SQL scalar may say so (`count_sql`), so verification asks every
such store in one statement. Both are optional: `find` and `count` alone are a complete adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import psycopg

from memory_pipelines.lib.results import DeletionJob, DeletionScope
from memory_pipelines.lib.stores import lineage
from memory_pipelines.lib.stores.registry import REQUIRED  # what an adapter must have, checked at registration

if TYPE_CHECKING:
    from memory_pipelines.lib.memories.store import MemoryStore
    from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "REQUIRED",
    "Context",
    "Erasure",
    "Lineage",
    "Source",
    "StoreAdapter",
    "compact",
    "data_directory",
    "drop_edges",
    "edges_left",
    "edges_left_sql",
    "ever_restored",
    "lineage_map",
    "linked",
    "postgres_files",
    "run_count",
]

Source = tuple[str, int]
# store -> record id -> the sources (of those asked about) it has lineage edges to.
Lineage = dict[str, dict[str, set[Source]]]


@dataclass
class Context:
    """One batch of a tenant's deletion jobs as an adapter sees it (lives in one process only)."""

    derived: DerivedStores
    tenant_id: str
    jobs: list[DeletionJob]
    everything: set[Source]
    records: set[str] = field(default_factory=set)
    # Vectors the run already read from the index (its paraphrase probes), by record id: not read twice.
    vectors: dict[str, Any] = field(default_factory=dict)
    # Record ids the run already asked the index for (those found are in `vectors`, the rest had none).
    vectors_asked: set[str] = field(default_factory=set)
    # The lineage of (at least) `everything`, read once for the batch (`lineage_map`); None: not read,
    # `linked` asks PostgreSQL itself.
    lineage: Lineage | None = None
    # What an adapter opened for this context (a collection, a bucket list), for its later calls on it.
    opened: dict[str, Any] = field(default_factory=dict)
    # store -> the adapter version this batch runs (its default, or the operator's pin).
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def store(self) -> MemoryStore:
        return self.derived.store

    @property
    def tenant_scope(self) -> bool:
        return any(job["scope"]["type"] == "TENANT" for job in self.jobs)

    def scopes(self, kind: str) -> list[DeletionScope]:
        return [job["scope"] for job in self.jobs if job["scope"]["type"] == kind]

    def subjects(self) -> list[str]:
        """The subjects of the SUBJECT scopes, in job order."""
        subjects: list[str] = []
        for scope in self.scopes("SUBJECT"):
            assert scope["subject"] is not None  # a SUBJECT scope always names its subject
            subjects.append(scope["subject"])
        return subjects

    @property
    def ids(self) -> list[str]:
        """The targets as index record ids (`memory_id:version`)."""
        return [f"{m}:{v}" for m, v in sorted(self.everything)]

    def linked(self, conn: psycopg.Connection, store: str) -> set[str]:
        """Record ids of `store` with a lineage edge to any of `everything`: from the batch's lineage
        snapshot when it has one (it covers `everything`), else one query."""
        if self.lineage is None:
            return linked(conn, self.tenant_id, store, self.everything)
        return {record for record, sources in self.lineage.get(store, {}).items() if sources & self.everything}


@dataclass
class Erasure:
    """What an adapter's physical erasure rewrote, and the files its byte scan must read."""

    bytes_rewritten: int = 0
    files: list[Path] = field(default_factory=list)
    scanned: bool = True  # False when the store's files are not on this machine (an external server)
    # Windows of data still live (e.g. another memory with the very same text embeds to the very same
    # vector): present legitimately, so a deleted copy of them can be neither proven nor disproven.
    live: set[bytes] = field(default_factory=set)
    leftovers: int = 0  # records the store itself still lists after the rewrite (must be 0)
    # Directories holding other tenants' live data, which may equal this tenant's byte for byte (two
    # tenants' same text embeds to the same vector): left out of the HOME-wide scan.
    foreign: list[Path] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class StoreAdapter(Protocol):
    name: str

    def find(self, conn: psycopg.Connection, ctx: Context) -> set[str]:
        """Record ids of this store derived from `ctx.everything` (counted at freeze, deleted later)."""

    def delete(self, ctx: Context) -> None:
        """Delete `ctx.records` (and anything else of the targets) through the store's own API."""

    def count(self, ctx: Context) -> int:
        """Records of the targets still in the store, by exact id (must be 0 to complete)."""

    def verify(self, ctx: Context, probes: Any) -> int:
        """Paraphrase-probe hits on targets (0 for stores that cannot be queried by meaning)."""

    def fingerprints(self, conn: psycopg.Connection, ctx: Context) -> list[bytes]:
        """Windows of the stored bytes of what will be deleted, taken before deletion."""

    def erase(self, derived: DerivedStores, tenant_id: str) -> Erasure:
        """Rewrite the tenant's files so deleted records leave them; the files to byte-scan."""


def linked(conn: psycopg.Connection, tenant_id: str, store: str, sources: set[Source]) -> set[str]:
    """Record ids of `store` with a lineage edge to any of `sources`."""
    if not sources:
        return set()
    return {
        r[0]
        for r in conn.execute(
            "SELECT DISTINCT l.record_id FROM unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
            " CROSS JOIN LATERAL (SELECT l.record_id FROM derived.lineage l WHERE l.tenant_id = %s"
            "  AND l.source_memory_id = w.memory_id AND l.source_version = w.version AND l.store = %s OFFSET 0) l",
            (*lineage.pair_arrays(sorted(sources)), tenant_id, store),
        )
    }


def lineage_map(conn: psycopg.Connection, tenant_id: str, sources: set[Source]) -> Lineage:
    """Every store's records with a lineage edge to any of `sources`, and which: one query for all
    stores and all sources. Each source is one probe of the lineage's by-source index (a hash join
    would read the tenant's whole lineage: 170,000 edges at 100,000 memories)."""
    out: Lineage = {}
    if not sources:
        return out
    rows = conn.execute(
        "SELECT l.store, l.record_id, w.memory_id, w.version"
        " FROM unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
        " CROSS JOIN LATERAL (SELECT l.store, l.record_id FROM derived.lineage l WHERE l.tenant_id = %s"
        "  AND l.source_memory_id = w.memory_id AND l.source_version = w.version OFFSET 0) l",
        (*lineage.pair_arrays(sorted(sources)), tenant_id),
    ).fetchall()
    for store, record_id, memory_id, version in rows:
        out.setdefault(store, {}).setdefault(record_id, set()).add((memory_id, int(version)))
    return out


def run_count(ctx: Context, sql: tuple[str, tuple[Any, ...]]) -> int:
    """Run one adapter's `count_sql` by itself (what its `count` does)."""
    query, params = sql
    with ctx.store.transaction() as conn:
        row = conn.execute(f"SELECT ({query})", params).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def ever_restored(conn: psycopg.Connection, tenant_id: str) -> bool:
    """Whether a restore was ever requested for the tenant: only a restore leaves orphans (derived
    copies of versions with no primary row, their author possibly unknown)."""
    row = conn.execute("SELECT EXISTS (SELECT 1 FROM control.restores WHERE tenant_id = %s)", (tenant_id,)).fetchone()
    return bool(row and row[0])


def edges_left(conn: psycopg.Connection, tenant_id: str, store: str | None, sources: set[Source]) -> int:
    """Lineage edges of `store` (None: of any store) still reaching any of `sources`."""
    if not sources:
        return 0
    query, params = edges_left_sql(tenant_id, store, sources)
    row = conn.execute(query, params).fetchone()
    return int(row[0]) if row else 0


def edges_left_sql(tenant_id: str, store: str | None, sources: set[Source]) -> tuple[str, tuple[Any, ...]]:
    """`edges_left` as one SQL scalar with its parameters (an adapter's `count_sql`)."""
    return (
        "SELECT count(*) FROM unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
        " CROSS JOIN LATERAL (SELECT 1 FROM derived.lineage l WHERE l.tenant_id = %s"
        "  AND l.source_memory_id = w.memory_id AND l.source_version = w.version"
        "  AND (%s::text IS NULL OR l.store = %s) OFFSET 0) l",
        (*lineage.pair_arrays(sorted(sources)), tenant_id, store, store),
    )


def drop_edges(conn: psycopg.Connection, tenant_id: str, store: str, record_ids: set[str] | list[str]) -> None:
    conn.execute(
        "DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s AND record_id = ANY(%s)",
        (tenant_id, store, sorted(record_ids)),
    )


def data_directory(conn: psycopg.Connection) -> Path | None:
    """PostgreSQL's data directory when it is on this machine and readable (the embedded server)."""
    try:
        row = conn.execute("SHOW data_directory").fetchone()
    except psycopg.Error:
        return None  # not a superuser (a managed server): its files are not ours to read
    path = Path(str(row[0])) if row else None
    return path if path is not None and (path / "PG_VERSION").is_file() else None


def postgres_files(conn: psycopg.Connection, tenant_id: str) -> list[Path]:
    """The tenant's partition files (heap, TOAST, indexes) in a local data directory; [] when remote."""
    from memory_pipelines.lib.memories import table_partitions

    data_dir = data_directory(conn)
    if data_dir is None:
        return []
    return [data_dir / rel for rel in table_partitions.tenant_files(conn, tenant_id) if (data_dir / rel).is_file()]


def compact(derived: DerivedStores, tenant_id: str, tables: tuple[str, ...]) -> Erasure:
    """Rewrite the tenant's partitions of `tables` (never another tenant's) and list their files.

    An offboarded tenant (TENANT deletion complete; it can never be written again) loses its
    partitions instead: their files are unlinked, which no rewrite beats."""
    from memory_pipelines.lib.memories import table_partitions

    with derived.store.transaction() as conn:
        row = conn.execute("SELECT deleted_at FROM memory.tenants WHERE tenant_id = %s", (tenant_id,)).fetchone()
        offboarded = row is not None and row[0] is not None
        has_partitions = bool(table_partitions.tenant_partitions(conn, tenant_id))
    if offboarded:
        dropped = 0
        if has_partitions:
            with psycopg.connect(derived.store.conninfo, autocommit=True) as conn:
                conn.execute("SET lock_timeout = '10s'")
                dropped = table_partitions.drop_tenant(conn, tenant_id)
        return Erasure(detail={"partitions_dropped": dropped})
    written = table_partitions.compact_tenant(derived.store.conninfo, tenant_id, tables=tables)
    with derived.store.transaction() as conn:
        data_dir = data_directory(conn)
        files = postgres_files(conn, tenant_id)
    return Erasure(
        bytes_rewritten=sum(written.values()),
        files=files,
        scanned=data_dir is not None,
        detail={"tables": sorted(written)},
    )
