"""Analytics copy: Parquet hive-partitioned by tenant, read through DuckDB views.

No memory text (only its length), user and team ids pseudonymised with an HMAC under the tenant
key, do-not-sell memories excluded. A tenant's partition is rewritten whole, atomically.

One writer at a time across processes: every write of a Parquet file and every change of the
DuckDB file happens under an fcntl lock on `root/.analytics.lock` (held for a file write, never
for a query). The DuckDB file is never opened read-write in place: a new one is written aside and
renamed over it, so a reader (read_only=True, here or in a notebook) never meets DuckDB's own
file lock, and a writer never fails because a reader holds the file open.
"""

from __future__ import annotations

import fcntl
import math
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import date, datetime, time
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from memory_pipelines.lib import crypto, lineage, ordering, validation
from memory_pipelines.lib.errors import NotFoundError, ValidationError
from memory_pipelines.lib.store import CurrentVersion, MemoryStore

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
    ]
)
# Only a plain SELECT (FROM-first, WITH, VALUES, DESCRIBE and SUMMARIZE parse as one too). Never
# EXPLAIN: `EXPLAIN ANALYZE` executes its statement, `COPY ... TO` included.
_READ_ONLY_STATEMENTS = {"SELECT"}
MAX_QUERY_ROWS = 10_000
LOCK_FILE = ".analytics.lock"


def _lock_partition(conn: psycopg.Connection, tenant_id: str) -> None:
    """One writer of a tenant's partition at a time, across processes, so its file and its lineage
    always come from the same rebuild or removal."""
    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 3))", ("analytics\x1f" + tenant_id,))


class AnalyticsStore:
    """Parquet files under `root/memories/tenant_id=T/` and a DuckDB database with views over them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data_dir = root / "memories"
        self.database = root / "analytics.duckdb"

    @contextmanager
    def writer_lock(self) -> Iterator[None]:
        """The single-writer lock of this analytics root, across threads and processes.

        Each holder opens the lock file itself, and flock locks of separate open files exclude
        each other within one process too. Always taken last (after any PostgreSQL lock)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK_FILE, "a+") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def partition_file(self, tenant_id: str) -> Path:
        return self.data_dir / f"tenant_id={tenant_id}" / "memories.parquet"

    def rebuild(self, *, store: MemoryStore, tenant_id: str) -> dict[str, int]:
        """Rewrite the tenant's partition from the current versions (do-not-sell rows left out)."""
        current = store.current_versions(tenant_id=tenant_id)
        kept = [cv for cv in current if not cv.do_not_sell]
        texts = store.open_texts(tenant_id=tenant_id, sources=[cv.source for cv in kept], skip_unreadable=True)
        kept = [cv for cv in kept if cv.source in texts]
        if not kept and not current:
            return self._commit(store, tenant_id, [], pa.Table.from_pylist([], schema=SCHEMA), 0)
        with store.transaction() as conn:
            key = store.keys.tenant_subkey(conn, tenant_id, "analytics-pseudonym", create=False)

        def pseudonym(value: str | None) -> str | None:
            return None if value is None else crypto.mac(key, value.encode()).hex()[:32]

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
                self._write(tenant_id, table)
            conn.execute("DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s", (tenant_id, STORE))
            lineage.insert_edges(
                conn, tenant_id=tenant_id, store=STORE, records=[(cv.record_id, cv.source) for cv in kept]
            )
        self.refresh_views()
        return {"rows": len(kept), "excluded_do_not_sell": do_not_sell}

    def remove(self, *, store: MemoryStore, tenant_id: str, sources: set[tuple[str, int]]) -> int:
        """Rewrite the tenant's partition without the rows of `sources`; returns rows removed.

        Used by forgetting when no other version becomes current (SUBJECT scope): filtering the
        file is proportional to its bytes, while a rebuild decrypts every text again.
        """
        if not sources:
            return 0
        with store.transaction() as conn:
            _lock_partition(conn, tenant_id)
            table = self.read_partition(tenant_id)
            if table is None:
                return 0
            gone = pa.array(sorted(f"{m}:{v}" for m, v in sources))
            record_ids = pc.binary_join_element_wise(table["memory_id"], pc.cast(table["version"], pa.string()), ":")
            drop = pc.is_in(record_ids, value_set=gone)
            removed = pc.sum(drop).as_py() or 0
            if removed:
                with self.writer_lock():
                    self._write(tenant_id, table.filter(pc.invert(drop)))
            lineage.remove_records(
                conn, tenant_id=tenant_id, store=STORE, record_ids=[f"{m}:{v}" for m, v in sorted(sources)]
            )
        return int(removed)

    def _write(self, tenant_id: str, table: pa.Table) -> None:
        # Under writer_lock. Written aside and renamed: readers see the old partition or the new
        # one, never half of one.
        target = self.partition_file(tenant_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".parquet.{os.getpid()}-{threading.get_ident()}.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, target)

    def drop(self, *, store: MemoryStore, tenant_id: str) -> int:
        """Remove the tenant's partition and its lineage (tenant offboarding); returns rows removed."""
        table = self.read_partition(tenant_id)
        path = self.partition_file(tenant_id)
        with self.writer_lock():
            if path.exists():
                path.unlink()
                path.parent.rmdir()
        with store.transaction() as conn:
            conn.execute("DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s", (tenant_id, STORE))
        self.refresh_views()
        return 0 if table is None else table.num_rows

    def refresh_views(self) -> None:
        """Create the `memories` view over every tenant's partition (or drop it when there is none).

        The view is a glob, so it stays right as partitions come and go: the file changes only
        when the view must appear or go, under the writer lock, by replacing the file whole.
        """
        with self.writer_lock():
            has_data = any(self.data_dir.glob("*/*.parquet"))
            if self.database.exists() and self._has_view() == has_data:
                return
            self._write_view(has_data)

    def connect(self) -> duckdb.DuckDBPyConnection:
        """A read-only DuckDB connection to the views (readers never open the file read-write)."""
        return duckdb.connect(str(self.database), read_only=True)

    def _has_view(self) -> bool | None:
        try:
            with self.connect() as con:
                row = con.execute("SELECT count(*) FROM duckdb_views() WHERE view_name = 'memories'").fetchone()
        except duckdb.Error:
            return None  # unreadable, or someone else holds it read-write: written afresh
        return bool(row and row[0])

    def _write_view(self, has_data: bool) -> None:
        # Under writer_lock. A fresh file renamed over the old one: an open reader keeps the old.
        tmp = self.database.with_name(f"{self.database.name}.{os.getpid()}-{threading.get_ident()}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            with duckdb.connect(str(tmp)) as con:
                if has_data:
                    pattern = str(self.data_dir / "*" / "*.parquet")
                    # DDL takes no bound parameters; the path is ours (under HOME), quoted as a literal.
                    literal = "'" + pattern.replace("'", "''") + "'"
                    con.execute(
                        "CREATE VIEW memories AS SELECT * FROM read_parquet("  # noqa: S608
                        + literal
                        + ", hive_partitioning = true)"
                    )
            os.replace(tmp, self.database)
        finally:
            tmp.unlink(missing_ok=True)
            Path(str(tmp) + ".wal").unlink(missing_ok=True)

    def query(self, sql: str, *, tenant_id: str, max_rows: int = MAX_QUERY_ROWS) -> dict[str, Any]:
        """Run one SELECT over one tenant's rows, exposed as the table `memories`.

        The user's SQL never sees a file: the tenant's partition is read here (pyarrow) and
        registered on a fresh in-memory DuckDB whose file system, extensions and configuration
        are then locked, so `COPY`, `read_text`, `read_blob`, `ATTACH` or `SET` cannot reach
        anything, and other tenants' rows are not there to be read. At most `max_rows` rows are
        returned, with `truncated` saying whether there were more.
        """
        validation.check_id("tenant", tenant_id)
        statement = parse_select(sql)
        table = self.read_partition(tenant_id)
        if table is None:
            raise NotFoundError(
                "tenant", f"no analytics data for tenant {tenant_id!r}: unknown, or analytics_memories not materialized"
            )
        # The hive partition column is in the path, not the file; added back so queries can name it.
        table = table.append_column("tenant_id", pa.array([tenant_id] * table.num_rows, pa.string()))
        try:
            with _sandbox(table) as con:
                cursor = con.execute(statement)
                columns = [d[0] for d in cursor.description or []]
                fetched = cursor.fetchmany(max_rows + 1)
        except duckdb.Error as exc:
            raise ValidationError("sql", f"{type(exc).__name__}: {_one_line(str(exc))}") from exc
        return {
            "columns": columns,
            "rows": [[_json_value(v) for v in row] for row in fetched[:max_rows]],
            "truncated": len(fetched) > max_rows,
        }

    def read_partition(self, tenant_id: str) -> pa.Table | None:
        """The tenant's rows, or None when it has no partition. No writer lock: the file is opened
        once and read through that handle (pyarrow given a path may open it again, and would then
        read a partition renamed over it meanwhile with the old one's footer)."""
        try:
            fh = open(self.partition_file(tenant_id), "rb")
        except FileNotFoundError:
            return None
        with fh:
            return pq.ParquetFile(fh).read()

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


@contextmanager
def _sandbox(table: pa.Table) -> Iterator[duckdb.DuckDBPyConnection]:
    """A fresh in-memory DuckDB holding only `table` as `memories`, locked before any user SQL runs."""
    config: dict[str, str | bool | int | float | list[str]] = {
        # Python replacement scans would let SQL name any variable of the calling frames.
        "python_enable_replacements": False,
        "autoinstall_known_extensions": False,
        "autoload_known_extensions": False,
        "allow_community_extensions": False,
        # No spill files: an in-memory database would otherwise write `.tmp/` in the working directory.
        "temp_directory": "",
    }
    with duckdb.connect(":memory:", config=config) as con:
        con.register("memories", table)
        # Our own data is in; from here on nothing, the user's SQL included, can reach a file or
        # turn a setting back (SET and RESET fail once the configuration is locked).
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
        yield con


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _json_value(value: Any) -> Any:
    """DuckDB's Python values as JSON: timestamps ISO 8601, decimals as numbers, bytes as hex."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Decimal):
        return float(value) if value.is_finite() else str(value)
    if isinstance(value, (datetime, date, time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return str(value)  # UUID, timedelta, ...
