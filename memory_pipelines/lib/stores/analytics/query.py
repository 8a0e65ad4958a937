"""The user's SQL over one tenant's analytics rows: one SELECT, parsed by DuckDB itself, run on an
in-memory DuckDB holding that tenant's rows only, within the limits of QueryLimits."""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import pyarrow as pa

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.lib.infra.settings import (
    DEFAULT_ANALYTICS_MEMORY_MB,
    DEFAULT_ANALYTICS_THREADS,
    DEFAULT_ANALYTICS_TIMEOUT,
    Settings,
)
from memory_pipelines.lib.results import AnalyticsAnswer
from memory_pipelines.lib.stores.analytics import sandbox as sql_sandbox
from memory_pipelines.lib.stores.analytics.rows import buckets_of

__all__ = [
    "MAX_QUERY_ROWS",
    "QueryLimits",
    "parse_select",
    "run_query",
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


def run_query(table: pa.Table, statement: duckdb.Statement, *, limits: QueryLimits, max_rows: int) -> AnalyticsAnswer:
    """Run `statement` (parsed by parse_select) over `table`, one tenant's rows, in the sandbox's child.

    The `bucket` column users' SQL has always had is added back before `tenant_id`."""
    table = table.add_column(table.schema.get_field_index("tenant_id"), "bucket", buckets_of(table["user_pseudonym"]))
    answer = sql_sandbox.run(
        table,
        statement.query,
        memory_mb=limits.memory_mb,
        threads=limits.threads,
        timeout_seconds=limits.timeout_seconds,
        max_rows=max_rows,
    )
    return {"columns": answer.columns, "rows": answer.rows, "truncated": answer.truncated}


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
