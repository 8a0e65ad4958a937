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
"""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import time as clock
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import NotFoundError, ValidationError
from memory_pipelines.lib.infra.owner_only import private_dir, private_file
from memory_pipelines.lib.infra.paths import tenant_hash
from memory_pipelines.lib.infra.settings import (
    DEFAULT_ANALYTICS_MEMORY_MB,
    DEFAULT_ANALYTICS_THREADS,
    DEFAULT_ANALYTICS_TIMEOUT,
    Settings,
)
from memory_pipelines.lib.memories import crypto, ordering
from memory_pipelines.lib.memories.store import CurrentVersion, MemoryStore
from memory_pipelines.lib.stores import lineage
from memory_pipelines.lib.stores.analytics import sandbox as sql_sandbox

STORE = "analytics"
SCHEMA = pa.schema(
    [
        ("memory_id", pa.string()),
        ("version", pa.int32()),
        ("user_pseudonym", pa.string()),
        ("team_pseudonym", pa.string()),
        ("memory_type", pa.string()),
        ("category", pa.string()),
        ("shareable", pa.bool_()),
        ("confidence", pa.float64()),
        ("text_length", pa.int32()),
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("updated_at", pa.timestamp("us", tz="UTC")),
        ("version_created_at", pa.timestamp("us", tz="UTC")),
        # In the file, not only in the path: the directory is named by a hash of the tenant, and
        # reads keep only the rows whose column is the tenant asked for.
        ("tenant_id", pa.string()),
    ]
)
# 64 buckets: 256 is a multiple of it, so the first HMAC byte spreads authors evenly; a tenant of
# ~1,000 subjects has ~16 per bucket, so forgetting one rewrites ~1/64 of its rows, while a small
# tenant holds at most 64 files (more buckets would mean more files and footers per full read).
BUCKETS = 64
BUCKET_FILE = "part.parquet"
DATA_DIR = "tenants"  # root/tenants/tenant=<tenant_hash>/bucket=NN/part.parquet
TENANT_KEY = "tenant"  # the hive key of a tenant's directory; its value is the hash, never the id
OLD_DATA_DIR = "memories"  # installs from before the hashed names: root/memories/tenant_id=<id>/
OLD_TENANT_KEY = "tenant_id"
LEGACY_FILE = "memories.parquet"  # the one file per tenant of installs from before the buckets
RETIRED_DIR = ".retired"  # an old directory renamed here during its conversion, then unlinked
EMPTY_BUCKET_GRACE_SECONDS = 600.0
# Only a plain SELECT (FROM-first, WITH, VALUES, DESCRIBE and SUMMARIZE parse as one too). Never
# EXPLAIN: `EXPLAIN ANALYZE` executes its statement, `COPY ... TO` included.
_READ_ONLY_STATEMENTS = {"SELECT"}
MAX_QUERY_ROWS = 10_000
LOCK_FILE = ".analytics.lock"
_HEX_BYTES = pa.array([f"{i:02x}" for i in range(256)])


def _lock_partition(conn: psycopg.Connection, tenant_id: str) -> None:
    """One writer of a tenant's partition at a time, across processes, so its files and its lineage
    always come from the same rebuild or removal."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 3))", ("analytics\x1f" + tenant_id,))


def _pseudonym(key: bytes, value: str) -> str:
    return crypto.mac(key, value.encode()).hex()[:32]


def bucket_of(user_pseudonym: str) -> int:
    """The bucket of an author's rows: the first byte of its pseudonym (an HMAC) modulo BUCKETS."""
    return int(user_pseudonym[:2], 16) % BUCKETS


def _buckets(user_pseudonyms: pa.ChunkedArray | pa.Array) -> pa.Array:
    """bucket_of for a whole column (a pseudonym that is not hex, never written by us, goes to 0)."""
    first_byte = pc.index_in(pc.utf8_slice_codeunits(user_pseudonyms, 0, 2), value_set=_HEX_BYTES)
    return pc.cast(pc.bit_wise_and(pc.fill_null(first_byte, 0), BUCKETS - 1), pa.int32())


def _record_ids(table: pa.Table) -> pa.ChunkedArray:
    return pc.binary_join_element_wise(table["memory_id"], pc.cast(table["version"], pa.string()), ":")


@dataclass
class Rewrite:
    """What one write did to a tenant's files: what callers (and benchmarks) can check."""

    rows: int = 0
    files_rewritten: list[str] = field(default_factory=list)  # relative to the analytics root
    files_deleted: list[str] = field(default_factory=list)
    bytes_written: int = 0


@dataclass(frozen=True)
class Hidden:
    """What accepted deletions hide from a tenant's analytics rows now, before their cascade reaches
    the files: authors being forgotten (by pseudonym), memories forgotten whole, single versions."""

    pseudonyms: frozenset[str] = frozenset()
    memories: frozenset[str] = frozenset()
    records: frozenset[str] = frozenset()  # memory_id:version
    everything: bool = False  # authors being forgotten, and no tenant key left to name them by

    def __bool__(self) -> bool:
        return self.everything or bool(self.pseudonyms or self.memories or self.records)

    def keep(self, table: pa.Table) -> pa.Table:
        """The rows of `table` (analytics rows) that nothing hides."""
        if self.everything:
            return table.slice(0, 0)
        masks = [
            pc.fill_null(pc.is_in(column(), value_set=pa.array(sorted(values), pa.string())), False)
            for column, values in (
                (lambda: table["user_pseudonym"], self.pseudonyms),
                (lambda: table["memory_id"], self.memories),
                (lambda: _record_ids(table), self.records),
            )
            if values
        ]
        if not masks:
            return table
        drop = masks[0]
        for mask in masks[1:]:
            drop = pc.or_(drop, mask)
        return table.filter(pc.invert(drop))


# What accepted deletions whose cascade has not completed hide in one tenant; a COMPLETE one has taken
# its rows out of the files (its verification counts them by exact id). One statement, bound values.
_HIDDEN_NOW = (
    "SELECT 'subject', s.user_id, NULL::int FROM memory.subjects s"
    " WHERE s.tenant_id = %(t)s AND s.forgotten_at IS NOT NULL"
    " UNION ALL SELECT 'memory', j.memory_id, NULL FROM control.deletion_jobs j"
    " WHERE j.tenant_id = %(t)s AND j.state <> 'COMPLETE' AND j.scope = 'MEMORY' AND j.version IS NULL"
    " UNION ALL SELECT CASE WHEN j.scope = 'RETENTION' THEN 'memory' ELSE 'version' END, x.memory_id, x.version"
    " FROM control.deletion_jobs j JOIN control.tombstones x ON x.job_id = j.job_id AND x.tenant_id = %(t)s"
    " WHERE j.tenant_id = %(t)s AND j.state <> 'COMPLETE' AND j.scope IN ('MEMORY', 'RETENTION')"
)


def hidden_now(store: MemoryStore, tenant_id: str) -> Hidden:
    """What analytics reads of `tenant_id` must leave out at this moment; refuses a tenant that is
    unknown, deleted or behind a restore's gate, as every read does.

    One transaction under the tenant's gate lock (shared): no deletion is accepted while it reads,
    so the tenant check and the hidden set are one consistent answer."""
    with store.transaction() as conn:
        ordering.lock_tenant_shared(conn, tenant_id)
        store.require_tenant(tenant_id=tenant_id)  # joins this transaction
        rows = conn.execute(_HIDDEN_NOW, {"t": tenant_id}).fetchall()
        subjects = sorted({str(i) for kind, i, _ in rows if kind == "subject"})
        pseudonyms: frozenset[str] = frozenset()
        if subjects:
            try:
                key = store.keys.tenant_subkey(conn, tenant_id, "analytics-pseudonym", create=False)
            except NotFoundError:
                return Hidden(everything=True)
            pseudonyms = frozenset(_pseudonym(key, user_id) for user_id in subjects)
    return Hidden(
        pseudonyms=pseudonyms,
        memories=frozenset(str(i) for kind, i, _ in rows if kind == "memory"),
        records=frozenset(f"{i}:{v}" for kind, i, v in rows if kind == "version"),
    )


@dataclass(frozen=True)
class QueryLimits:
    """What one analytics query may take of the machine: DuckDB's memory and threads, and wall time."""

    memory_mb: int = DEFAULT_ANALYTICS_MEMORY_MB
    threads: int = DEFAULT_ANALYTICS_THREADS
    timeout_seconds: float = DEFAULT_ANALYTICS_TIMEOUT

    @classmethod
    def of(cls, settings: Settings) -> QueryLimits:
        return cls(settings.analytics_memory_mb, settings.analytics_threads, settings.analytics_timeout_seconds)


class AnalyticsStore:
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

    @contextmanager
    def writer_lock(self) -> Iterator[None]:
        """The single-writer lock of this analytics root, across threads and processes.

        Each holder opens the lock file itself, and flock locks of separate open files exclude
        each other within one process too. Always taken last (after any PostgreSQL lock)."""
        private_dir(self.root)
        with open(self.root / LOCK_FILE, "a+") as fh:
            private_file(self.root / LOCK_FILE)
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def partition_dir(self, tenant_id: str) -> Path:
        return self.data_dir / f"{TENANT_KEY}={tenant_hash(tenant_id)}"

    def partition_file(self, tenant_id: str) -> Path:
        """The tenant's partition: a directory of bucket files since the buckets (the name stays
        for its callers, which show it or check that it exists)."""
        return self.partition_dir(tenant_id)

    def bucket_file(self, tenant_id: str, bucket: int) -> Path:
        return self.partition_dir(tenant_id) / f"bucket={bucket:02d}" / BUCKET_FILE

    def bucket_files(self, tenant_id: str) -> dict[int, Path]:
        """bucket -> its file, for the buckets the tenant has now."""
        found: dict[int, Path] = {}
        for path in self.partition_dir(tenant_id).glob(f"bucket=*/{BUCKET_FILE}"):
            number = path.parent.name.removeprefix("bucket=")
            if number.isdigit() and int(number) < BUCKETS:
                found[int(number)] = path
        return dict(sorted(found.items()))

    def _old_partition_dir(self, tenant_id: str) -> Path:
        """Where an install from before the hashed names kept the tenant (read and converted only)."""
        return self.old_data_dir / f"{OLD_TENANT_KEY}={tenant_id}"

    def tenant_files(self, tenant_id: str) -> list[Path]:
        """Every file that may hold the tenant's rows, whatever it is: its directory's, and those of
        an old directory not converted yet or left renamed aside by a crash mid-conversion (the
        physical erasure byte-scans them all)."""
        directories = (
            self.partition_dir(tenant_id),
            self._old_partition_dir(tenant_id),
            self.root / RETIRED_DIR / tenant_hash(tenant_id),
        )
        return sorted(f for d in directories if d.is_dir() for f in d.rglob("*") if f.is_file())

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
            for bucket, path in self.bucket_files(tenant_id).items():
                if wanted is not None and bucket not in wanted:
                    continue
                try:
                    fh = open(path, "rb")
                except FileNotFoundError:
                    continue
                with fh:
                    parquet = pq.ParquetFile(fh)
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

    def _replace_partition_locked(self, tenant_id: str, table: pa.Table) -> Rewrite:
        """Under writer_lock: the tenant's partition becomes `table`, one file per bucket of its rows.
        Buckets it no longer needs are emptied (then reaped), stale temporary files removed."""
        report = Rewrite(rows=table.num_rows)
        # Every row under the tenant's directory names that tenant: reads keep no other.
        table = _with_tenant(table, tenant_id)
        directory = self.partition_dir(tenant_id)
        private_dir(directory)
        # Any temporary file seen under the writer lock was left by a writer that died.
        for stale in directory.glob("**/*.tmp"):
            stale.unlink(missing_ok=True)
        buckets = _buckets(table["user_pseudonym"])
        tables = {b: table.filter(pc.equal(buckets, b)) for b in sorted(pc.unique(buckets).to_pylist())}
        unneeded = [b for b in self.bucket_files(tenant_id) if b not in tables]
        for bucket in unneeded:
            if _rows_in(self.bucket_file(tenant_id, bucket)):
                tables[bucket] = SCHEMA.empty_table()
        self._install_locked(tenant_id, tables, report)
        self._reap_locked(tenant_id, unneeded, report)
        return report

    def _install_locked(self, tenant_id: str, tables: dict[int, pa.Table], report: Rewrite) -> None:
        # Under writer_lock. Every file written aside first, then all renamed in one short pass:
        # each rename replaces a bucket whole, and the renames of a rebuild follow one another.
        staged: list[tuple[Path, Path]] = []
        try:
            for bucket, table in sorted(tables.items()):
                target = self.bucket_file(tenant_id, bucket)
                private_dir(target.parent)
                tmp = target.with_name(f"{BUCKET_FILE}.{os.getpid()}-{threading.get_ident()}.tmp")
                pq.write_table(table, tmp)
                private_file(tmp)
                staged.append((tmp, target))
                report.bytes_written += tmp.stat().st_size
            for tmp, target in staged:
                os.replace(tmp, target)
                report.files_rewritten.append(str(target.relative_to(self.root)))
        finally:
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)

    def _reap_locked(self, tenant_id: str, buckets: Iterable[int], report: Rewrite) -> None:
        # Under writer_lock. Only files that have held no rows for the grace period: a view
        # query lists the files before it opens them.
        now = clock.time()
        for bucket in buckets:
            path = self.bucket_file(tenant_id, bucket)
            try:
                if now - path.stat().st_mtime < self.empty_bucket_grace or _rows_in(path):
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            report.files_deleted.append(str(path.relative_to(self.root)))
            try:
                path.parent.rmdir()
            except OSError:
                pass  # not empty: left as it is

    def _upgrade_locked(self) -> None:
        """Under writer_lock: convert every tenant still under its raw id (see the module
        docstring). A no-op, two stats, once they are all converted."""
        retired = self.root / RETIRED_DIR
        if retired.exists():
            shutil.rmtree(retired)  # what a conversion that died left renamed aside: converted already
        if not self.old_data_dir.is_dir():
            return
        old = sorted(d for d in self.old_data_dir.glob(f"{OLD_TENANT_KEY}=*") if d.is_dir())
        if not old:
            with suppress(OSError):
                self.old_data_dir.rmdir()  # gone once empty; anything else left in it is not ours
            return
        for directory in old:
            tenant_id = directory.name.removeprefix(f"{OLD_TENANT_KEY}=")
            table = self._read_old(directory, tenant_id)
            # Nothing else writes old directories: one that vanished meanwhile held no rows.
            self._replace_partition_locked(tenant_id, SCHEMA.empty_table() if table is None else table)
        self._write_view(self._has_data())
        private_dir(retired)
        for directory in old:
            # One rename takes the whole old copy away at once (a reader mid-read loses a file and
            # turns to the new copy), then its files go: unlinked, as every removal here does.
            aside = retired / tenant_hash(directory.name.removeprefix(f"{OLD_TENANT_KEY}="))
            os.replace(directory, aside)
            shutil.rmtree(aside)
        retired.rmdir()
        with suppress(OSError):
            self.old_data_dir.rmdir()  # gone once empty; anything else left in it is not ours

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

    def _has_data(self) -> bool:
        return any(self.data_dir.glob(f"{TENANT_KEY}=*/bucket=*/*.parquet"))

    def _view_pattern(self) -> str:
        return str(self.data_dir / f"{TENANT_KEY}=*" / "bucket=*" / "*.parquet")

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

    def connect(self) -> duckdb.DuckDBPyConnection:
        """A read-only DuckDB connection to the views (readers never open the file read-write)."""
        return duckdb.connect(str(self.database), read_only=True)

    def _view_is(self, has_data: bool) -> bool:
        """Whether the database holds the view wanted: over our glob when there is data, none otherwise."""
        try:
            with self.connect() as con:
                row = con.execute("SELECT sql FROM duckdb_views() WHERE view_name = 'memories'").fetchone()
        except duckdb.Error:
            return False  # unreadable, or someone else holds it read-write: written afresh
        if not has_data:
            return row is None
        return row is not None and _literal(self._view_pattern()) in str(row[0])

    def _write_view(self, has_data: bool) -> None:
        # Under writer_lock. A fresh file renamed over the old one: an open reader keeps the old.
        tmp = self.database.with_name(f"{self.database.name}.{os.getpid()}-{threading.get_ident()}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            with duckdb.connect(str(tmp)) as con:
                if has_data:
                    # DDL takes no bound parameters; the path is ours (under HOME, no tenant id in it),
                    # quoted as a literal. `tenant_id` comes from the files, last as it always was;
                    # the path's hash is left out. Types given: left to guess, a hash of digits
                    # only would read as a number.
                    con.execute(
                        f"CREATE VIEW memories AS SELECT * EXCLUDE ({TENANT_KEY}, tenant_id), tenant_id"  # noqa: S608
                        " FROM read_parquet("
                        + _literal(self._view_pattern())
                        + ", hive_partitioning = true"
                        + f", hive_types = {{'{TENANT_KEY}': 'VARCHAR', 'bucket': 'INTEGER'}})"
                    )
            private_file(tmp)
            os.replace(tmp, self.database)
        finally:
            tmp.unlink(missing_ok=True)
            Path(str(tmp) + ".wal").unlink(missing_ok=True)

    def query(
        self, sql: str, *, tenant_id: str, max_rows: int = MAX_QUERY_ROWS, store: MemoryStore | None = None
    ) -> dict[str, Any]:
        """Run one SELECT over one tenant's rows, exposed as the table `memories`.

        The user's SQL never sees a file: the tenant's partition is read here (pyarrow) and
        registered on a fresh in-memory DuckDB whose file system, extensions and configuration
        are then locked, so `COPY`, `read_text`, `read_blob`, `ATTACH` or `SET` cannot reach
        anything, and other tenants' rows are not there to be read. With a memory store (`store`,
        or the one this analytics store was made with), rows an accepted deletion hides are left
        out before the SQL runs, and a deleted or restoring tenant is refused, as by every read.
        At most `max_rows` rows are returned, with `truncated` saying whether there were more.
        """
        validation.check_id("tenant", tenant_id)
        statement = parse_select(sql)
        store = store or self.store
        # Checked before the files are read: a deletion that completes in between took its rows out
        # of the files before COMPLETE, and one accepted after the check is ordered after this read.
        hidden = hidden_now(store, tenant_id) if store is not None else Hidden()
        table = self.read_partition(tenant_id)
        if table is None:
            raise NotFoundError(
                "tenant", f"no analytics data for tenant {tenant_id!r}: unknown, or analytics_memories not materialized"
            )
        if hidden:
            table = hidden.keep(table)
        # The bucket is in the path, not the file; added back where the view has it, before
        # `tenant_id` (in the file, and read_partition kept only this tenant's rows).
        table = table.add_column(table.schema.get_field_index("tenant_id"), "bucket", _buckets(table["user_pseudonym"]))
        limits = self.limits
        answer = sql_sandbox.run(
            table,
            statement.query,
            memory_mb=limits.memory_mb,
            threads=limits.threads,
            timeout_seconds=limits.timeout_seconds,
            max_rows=max_rows,
        )
        return {"columns": answer.columns, "rows": answer.rows, "truncated": answer.truncated}

    def read_partition(
        self, tenant_id: str, *, buckets: set[int] | None = None, columns: list[str] | None = None
    ) -> pa.Table | None:
        """The tenant's rows (every bucket's, in bucket order, or those of `buckets`; all columns or
        `columns`), or None when it has no partition.

        Only rows whose `tenant_id` column is `tenant_id`: the directory is found by the tenant's
        hash, and the rows must name the tenant too. No writer lock: each file is opened once and
        read through that handle (pyarrow given a path may open it again, and would then read a
        file renamed over it meanwhile with the old one's footer); a bucket file gone between the
        listing and the open held no rows. An old directory not yet converted is read instead
        while it is there (see the module docstring).
        """
        old = self._old_partition_dir(tenant_id)
        if old.is_dir():
            table = self._read_old(old, tenant_id, buckets=buckets, columns=columns)
            if table is not None:
                return table
        if not self.partition_dir(tenant_id).is_dir():
            return None
        wanted = None if columns is None else [*columns, *(["tenant_id"] if "tenant_id" not in columns else [])]
        empty = SCHEMA.empty_table()
        tables = [empty.select(wanted) if wanted else empty]
        for bucket, path in self.bucket_files(tenant_id).items():
            if buckets is not None and bucket not in buckets:
                continue
            try:
                fh = open(path, "rb")
            except FileNotFoundError:
                continue
            with fh:
                tables.append(pq.ParquetFile(fh).read(columns=wanted))
        table = pa.concat_tables(tables)
        table = table.filter(pc.equal(table["tenant_id"], tenant_id))  # a null is no match: dropped
        return table.select(columns) if columns is not None else table

    def _read_old(
        self, directory: Path, tenant_id: str, *, buckets: set[int] | None = None, columns: list[str] | None = None
    ) -> pa.Table | None:
        """The rows of an old directory (its one file while there, else its buckets), each given the
        `tenant_id` its directory names; None once it is gone, or when it loses a file between the
        listing and the open: only its conversion takes files from it, and that renames the whole
        directory away after the new copy is complete, so the caller reads the new copy instead."""
        wanted = None if columns is None else [c for c in columns if c != "tenant_id"]

        def finish(table: pa.Table) -> pa.Table:
            table = _with_tenant(table, tenant_id)
            return table.select(columns) if columns is not None else table

        try:
            fh = open(directory / LEGACY_FILE, "rb")
        except (FileNotFoundError, NotADirectoryError):
            pass
        else:
            with fh:
                return finish(pq.ParquetFile(fh).read(columns=wanted))
        found: dict[int, Path] = {}
        try:
            for path in directory.glob(f"bucket=*/{BUCKET_FILE}"):
                number = path.parent.name.removeprefix("bucket=")
                if number.isdigit() and int(number) < BUCKETS:
                    found[int(number)] = path
        except FileNotFoundError:
            return None  # renamed away as the listing began
        if not found and not directory.is_dir():
            return None  # renamed away before the listing
        old_schema = pa.schema([f for f in SCHEMA if f.name != "tenant_id"])
        empty = old_schema.empty_table()
        tables = [empty.select(wanted) if wanted is not None else empty]
        for bucket, path in sorted(found.items()):
            if buckets is not None and bucket not in buckets:
                continue
            try:
                fh = open(path, "rb")
            except FileNotFoundError:
                return None
            with fh:
                table = pq.ParquetFile(fh).read(columns=wanted)
            tables.append(table.drop_columns([c for c in table.column_names if c == "tenant_id"]))
        return finish(pa.concat_tables(tables))

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


def _with_tenant(table: pa.Table, tenant_id: str) -> pa.Table:
    """`table` with its `tenant_id` column set to `tenant_id` throughout (added when missing)."""
    column = pa.array([tenant_id] * table.num_rows, pa.string())
    if "tenant_id" in table.column_names:
        return table.set_column(table.column_names.index("tenant_id"), SCHEMA.field("tenant_id"), column)
    return table.append_column(SCHEMA.field("tenant_id"), column)


def _rows_in(path: Path) -> int:
    """Rows of a bucket file; an unreadable one counts as holding rows, so a rebuild replaces it."""
    try:
        with open(path, "rb") as fh:
            return int(pq.ParquetFile(fh).metadata.num_rows)
    except FileNotFoundError:
        raise
    except (OSError, pa.ArrowException):
        return 1


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def parse_select(sql: object) -> duckdb.Statement:
    """The single SELECT statement of `sql`, as DuckDB itself parses it (not a regex of ours);
    ValidationError('sql') for anything else. Cheap: callers may check before starting services."""
    text = validation.check_text("sql", sql)
    try:
        statements = duckdb.extract_statements(text)
    except duckdb.Error as exc:
        raise ValidationError("sql", f"does not parse: {_one_line(str(exc))}") from exc
    if len(statements) != 1:
        raise ValidationError("sql", f"must be exactly one SELECT statement, got {len(statements)} statements")
    kind = statements[0].type.name
    if kind not in _READ_ONLY_STATEMENTS:
        raise ValidationError("sql", f"must be a SELECT statement, got {kind}")
    return statements[0]


def _one_line(message: str) -> str:
    return " ".join(message.split())
