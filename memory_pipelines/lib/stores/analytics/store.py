"""Analytics copy: pseudonymised features of each tenant's memories in PostgreSQL, queried with DuckDB.

No memory text (only its length), user and team ids pseudonymised with an HMAC under a subkey of the
tenant's key, do-not-sell memories excluded. The rows are `derived.analytics_rows`, one LIST
partition per tenant like every table holding a tenant's data, so every host of a deployment reads
and writes the same copy, and the physical erasure rewrites and byte-scans the tenant's partition
as it does the primary rows' (docs/analytics-location.md says why PostgreSQL and not object storage).

A rebuild replaces the tenant's rows in one transaction and records that the copy exists
(`derived.analytics_tenants`); a removal deletes rows. Both take the tenant's analytics lock, so
the rows and their lineage always come from the same write. Users' SQL runs on DuckDB in a child
process holding that one tenant's rows (query.py, sandbox.py).

An earlier version kept Parquet files under HOME/analytics. They are derived and rebuilt from the
memory store, so the first write of this version removes them whole (`old_files`), and the erasure
removes them too: no forgotten row is left in a file nothing reads any more.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path

import psycopg
import pyarrow as pa

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import NotFoundError
from memory_pipelines.lib.memories import ordering
from memory_pipelines.lib.memories.store import CurrentVersion, MemoryStore
from memory_pipelines.lib.results import AnalyticsAnswer
from memory_pipelines.lib.stores import lineage
from memory_pipelines.lib.stores.analytics.hidden import Hidden, hidden_now
from memory_pipelines.lib.stores.analytics.query import MAX_QUERY_ROWS, QueryLimits, parse_select, run_query
from memory_pipelines.lib.stores.analytics.rows import SCHEMA, TABLE, pseudonym, read_rows, write_rows

__all__ = [
    "MAX_QUERY_ROWS",
    "SCHEMA",
    "STORE",
    "TABLE",
    "AnalyticsStore",
    "Hidden",
    "QueryLimits",
    "hidden_now",
    "parse_select",
]

STORE = "analytics"
PSEUDONYM_KEY = "analytics-pseudonym"
_DELETE_TENANT = "DELETE FROM derived.analytics_rows WHERE tenant_id = %s"
_DELETE_RECORDS = (
    "DELETE FROM derived.analytics_rows WHERE tenant_id = %s"
    " AND (memory_id, version) IN (SELECT * FROM unnest(%s::text[], %s::int[]))"
)
_COUNT_RECORDS = (
    "SELECT count(*) FROM derived.analytics_rows WHERE tenant_id = %s AND memory_id || ':' || version = ANY(%s::text[])"
)
# Columns that would hold text, if a migration ever added one: the check counts them in the table itself.
_TEXT_COLUMNS = (
    "SELECT count(*) FROM information_schema.columns WHERE table_schema = 'derived'"
    " AND table_name = 'analytics_rows'"
    " AND column_name IN ('text', 'memory_text', 'content', 'original_query', 'summary')"
)


def _lock_tenant(conn: psycopg.Connection, tenant_id: str) -> None:
    """One writer of a tenant's rows at a time, across processes and hosts, so its rows and its
    lineage always come from the same rebuild or removal."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 3))", ("analytics\x1f" + tenant_id,))


def remove_old_files(root: Path | None) -> list[str]:
    """Remove what an earlier version kept under `root` (Parquet and a DuckDB file); the names removed."""
    if root is None or not root.is_dir():
        return []
    removed = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    with suppress(FileNotFoundError):
        shutil.rmtree(root)
    return removed


class AnalyticsStore:
    """The analytics rows of `store`'s database, and the user's SQL over one tenant's rows.

    `old_files` is where an earlier version kept the copy as files (HOME/analytics): removed at the
    first write, never read."""

    def __init__(self, *, store: MemoryStore, limits: QueryLimits | None = None, old_files: Path | None = None) -> None:
        self.store = store
        self.limits = limits or QueryLimits()
        self.old_files = old_files

    def query(
        self, sql: str, *, tenant_id: str, max_rows: int = MAX_QUERY_ROWS, store: MemoryStore | None = None
    ) -> AnalyticsAnswer:
        """Run one SELECT over one tenant's rows, exposed as the table `memories`.

        The user's SQL runs in a child process on an in-memory DuckDB holding only this tenant's
        rows, locked so it reaches no file, extension or setting (sandbox.py). Rows an accepted
        deletion hides are left out first, and a deleted or restoring tenant is refused, as by
        every read. At most `max_rows` rows are returned, with `truncated` saying whether there
        were more.
        """
        validation.check_id("tenant", tenant_id)
        statement = parse_select(sql)
        store = store or self.store
        # Checked before the rows are read: a deletion that completes in between took its rows out
        # before COMPLETE, and one accepted after the check is ordered after this read.
        hidden = hidden_now(store, tenant_id)
        table = self.read_partition(tenant_id)
        if table is None:
            raise NotFoundError(
                "tenant", f"no analytics data for tenant {tenant_id!r}: unknown, or analytics_memories not materialized"
            )
        return run_query(hidden.keep(table) if hidden else table, statement, limits=self.limits, max_rows=max_rows)

    def read_partition(self, tenant_id: str, *, columns: list[str] | None = None) -> pa.Table | None:
        """The tenant's rows (all columns, or `columns`), or None when its copy was never built."""
        with self.store.transaction() as conn:
            built = conn.execute("SELECT 1 FROM derived.analytics_tenants WHERE tenant_id = %s", (tenant_id,))
            if built.fetchone() is None:
                return None
            return read_rows(conn, tenant_id, columns)

    @staticmethod
    def pseudonym_key(store: MemoryStore, tenant_id: str) -> bytes:
        with store.transaction() as conn:
            return store.keys.tenant_subkey(conn, tenant_id, PSEUDONYM_KEY, create=False)

    def rebuild(self, *, store: MemoryStore, tenant_id: str) -> dict[str, int]:
        """Rewrite the tenant's rows from the current versions (do-not-sell rows left out)."""
        current = store.current_versions(tenant_id=tenant_id)
        kept = [cv for cv in current if not cv.do_not_sell]
        texts = store.open_texts(tenant_id=tenant_id, sources=[cv.source for cv in kept], skip_unreadable=True)
        kept = [cv for cv in kept if cv.source in texts]
        lengths = {cv.source: len(texts[cv.source]) for cv in kept}
        del texts
        key = self.pseudonym_key(store, tenant_id) if kept else b""

        def named(value: str | None) -> str | None:
            return None if value is None else pseudonym(key, value)

        with store.transaction() as conn:
            hidden = ordering.guard_build(conn, tenant_id, [(cv.memory_id, cv.version, cv.epoch) for cv in kept])
            _lock_tenant(conn, tenant_id)
            if ordering.tenant_closed(conn, tenant_id):
                return {"rows": 0, "excluded_do_not_sell": 0}  # deleted or being restored meanwhile
            kept = [cv for cv in kept if cv.source not in hidden]
            self.remove_old()
            conn.execute(_DELETE_TENANT, (tenant_id,))
            write_rows(conn, (_row(cv, tenant_id, lengths[cv.source], named) for cv in kept))
            conn.execute(
                "INSERT INTO derived.analytics_tenants (tenant_id) VALUES (%s)"
                " ON CONFLICT (tenant_id) DO UPDATE SET rebuilt_at = clock_timestamp()",
                (tenant_id,),
            )
            conn.execute("DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s", (tenant_id, STORE))
            lineage.insert_edges(
                conn, tenant_id=tenant_id, store=STORE, records=[(cv.record_id, cv.source) for cv in kept]
            )
        return {"rows": len(kept), "excluded_do_not_sell": sum(cv.do_not_sell for cv in current)}

    def remove(self, *, store: MemoryStore, tenant_id: str, sources: set[tuple[str, int]]) -> int:
        """Delete the rows of `sources` from the tenant's copy; returns rows removed.

        Used by forgetting when no other version becomes current (SUBJECT scope); a rebuild would
        decrypt every text again. The bytes leave the tenant's partition at its next erasure."""
        if not sources:
            return 0
        ordered = sorted(sources)
        with store.transaction() as conn:
            _lock_tenant(conn, tenant_id)
            self.remove_old()
            removed = conn.execute(
                _DELETE_RECORDS, (tenant_id, [m for m, _ in ordered], [v for _, v in ordered])
            ).rowcount
            lineage.remove_records(conn, tenant_id=tenant_id, store=STORE, record_ids=[f"{m}:{v}" for m, v in ordered])
        return max(removed, 0)

    def drop(self, *, store: MemoryStore, tenant_id: str) -> int:
        """Remove the tenant's rows, its copy's record and its lineage (offboarding); returns rows removed."""
        with store.transaction() as conn:
            _lock_tenant(conn, tenant_id)
            self.remove_old()
            removed = conn.execute(_DELETE_TENANT, (tenant_id,)).rowcount
            conn.execute("DELETE FROM derived.analytics_tenants WHERE tenant_id = %s", (tenant_id,))
            conn.execute("DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s", (tenant_id, STORE))
        return max(removed, 0)

    def count(self, *, tenant_id: str, record_ids: list[str]) -> int:
        """How many of `record_ids` (`memory_id:version`) still have a row."""
        with self.store.transaction() as conn:
            row = conn.execute(_COUNT_RECORDS, (tenant_id, record_ids)).fetchone()
        return int(row[0]) if row else 0

    def remove_old(self) -> list[str]:
        """Remove an earlier version's files (see the class docstring); the names removed."""
        return remove_old_files(self.old_files)

    def check(self, *, store: MemoryStore, tenant_id: str) -> dict[str, int]:
        """Counts that must be zero: text columns, do-not-sell rows, rows without lineage or not current."""
        table = self.read_partition(tenant_id, columns=["memory_id", "version"])
        if table is None:
            return {"records": 0, "text_columns": 0, "do_not_sell_rows": 0, "without_lineage": 0, "not_current": 0}
        current = {cv.record_id: cv for cv in store.current_versions(tenant_id=tenant_id)}
        ids = [f"{m}:{v}" for m, v in zip(table["memory_id"].to_pylist(), table["version"].to_pylist(), strict=True)]
        with store.transaction() as conn:
            edges = lineage.records_of_store(conn, tenant_id=tenant_id, store=STORE)
            text_columns = conn.execute(_TEXT_COLUMNS).fetchone()
        return {
            "records": len(ids),
            "text_columns": int(text_columns[0]) if text_columns else 0,
            "do_not_sell_rows": sum(1 for i in ids if i in current and current[i].do_not_sell),
            "without_lineage": sum(1 for i in ids if i not in edges),
            "not_current": sum(1 for i in ids if i not in current),
        }


def _row(
    cv: CurrentVersion, tenant_id: str, length: int, named: Callable[[str | None], str | None]
) -> tuple[object, ...]:
    return (
        cv.memory_id,
        cv.version,
        named(cv.user_id),
        named(cv.team_id),
        cv.memory_type,
        cv.category,
        cv.shareable,
        cv.confidence,
        length,
        cv.created_at,
        cv.updated_at,
        cv.version_created_at,
        tenant_id,
    )
