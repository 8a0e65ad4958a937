"""Reading a tenant's analytics rows: straight from its bucket files, or through the user's SQL.

`read_partition` reads the files (no writer lock: each file opened once and read through that
handle). `query` runs one SELECT, parsed by DuckDB itself, on an in-memory DuckDB holding that one
tenant's rows only, without the rows accepted deletions hide, within the limits of QueryLimits.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import NotFoundError, ValidationError
from memory_pipelines.lib.infra.settings import (
    DEFAULT_ANALYTICS_MEMORY_MB,
    DEFAULT_ANALYTICS_THREADS,
    DEFAULT_ANALYTICS_TIMEOUT,
    Settings,
)
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import AnalyticsAnswer
from memory_pipelines.lib.stores.analytics import sandbox as sql_sandbox
from memory_pipelines.lib.stores.analytics.files import SCHEMA, _buckets
from memory_pipelines.lib.stores.analytics.hidden import Hidden, hidden_now
from memory_pipelines.lib.stores.analytics.legacy import LegacyLayout

__all__ = [
    "MAX_QUERY_ROWS",
    "AnalyticsReads",
    "QueryLimits",
    "parse_select",
]

# Only a plain SELECT (FROM-first, WITH, VALUES, DESCRIBE and SUMMARIZE parse as one too). Never
# EXPLAIN: `EXPLAIN ANALYZE` executes its statement, `COPY ... TO` included.
_READ_ONLY_STATEMENTS = {"SELECT"}
MAX_QUERY_ROWS = 10_000


@dataclass(frozen=True)
class QueryLimits:
    """What one analytics query may take of the machine: DuckDB's memory and threads, and wall time."""

    memory_mb: int = DEFAULT_ANALYTICS_MEMORY_MB
    threads: int = DEFAULT_ANALYTICS_THREADS
    timeout_seconds: float = DEFAULT_ANALYTICS_TIMEOUT

    @classmethod
    def of(cls, settings: Settings) -> QueryLimits:
        return cls(settings.analytics_memory_mb, settings.analytics_threads, settings.analytics_timeout_seconds)


class AnalyticsReads(LegacyLayout):
    """Reads of a tenant's rows: `read_partition`, and `query` for the user's SQL."""

    limits: QueryLimits
    store: MemoryStore | None

    def query(
        self, sql: str, *, tenant_id: str, max_rows: int = MAX_QUERY_ROWS, store: MemoryStore | None = None
    ) -> AnalyticsAnswer:
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
        while it is there (see the module docstring of store.py).
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
        for _, parquet in self.open_buckets(tenant_id, buckets):
            tables.append(parquet.read(columns=wanted))
        table = pa.concat_tables(tables)
        table = table.filter(pc.equal(table["tenant_id"], tenant_id))  # a null is no match: dropped
        return table.select(columns) if columns is not None else table


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
