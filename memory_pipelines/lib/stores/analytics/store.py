"""Analytics copy: Parquet hive-partitioned by tenant and by subject bucket, read through DuckDB views.

No memory text (only its length), user and team ids pseudonymised with an HMAC under the tenant
key, do-not-sell memories excluded.

Layout: `root/tenants/tenant=H/bucket=NN/part.parquet`, where H is `paths.tenant_hash(T)` (the
digest that names the tenant's Chroma collection): no file or directory is named by a raw tenant
id, so tenants differing in case only (`Acme`, `acme`) never share a directory on a
case-insensitive file system, and a listing of HOME names no tenant. Each row carries its tenant
as a real column, `tenant_id`: every read keeps only the rows whose column is the tenant asked for,
and the view takes `tenant_id` from the files (the hash key of the path is left out of it).

A row's bucket is the first byte of its author's pseudonym (that same HMAC) modulo BUCKETS, so it
says nothing the row does not already say and needs no key of its own. Team memories sit in their
author's bucket, and a memory keeps its author for life, so each memory lives in exactly one bucket
file. Forgetting a subject rewrites that subject's bucket alone; a rebuild writes every bucket file
of the tenant aside, then renames them all in one pass. Each file is replaced whole by a rename, so
a reader sees each memory's old row or its new one, never both and never half a file (across
buckets, a reader listing files during the renames of a rebuild may see some already new and some
still old).

One writer at a time across processes: every write of a Parquet file and every change of the
DuckDB file happens under an fcntl lock on `root/.analytics.lock` (held for a file write, never
for a query). The DuckDB file is never opened read-write in place: a new one is written aside and
renamed over it, so a reader (read_only=True, here or in a notebook) never meets DuckDB's own
file lock, and a writer never fails because a reader holds the file open.

A bucket left without rows is replaced by an empty file, unlinked once it has been empty for
`empty_bucket_grace` seconds by a later write that looks at it (every rebuild does): the view globs
its files and then opens them, and a file unlinked in between would fail a notebook's query.

Older installs name each tenant's directory by its raw id, `root/memories/tenant_id=T/`, holding
either buckets without the `tenant_id` column (`bucket=NN/part.parquet`) or, from before the
buckets, one file (`memories.parquet`). Such a directory is read as before, and the first write
after the upgrade (or `refresh_views`) converts every one of them under the writer lock: the new
directory written whole, then the view switched, then each old directory renamed out of the way
in one step and its files unlinked. So each reader sees one whole copy throughout: these methods
read the old directory while it is there, and turn to the new one, already complete, when they
find it gone or lose a file of it mid-read; the old view globs only old files and the new one only
new files (hence a new top directory, `tenants`, rather than new names beside the old ones). An old
directory shared by two tenants differing in case (on macOS) cannot be told apart from its files:
it converts to the tenant its name shows, and the next rebuild of each tenant replaces that.

`AnalyticsStore` is assembled from one module per concern: files.py (schema, bucket layout, the
writer lock, replacing bucket files), views.py (the DuckDB view), legacy.py (reading and converting
old directories), hidden.py (what accepted deletions hide), query.py (reads and the user's SQL);
this module holds the writes (rebuild, removal, drop) and the check.
"""

from __future__ import annotations

import shutil
from contextlib import suppress
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.compute as pc

from memory_pipelines.lib.infra.errors import NotFoundError
from memory_pipelines.lib.memories import ordering
from memory_pipelines.lib.memories.store import CurrentVersion, MemoryStore
from memory_pipelines.lib.stores import lineage
from memory_pipelines.lib.stores.analytics.files import (
    BUCKET_FILE,
    BUCKETS,
    DATA_DIR,
    EMPTY_BUCKET_GRACE_SECONDS,
    LEGACY_FILE,
    LOCK_FILE,
    OLD_DATA_DIR,
    OLD_TENANT_KEY,
    RETIRED_DIR,
    SCHEMA,
    TENANT_KEY,
    Rewrite,
    _pseudonym,
    _record_ids,
    bucket_of,
)
from memory_pipelines.lib.stores.analytics.hidden import Hidden, hidden_now
from memory_pipelines.lib.stores.analytics.query import MAX_QUERY_ROWS, AnalyticsReads, QueryLimits, parse_select

__all__ = [
    "BUCKETS",
    "BUCKET_FILE",
    "DATA_DIR",
    "EMPTY_BUCKET_GRACE_SECONDS",
    "LEGACY_FILE",
    "LOCK_FILE",
    "MAX_QUERY_ROWS",
    "OLD_DATA_DIR",
    "OLD_TENANT_KEY",
    "RETIRED_DIR",
    "SCHEMA",
    "STORE",
    "TENANT_KEY",
    "AnalyticsStore",
    "Hidden",
    "QueryLimits",
    "Rewrite",
    "bucket_of",
    "hidden_now",
    "parse_select",
]

STORE = "analytics"


def _lock_partition(conn: psycopg.Connection, tenant_id: str) -> None:
    """One writer of a tenant's partition at a time, across processes, so its files and its lineage
    always come from the same rebuild or removal."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 3))", ("analytics\x1f" + tenant_id,))


class AnalyticsStore(AnalyticsReads):
    """Parquet files under `root/tenants/tenant=H/bucket=NN/` (H the tenant's hash) and a DuckDB
    database with views over them.

    `store` is the memory store whose accepted deletions `query` hides (every product path gives it);
    without one, `query` reads the files as they are."""

    def __init__(
        self,
        root: Path,
        *,
        store: MemoryStore | None = None,
        limits: QueryLimits | None = None,
        empty_bucket_grace: float = EMPTY_BUCKET_GRACE_SECONDS,
    ) -> None:
        self.root = root
        self.limits = limits or QueryLimits()
        self.data_dir = root / DATA_DIR
        self.old_data_dir = root / OLD_DATA_DIR
        self.database = root / "analytics.duckdb"
        self.empty_bucket_grace = empty_bucket_grace
        self.store = store

    def refresh_views(self) -> None:
        """Create the `memories` view over every tenant's buckets (or drop it when there is none).

        The view is a glob, so it stays right as files come and go: the database changes only when
        the view must appear, go, or read another glob (an install from before the buckets, or a
        moved root), under the writer lock, by replacing the file whole.
        """
        with self.writer_lock():
            self._upgrade_locked()
            has_data = self._has_data()
            if self.database.exists() and self._view_is(has_data):
                return
            self._write_view(has_data)

    def subject_bucket(self, *, store: MemoryStore, tenant_id: str, user_id: str) -> int:
        """The bucket holding `user_id`'s rows (it needs the tenant key, as the pseudonym does)."""
        return bucket_of(_pseudonym(self._pseudonym_key(store, tenant_id), user_id))

    @staticmethod
    def _pseudonym_key(store: MemoryStore, tenant_id: str) -> bytes:
        with store.transaction() as conn:
            return store.keys.tenant_subkey(conn, tenant_id, "analytics-pseudonym", create=False)

    def rebuild(self, *, store: MemoryStore, tenant_id: str) -> dict[str, int]:
        """Rewrite the tenant's partition from the current versions (do-not-sell rows left out)."""
        current = store.current_versions(tenant_id=tenant_id)
        kept = [cv for cv in current if not cv.do_not_sell]
        texts = store.open_texts(tenant_id=tenant_id, sources=[cv.source for cv in kept], skip_unreadable=True)
        kept = [cv for cv in kept if cv.source in texts]
        if not kept and not current:
            return self._commit(store, tenant_id, [], SCHEMA.empty_table(), 0)
        key = self._pseudonym_key(store, tenant_id)

        def pseudonym(value: str | None) -> str | None:
            return None if value is None else _pseudonym(key, value)

        table = pa.Table.from_pylist(
            [
                {
                    "memory_id": cv.memory_id,
                    "version": cv.version,
                    "user_pseudonym": pseudonym(cv.user_id),
                    "team_pseudonym": pseudonym(cv.team_id),
                    "memory_type": cv.memory_type,
                    "category": cv.category,
                    "shareable": cv.shareable,
                    "confidence": cv.confidence,
                    "text_length": len(texts[cv.source]),
                    "created_at": cv.created_at,
                    "updated_at": cv.updated_at,
                    "version_created_at": cv.version_created_at,
                    "tenant_id": tenant_id,
                }
                for cv in kept
            ],
            schema=SCHEMA,
        )
        return self._commit(store, tenant_id, kept, table, sum(cv.do_not_sell for cv in current))

    def _commit(
        self, store: MemoryStore, tenant_id: str, kept: list[CurrentVersion], table: pa.Table, do_not_sell: int
    ) -> dict[str, int]:
        """Write the partition and its lineage under the gate lock, without rows forgotten since they were read."""
        with store.transaction() as conn:
            hidden = ordering.guard_build(conn, tenant_id, [(cv.memory_id, cv.version, cv.epoch) for cv in kept])
            _lock_partition(conn, tenant_id)
            if ordering.tenant_closed(conn, tenant_id):
                return {"rows": 0, "excluded_do_not_sell": 0}  # deleted or being restored meanwhile
            if hidden:
                keep_mask = pa.array([cv.source not in hidden for cv in kept], type=pa.bool_())
                table = table.filter(keep_mask)
                kept = [cv for cv in kept if cv.source not in hidden]
            with self.writer_lock():
                self._upgrade_locked()
                self._replace_partition_locked(tenant_id, table)
            conn.execute("DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s", (tenant_id, STORE))
            lineage.insert_edges(
                conn, tenant_id=tenant_id, store=STORE, records=[(cv.record_id, cv.source) for cv in kept]
            )
        self.refresh_views()
        return {"rows": len(kept), "excluded_do_not_sell": do_not_sell}

    def remove(self, *, store: MemoryStore, tenant_id: str, sources: set[tuple[str, int]]) -> int:
        """Remove the rows of `sources` from the tenant's partition; returns rows removed."""
        return self.remove_and_report(store=store, tenant_id=tenant_id, sources=sources).rows

    def remove_and_report(self, *, store: MemoryStore, tenant_id: str, sources: set[tuple[str, int]]) -> Rewrite:
        """`remove`, saying which files it rewrote or deleted and how many bytes it wrote.

        Used by forgetting when no other version becomes current (SUBJECT scope): only the bucket
        files holding those rows are read and rewritten (one for a single subject); a rebuild would
        decrypt every text again.
        """
        if not sources:
            return Rewrite()
        gone = pa.array(sorted(f"{m}:{v}" for m, v in sources))
        report = Rewrite()
        with store.transaction() as conn:
            _lock_partition(conn, tenant_id)
            with self.writer_lock():
                self._upgrade_locked()
            # The partition lock keeps every other writer of this tenant's files out from here on.
            wanted = self._buckets_holding(conn, store, tenant_id, sources)
            tables: dict[int, pa.Table] = {}
            empty: list[int] = []
            for bucket, parquet in self.open_buckets(tenant_id, wanted):
                if parquet.metadata.num_rows == 0:
                    empty.append(bucket)
                    continue
                drop = pc.is_in(_record_ids(parquet.read(columns=["memory_id", "version"])), value_set=gone)
                removed = pc.sum(drop).as_py() or 0
                if removed:
                    tables[bucket] = parquet.read().filter(pc.invert(drop))
                    report.rows += removed
            if tables or empty:
                with self.writer_lock():
                    self._install_locked(tenant_id, tables, report)
                    self._reap_locked(tenant_id, empty + [b for b, t in tables.items() if not t.num_rows], report)
            lineage.remove_records(
                conn, tenant_id=tenant_id, store=STORE, record_ids=[f"{m}:{v}" for m, v in sorted(sources)]
            )
        if report.files_deleted:
            self.refresh_views()
        return report

    @staticmethod
    def _buckets_holding(
        conn: psycopg.Connection, store: MemoryStore, tenant_id: str, sources: set[tuple[str, int]]
    ) -> set[int] | None:
        """The buckets of the authors of `sources`, or None when that cannot be told (a memory gone
        from the store already, as on a retried deletion, or no tenant key): every bucket is read."""
        memory_ids = sorted({m for m, _ in sources})
        authors: dict[str, str] = dict(
            conn.execute(
                "SELECT memory_id, user_id FROM memory.memories WHERE tenant_id = %s AND memory_id = ANY(%s)",
                (tenant_id, memory_ids),
            ).fetchall()
        )
        if len(authors) < len(memory_ids):
            return None
        try:
            key = store.keys.tenant_subkey(conn, tenant_id, "analytics-pseudonym", create=False)
        except NotFoundError:
            return None
        return {bucket_of(_pseudonym(key, user_id)) for user_id in set(authors.values())}

    def drop(self, *, store: MemoryStore, tenant_id: str) -> int:
        """Remove the tenant's partition and its lineage (tenant offboarding); returns rows removed."""
        with store.transaction() as conn:
            _lock_partition(conn, tenant_id)
            table = self.read_partition(tenant_id)
            with self.writer_lock():
                self._upgrade_locked()  # an old directory would otherwise outlive the drop
                with suppress(FileNotFoundError):
                    shutil.rmtree(self.partition_dir(tenant_id))
            conn.execute("DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s", (tenant_id, STORE))
        self.refresh_views()
        return 0 if table is None else table.num_rows

    def check(self, *, store: MemoryStore, tenant_id: str) -> dict[str, int]:
        """Counts that must be zero: text columns, do-not-sell rows, rows without lineage or not current."""
        table = self.read_partition(tenant_id)
        if table is None:
            return {"records": 0, "text_columns": 0, "do_not_sell_rows": 0, "without_lineage": 0, "not_current": 0}
        current = {cv.record_id: cv for cv in store.current_versions(tenant_id=tenant_id)}
        ids = [f"{m}:{v}" for m, v in zip(table["memory_id"].to_pylist(), table["version"].to_pylist(), strict=True)]
        with store.transaction() as conn:
            edges = lineage.records_of_store(conn, tenant_id=tenant_id, store=STORE)
        text_like = {"text", "memory_text", "content", "original_query", "summary"}
        return {
            "records": len(ids),
            "text_columns": sum(1 for name in table.column_names if name in text_like),
            "do_not_sell_rows": sum(1 for i in ids if i in current and current[i].do_not_sell),
            "without_lineage": sum(1 for i in ids if i not in edges),
            "not_current": sum(1 for i in ids if i not in current),
        }
