"""Issue 11, security: the analytics SQL sandbox, the master key file's mode, sweep days.

No PostgreSQL needed: the user's SQL runs over a table made here with pyarrow, as the store reads a
tenant's rows (`run_query`, the part of `AnalyticsStore.query` after the read). That a query sees one
tenant only, and what an unknown tenant gets, is tested on PostgreSQL in test_analytics_rows.py.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memory_pipelines.lib.infra.errors import ServiceError, ValidationError
from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.results import AnalyticsAnswer
from memory_pipelines.lib.retention import rules as retention
from memory_pipelines.lib.stores.analytics.query import MAX_QUERY_ROWS, QueryLimits, parse_select, run_query
from memory_pipelines.lib.stores.analytics.rows import SCHEMA


def _rows(n: int, prefix: str, tenant: str) -> pa.Table:
    now = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    return pa.Table.from_pylist(
        [
            {
                "memory_id": f"m_{prefix}{i:030d}",
                "version": 1,
                "user_pseudonym": "u" * 32,
                "team_pseudonym": None,
                "memory_type": "personal",
                "category": "general",
                "shareable": False,
                "confidence": 0.5,
                "text_length": 10 + i,
                "created_at": now,
                "updated_at": now,
                "version_created_at": now,
                "tenant_id": tenant,
            }
            for i in range(n)
        ],
        schema=SCHEMA,
    )


class OneTenant:
    """What a query of tenant `acme` runs on: its three rows, handed to the sandbox as the store does."""

    def __init__(self) -> None:
        self.table = _rows(3, "a", "acme")

    def query(self, sql: str, *, tenant_id: str, max_rows: int = MAX_QUERY_ROWS) -> AnalyticsAnswer:
        assert tenant_id == "acme"
        return run_query(self.table, parse_select(sql), limits=QueryLimits(), max_rows=max_rows)


@pytest.fixture
def analytics(tmp_path: Path) -> OneTenant:
    # Another tenant's rows in a Parquet file beside it, as an earlier version kept them: out of reach.
    (tmp_path / "analytics").mkdir()
    pq.write_table(_rows(5, "b", "globex"), tmp_path / "analytics" / "globex.parquet")
    return OneTenant()


def test_explain_analyze_copy_cannot_write_a_file(analytics, tmp_path):
    target = tmp_path / "pwned.txt"
    for sql in (
        f"EXPLAIN ANALYZE COPY (SELECT 'x') TO '{target}' (HEADER false)",
        f"COPY (SELECT 'x') TO '{target}'",
        f"SELECT * FROM query('COPY (SELECT 1) TO ''{target}''')",
    ):
        with pytest.raises(ValidationError) as err:
            analytics.query(sql, tenant_id="acme")
        assert err.value.field == "sql"
    assert not target.exists()


def test_no_file_is_readable_from_sql(analytics, tmp_path):
    key = tmp_path / "keys" / "master.key"
    crypto.LocalMasterKey(key)
    other = tmp_path / "analytics" / "globex.parquet"
    for sql in (
        "SELECT * FROM read_text('/etc/hostname')",
        f"SELECT * FROM read_blob('{key}')",
        "SELECT * FROM read_csv('/proc/self/environ')",
        "SELECT * FROM read_json_auto('/etc/hostname')",
        f"SELECT * FROM read_parquet('{other}')",
        f"SELECT * FROM read_parquet('{tmp_path}/*/*.parquet')",
        f"SELECT * FROM read_parquet('{tmp_path}/**/*.parquet', hive_partitioning = true)",
        "SELECT * FROM glob('/etc/*')",
        "SELECT getenv('HOME')",
        f"SELECT * FROM '{other}'",
    ):
        with pytest.raises(ValidationError) as err:
            analytics.query(sql, tenant_id="acme")
        assert err.value.field == "sql", sql
        assert "\n" not in err.value.message


@pytest.mark.parametrize(
    "sql",
    [
        "EXPLAIN SELECT 1",
        "PRAGMA version",
        "CALL pragma_version()",
        "SET enable_external_access = true",
        "RESET lock_configuration",
        "ATTACH '/tmp/x.duckdb' AS x",
        "INSTALL httpfs",
        "LOAD httpfs",
        "EXPORT DATABASE '/tmp/x'",
        "DROP VIEW memories",
        "CREATE TABLE x AS SELECT 1",
        "INSERT INTO memories VALUES (1)",
        "DELETE FROM memories",
        "SELECT 1; SELECT 2",
        "SELECT 1 /* hidden */; COPY (SELECT 1) TO '/tmp/x' -- second",
        "SELECT 1 --\n; DROP VIEW memories",
        "",
        "   ",
        "SELEC 1",
        "SELECT '\x00'",
        "SELECT '\udcff'",
        "SELECT " + "1" * (64 * 1024),
    ],
)
def test_only_one_plain_select_is_accepted(analytics, sql):
    with pytest.raises(ValidationError) as err:
        analytics.query(sql, tenant_id="acme")
    assert err.value.field == "sql"


def test_results_are_capped_and_say_so(analytics):
    capped = analytics.query("SELECT * FROM range(25)", tenant_id="acme", max_rows=10)
    assert len(capped["rows"]) == 10 and capped["truncated"] is True
    whole = analytics.query("SELECT * FROM range(10)", tenant_id="acme", max_rows=10)
    assert len(whole["rows"]) == 10 and whole["truncated"] is False
    default = analytics.query("SELECT * FROM range(20000)", tenant_id="acme")
    assert len(default["rows"]) == 10_000 and default["truncated"] is True


def test_every_value_is_json(analytics):
    result = analytics.query(
        "SELECT created_at, 1.5 AS d, 'a'::BLOB AS b, INTERVAL 1 DAY AS i, [1, 2] AS l, {'x': DATE '2026-01-01'} AS s,"
        " 'nan'::DOUBLE AS n FROM memories LIMIT 1",
        tenant_id="acme",
    )
    json.dumps(result, allow_nan=False)
    assert result["rows"][0][:3] == ["2026-01-02T03:04:05+00:00", 1.5, "61"]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o644, 0o666])
def test_a_master_key_others_can_read_or_write_is_refused(tmp_path, mode):
    path = tmp_path / "keys" / "master.key"
    crypto.LocalMasterKey(path)
    os.chmod(path, mode)
    with pytest.raises(ServiceError) as err:
        crypto.LocalMasterKey(path)
    assert err.value.field == "master_key"
    assert f"chmod 600 {path}" in err.value.message and f"{mode:04o}" in err.value.message
    os.chmod(path, 0o600)
    assert crypto.LocalMasterKey(path).provider.startswith("local:")


def test_only_days_that_have_ended_can_be_swept():
    today = datetime.now(UTC).date()
    assert retention.check_sweep_day(today - timedelta(days=1)) == today - timedelta(days=1)
    assert retention.check_sweep_day("2025-01-01") == date(2025, 1, 1)
    for bad in (today, today + timedelta(days=1), "2099-01-01", (today + timedelta(days=400)).isoformat()):
        with pytest.raises(ValidationError) as err:
            retention.check_sweep_day(bad)
        assert err.value.field == "date"
