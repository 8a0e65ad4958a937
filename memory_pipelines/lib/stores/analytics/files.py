"""The analytics files of each tenant: their schema, their layout in buckets, and how they are replaced.

`root/tenants/tenant=H/bucket=NN/part.parquet` (H the tenant's hash; the bucket the first byte of
the author's pseudonym modulo BUCKETS). Every write happens under the writer lock of the root, and
replaces bucket files whole: written aside, then renamed over the old ones in one short pass. A
bucket left without rows is emptied, and its file unlinked once it has stayed empty for the grace
period. The module docstring of store.py says why.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time as clock
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memory_pipelines.lib.infra.owner_only import private_dir, private_file
from memory_pipelines.lib.infra.paths import tenant_hash
from memory_pipelines.lib.memories import crypto

__all__ = [
    "BUCKETS",
    "BUCKET_FILE",
    "DATA_DIR",
    "EMPTY_BUCKET_GRACE_SECONDS",
    "LEGACY_FILE",
    "LOCK_FILE",
    "OLD_DATA_DIR",
    "OLD_TENANT_KEY",
    "RETIRED_DIR",
    "SCHEMA",
    "TENANT_KEY",
    "PartitionFiles",
    "Rewrite",
    "bucket_of",
]

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
LOCK_FILE = ".analytics.lock"
_HEX_BYTES = pa.array([f"{i:02x}" for i in range(256)])


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


@dataclass
class Rewrite:
    """What one write did to a tenant's files: what callers (and benchmarks) can check."""

    rows: int = 0
    files_rewritten: list[str] = field(default_factory=list)  # relative to the analytics root
    files_deleted: list[str] = field(default_factory=list)
    bytes_written: int = 0


class PartitionFiles:
    """Where each tenant's files are under `root`, the writer lock, and the replacement of bucket files."""

    root: Path
    data_dir: Path
    old_data_dir: Path
    database: Path
    empty_bucket_grace: float

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

    def open_buckets(
        self, tenant_id: str, buckets: Iterable[int] | None = None
    ) -> Iterator[tuple[int, pq.ParquetFile]]:
        """Each of the tenant's bucket files (of `buckets` only, when given), open while the caller reads
        it; a file a concurrent rewrite removed since the listing is skipped (it held no rows)."""
        chosen = None if buckets is None else set(buckets)
        for bucket, path in self.bucket_files(tenant_id).items():
            if chosen is not None and bucket not in chosen:
                continue
            try:
                fh = open(path, "rb")
            except FileNotFoundError:
                continue
            with fh:
                yield bucket, pq.ParquetFile(fh)

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
