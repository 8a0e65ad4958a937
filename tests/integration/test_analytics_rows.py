"""The analytics copy in PostgreSQL, on real PostgreSQL, DuckDB and pyarrow: what a rebuild writes
(no text, pseudonyms only), what a removal and a drop take, that every value comes back as written,
that a reader never sees half a rebuild, that two tenants differing in case never share a row, that
a store of another host (another HOME) reads the same copy, and that the files of an earlier version
are removed by the first write."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memory_pipelines.lib.infra.errors import NotFoundError, ValidationError
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.stores import lineage
from memory_pipelines.lib.stores.analytics.rows import SCHEMA, bucket_of, read_rows, write_rows
from memory_pipelines.lib.stores.analytics.store import STORE, AnalyticsStore

USERS = [f"user{i:02d}" for i in range(6)]


def populate(store: MemoryStore, tenant: str) -> None:
    """Two personal memories per user, plus a team memory by user00."""
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="user00")
    for user in USERS:
        for n in (1, 2):
            store.write(tenant_id=tenant, user_id=user, text=f"{user} note {n}: likes quokkas number {n}")
    store.write(tenant_id=tenant, user_id="user00", text="core ships zebras", team_id="core")


@pytest.fixture
def analytics(store: MemoryStore, tenant: str, tmp_path: Path) -> AnalyticsStore:
    populate(store, tenant)
    built = AnalyticsStore(store=store, old_files=tmp_path / "analytics")
    assert built.rebuild(store=store, tenant_id=tenant) == {"rows": 2 * len(USERS) + 1, "excluded_do_not_sell": 0}
    return built


def sources_of(store: MemoryStore, tenant: str, user: str) -> set[tuple[str, int]]:
    return {cv.source for cv in store.current_versions(tenant_id=tenant, user_ids=[user])}


def rows_by_memory(table: pa.Table) -> dict[str, dict[str, Any]]:
    return {row["memory_id"]: row for row in table.to_pylist()}


def test_a_rebuild_writes_each_current_version_once_without_text_or_ids(store, tenant, analytics):
    table = analytics.read_partition(tenant)
    assert table.schema.equals(SCHEMA)
    current = {cv.memory_id: cv for cv in store.current_versions(tenant_id=tenant)}
    rows = rows_by_memory(table)
    assert set(rows) == set(current) and table.num_rows == len(current)
    key = analytics.pseudonym_key(store, tenant)
    for memory_id, row in rows.items():
        cv = current[memory_id]
        assert (row["version"], row["category"], row["created_at"]) == (cv.version, cv.category, cv.created_at)
        assert row["tenant_id"] == tenant and row["text_length"] > 0
        assert row["user_pseudonym"] not in USERS and len(row["user_pseudonym"]) == 32
        assert bucket_of(row["user_pseudonym"]) < 64
    assert key and rows[next(m for m, cv in current.items() if cv.team_id)]["team_pseudonym"] not in (None, "core")
    with store.transaction() as conn:
        dump = conn.execute(
            "SELECT string_agg(r::text, '|') FROM derived.analytics_rows r WHERE tenant_id = %s", (tenant,)
        ).fetchone()[0]
    assert not any(u in dump for u in USERS) and "quokka" not in dump and "zebra" not in dump
    assert analytics.check(store=store, tenant_id=tenant) == {
        "records": len(current),
        "text_columns": 0,
        "do_not_sell_rows": 0,
        "without_lineage": 0,
        "not_current": 0,
    }
    # Do-not-sell rows leave at the next rebuild; a second rebuild writes the same rows again.
    store.set_do_not_sell(tenant_id=tenant, user_id="user03", subject="user03")
    assert analytics.rebuild(store=store, tenant_id=tenant) == {
        "rows": 2 * len(USERS) - 1,
        "excluded_do_not_sell": 2,
    }
    assert analytics.check(store=store, tenant_id=tenant)["without_lineage"] == 0


def test_every_value_comes_back_as_written(store, tenant):
    store.write(tenant_id=tenant, user_id="u", text="x")  # the tenant's partitions exist
    awkward = ["a,b", 'say "hi"', "two\nlines", "NULL", "N/A", "", "nan", "t", " pad ", "ünï", "\\N"]
    when = datetime(2026, 12, 5, 6, 7, 8, 901234, tzinfo=UTC)
    rows = [
        (
            f"m_{i:032d}",
            i + 1,
            f"{i:02x}" * 16,
            None if i % 2 else "t" * 32,
            text,
            text,
            i % 2 == 0,
            i / 7,
            i,
            when,
            None,
            when,
            tenant,
        )
        for i, text in enumerate(awkward)
    ]
    with store.transaction() as conn:
        write_rows(conn, rows)
        table = read_rows(conn, tenant)
        narrow = read_rows(conn, tenant, ["version", "created_at"])
    assert [tuple(r.values()) for r in table.to_pylist()] == rows
    assert narrow.column_names == ["version", "created_at"] and narrow.num_rows == len(rows)
    with store.transaction() as conn, pytest.raises(ValueError, match="no analytics column"):
        read_rows(conn, tenant, ["memory_id", "text"])


def test_removing_a_subject_takes_its_rows_and_lineage_only(store, tenant, analytics):
    before = rows_by_memory(analytics.read_partition(tenant))
    gone = sources_of(store, tenant, "user03")
    assert len(gone) == 2
    assert analytics.count(tenant_id=tenant, record_ids=[f"{m}:{v}" for m, v in gone]) == 2
    assert analytics.remove(store=store, tenant_id=tenant, sources=gone) == 2
    after = rows_by_memory(analytics.read_partition(tenant))
    assert after == {m: r for m, r in before.items() if m not in {m for m, _ in gone}}
    assert analytics.count(tenant_id=tenant, record_ids=[f"{m}:{v}" for m, v in gone]) == 0
    with store.transaction() as conn:
        edges = lineage.records_of_store(conn, tenant_id=tenant, store=STORE)
    assert len(edges) == len(after) and not {f"{m}:{v}" for m, v in gone} & set(edges)
    assert analytics.remove(store=store, tenant_id=tenant, sources=gone) == 0  # nothing left to take
    assert analytics.drop(store=store, tenant_id=tenant) == len(after)
    assert analytics.read_partition(tenant) is None
    with pytest.raises(NotFoundError) as err:
        analytics.query("SELECT 1", tenant_id=tenant)
    assert err.value.field == "tenant" and "not materialized" in err.value.message


def test_a_reader_never_sees_half_a_rebuild(store, tenant, analytics):
    memories = {cv.memory_id: cv.user_id for cv in store.current_versions(tenant_id=tenant)}
    stop = threading.Event()
    seen: list[tuple[int, int, frozenset[int]]] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            while not stop.is_set():
                table = analytics.read_partition(tenant, columns=["memory_id", "version"])
                ids = table["memory_id"].to_pylist()
                seen.append((len(ids), len(set(ids)), frozenset(table["version"].to_pylist())))
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for round_ in range(3):
            for memory_id, user in memories.items():
                store.write(tenant_id=tenant, user_id=user, text=f"round {round_} of {memory_id}", memory_id=memory_id)
            analytics.rebuild(store=store, tenant_id=tenant)
    finally:
        stop.set()
        reader.join(30)
    assert errors == [] and len(seen) > 2
    # Every read saw one whole copy: every memory once, all at one version.
    assert {(n, d) for n, d, _ in seen} == {(len(memories), len(memories))}
    assert all(len(versions) == 1 for _, _, versions in seen)
    assert set(analytics.read_partition(tenant)["version"].to_pylist()) == {4}


def test_tenants_differing_in_case_and_another_hosts_store_read_their_own_rows(store, tenant, analytics, tmp_path):
    upper, lower = tenant + "-Case", tenant + "-case"
    for name, n in ((upper, 2), (lower, 3)):
        for i in range(n):
            store.write(tenant_id=name, user_id=f"user{i}", text=f"{name} {i}")
        analytics.rebuild(store=store, tenant_id=name)
    # Another host: its own HOME, its own connection; the same rows.
    elsewhere = MemoryStore(store.conninfo, store.keys)
    try:
        remote = AnalyticsStore(store=elsewhere, old_files=tmp_path / "other-host" / "analytics")
        for name, n in ((upper, 2), (lower, 3), (tenant, 2 * len(USERS) + 1)):
            assert remote.query("SELECT count(*) FROM memories", tenant_id=name)["rows"] == [[n]]
            named = remote.query("SELECT DISTINCT tenant_id FROM memories", tenant_id=name)["rows"]
            assert named == [[name]]
        # Naming the other tenant finds nothing: its rows are not in the query's database.
        other = remote.query(f"SELECT count(*) FROM memories WHERE tenant_id = '{lower}'", tenant_id=upper)
        assert other["rows"] == [[0]]
        expected = [*(c for c in SCHEMA.names if c != "tenant_id"), "bucket", "tenant_id"]
        assert remote.query("SELECT * FROM memories LIMIT 1", tenant_id=tenant)["columns"] == expected
        with pytest.raises(NotFoundError) as err:
            remote.query("SELECT 1", tenant_id=tenant + "-never")
        assert err.value.field == "tenant"
        for bad in ("acme'--", "../acme", "", "tenant_id=acme"):
            with pytest.raises(ValidationError) as bad_err:
                remote.query("SELECT 1", tenant_id=bad)
            assert bad_err.value.field == "tenant"
    finally:
        elsewhere.close()
    assert not (tmp_path / "other-host").exists()  # a query writes nothing under HOME


def test_an_earlier_versions_files_are_removed_by_the_first_write(store, tenant, analytics, tmp_path):
    old = tmp_path / "analytics"
    bucket = old / "tenants" / "tenant=abc" / "bucket=03"
    bucket.mkdir(parents=True)
    pq.write_table(analytics.read_partition(tenant), bucket / "part.parquet")
    (old / "analytics.duckdb").write_bytes(b"DUCK")
    # Reads never look at them, nor remove them.
    assert analytics.query("SELECT count(*) FROM memories", tenant_id=tenant)["rows"] == [[2 * len(USERS) + 1]]
    assert (bucket / "part.parquet").exists()
    assert analytics.remove(store=store, tenant_id=tenant, sources=sources_of(store, tenant, "user01")) == 2
    assert not old.exists()
    # The erasure's adapter removes them too (here made again after the write).
    bucket.mkdir(parents=True)
    (bucket / "part.parquet").write_bytes(b"PAR1")
    assert analytics.remove_old() == ["tenants/tenant=abc/bucket=03/part.parquet"]
    assert not old.exists() and analytics.remove_old() == []
