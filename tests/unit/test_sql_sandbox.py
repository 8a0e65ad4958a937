"""An analytics query runs in a process of its own whose memory and time the query cannot lift."""

from __future__ import annotations

import pyarrow as pa
import pytest

from memory_pipelines.lib.infra.errors import ServiceError, ValidationError
from memory_pipelines.lib.stores.analytics import sandbox as sql_sandbox

TABLE = pa.table({"n": list(range(1_000)), "text": [f"row {i}" for i in range(1_000)]})


def run(sql: str, **limits: float) -> sql_sandbox.Answer:
    settings = {"memory_mb": 256, "threads": 1, "timeout_seconds": 5.0, "max_rows": 3, **limits}
    return sql_sandbox.run(TABLE, sql, **settings)  # type: ignore[arg-type]


def test_a_query_answers_with_columns_rows_and_truncation():
    answer = run("SELECT count(*) AS n, sum(n) AS total FROM memories")
    assert answer.columns == ["n", "total"] and answer.rows == [[1000, 499500]] and not answer.truncated
    assert run("SELECT text FROM memories ORDER BY n").rows == [["row 0"], ["row 1"], ["row 2"]]
    assert run("SELECT text FROM memories").truncated


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT length(repeat('x', 2000000000))",  # a scalar outside DuckDB's memory_limit
        "SELECT list(range) FROM range(300000000)",
    ],
)
def test_memory_beyond_the_limit_ends_the_query_with_a_clear_error(sql):
    with pytest.raises(ServiceError) as stopped:
        run(sql)
    assert stopped.value.field == "sql" and "more than 256 MB" in stopped.value.message


def test_time_beyond_the_limit_ends_the_query():
    with pytest.raises(ServiceError) as stopped:
        run("SELECT count(*) FROM range(1000000000000)", timeout_seconds=1.0)
    assert stopped.value.field == "sql" and "stopped after 1 s" in stopped.value.message


def test_sql_errors_and_a_second_statement_are_refused_by_name():
    with pytest.raises(ValidationError) as missing:
        run("SELECT * FROM elsewhere")
    assert missing.value.field == "sql" and "elsewhere" in missing.value.message
    with pytest.raises(ValidationError, match="exactly one"):
        run("SELECT 1; SELECT 2")


def test_the_query_reaches_no_file():
    with pytest.raises(ValidationError):
        run("SELECT * FROM read_text('/etc/passwd')")
