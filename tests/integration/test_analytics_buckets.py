"""The analytics copy partitioned by subject bucket under the tenant, on real Parquet, DuckDB and
PostgreSQL: a subject's removal rewrites its bucket file alone, a rebuild never shows a memory
twice, the one-file layout of older installs is read and then converted, and two processes
removing different subjects both win."""

from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.infra.paths import tenant_hash
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.stores import lineage
from memory_pipelines.lib.stores.analytics import files as analytics_files
from memory_pipelines.lib.stores.analytics.store import (
    BUCKET_FILE,
    BUCKETS,
    LEGACY_FILE,
    SCHEMA,
    STORE,
    AnalyticsStore,
    bucket_of,
)

USERS = [f"user{i:02d}" for i in range(12)]
Stat = tuple[int, int, int, bytes]


def populate(store: MemoryStore, tenant: str) -> None:
    """Two personal memories per user, plus a team memory by user00 (filed under its author)."""
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="user00")
    for user in USERS:
        for n in (1, 2):
            store.write(tenant_id=tenant, user_id=user, text=f"{user} note {n}: likes tea number {n}")
    store.write(tenant_id=tenant, user_id="user00", text="core ships on fridays", team_id="core")


@pytest.fixture
def analytics(store: MemoryStore, tenant: str, tmp_path: Path) -> AnalyticsStore:
    populate(store, tenant)
    built = AnalyticsStore(tmp_path / "analytics")
    assert built.rebuild(store=store, tenant_id=tenant) == {"rows": 2 * len(USERS) + 1, "excluded_do_not_sell": 0}
    return built


def buckets_of_users(analytics: AnalyticsStore, store: MemoryStore, tenant: str) -> dict[str, int]:
    return {u: analytics.subject_bucket(store=store, tenant_id=tenant, user_id=u) for u in USERS}


def sources_of(store: MemoryStore, tenant: str, user: str) -> set[tuple[str, int]]:
    return {cv.source for cv in store.current_versions(tenant_id=tenant, user_ids=[user])}


def snapshot(analytics: AnalyticsStore, tenant: str) -> dict[int, Stat]:
    out = {}
    for bucket, path in analytics.bucket_files(tenant).items():
        st = path.stat()
        out[bucket] = (st.st_ino, st.st_mtime_ns, st.st_size, path.read_bytes())
    return out


def rows_by_memory(table: pa.Table) -> dict[str, dict[str, Any]]:
    return {row["memory_id"]: row for row in table.to_pylist()}


def alone_in_buckets(buckets: dict[str, int]) -> list[str]:
    """Users with two memories whom no other user shares a bucket with (12 users in 64 buckets:
    there are nearly always several; at least two asserted)."""
    alone = [u for u, b in buckets.items() if list(buckets.values()).count(b) == 1 and u != "user00"]
    assert len(alone) >= 2, buckets
    return alone


def view_rows(analytics: AnalyticsStore, tenant: str) -> list[tuple[Any, ...]]:
    with analytics.connect() as con:
        return con.execute(
            "SELECT memory_id, version, bucket FROM memories WHERE tenant_id = ? ORDER BY memory_id", [tenant]
        ).fetchall()


def test_each_row_is_filed_under_its_authors_keyed_bucket(store, tenant, analytics):
    buckets = buckets_of_users(analytics, store, tenant)
    files = analytics.bucket_files(tenant)
    assert set(files) == set(buckets.values())
    assert not (analytics.partition_dir(tenant) / LEGACY_FILE).exists()
    owner = {cv.memory_id: cv.user_id for cv in store.current_versions(tenant_id=tenant)}
    for bucket, path in files.items():
        assert path == analytics.data_dir / f"tenant={tenant_hash(tenant)}" / f"bucket={bucket:02d}" / BUCKET_FILE
        table = pq.read_table(path)
        assert table.schema.equals(SCHEMA)
        # The bucket is the first byte of the row's own keyed pseudonym: no key of its own.
        assert {bucket_of(p) for p in table["user_pseudonym"].to_pylist()} == {bucket}
        assert {buckets[owner[m]] for m in table["memory_id"].to_pylist()} == {bucket}
        assert not any(user.encode() in path.read_bytes() or user in str(path) for user in USERS)
    team = [cv for cv in store.current_versions(tenant_id=tenant) if cv.team_id == "core"]
    assert len(team) == 1
    assert team[0].memory_id in pq.read_table(files[buckets["user00"]])["memory_id"].to_pylist()
    # Stable: another instance, another call, the same answer; keyed: another tenant files the
    # same user ids elsewhere (all 12 equal by chance: 64**-12).
    again = AnalyticsStore(analytics.root)
    assert buckets_of_users(again, store, tenant) == buckets
    assert all(0 <= b < BUCKETS for b in buckets.values())
    other = tenant + "-other"
    for user in USERS:
        store.write(tenant_id=other, user_id=user, text="x")
    assert buckets_of_users(analytics, store, other) != buckets
    assert analytics.read_partition(tenant).num_rows == 2 * len(USERS) + 1
    assert analytics.check(store=store, tenant_id=tenant) == {
        "records": 2 * len(USERS) + 1,
        "text_columns": 0,
        "do_not_sell_rows": 0,
        "without_lineage": 0,
        "not_current": 0,
    }


def test_removing_a_subject_rewrites_its_bucket_file_alone(store, tenant, analytics):
    buckets = buckets_of_users(analytics, store, tenant)
    subject = "user03"
    target = analytics.bucket_file(tenant, buckets[subject])
    before_files = snapshot(analytics, tenant)
    before_rows = rows_by_memory(analytics.read_partition(tenant))
    gone = sources_of(store, tenant, subject)
    assert len(gone) == 2

    report = analytics.remove_and_report(store=store, tenant_id=tenant, sources=gone)

    assert report.rows == 2
    assert report.files_rewritten == [str(target.relative_to(analytics.root))]
    assert report.bytes_written == target.stat().st_size > 0
    after_files = snapshot(analytics, tenant)
    assert set(after_files) == set(before_files)
    assert {b: s for b, s in after_files.items() if b != buckets[subject]} == {
        b: s for b, s in before_files.items() if b != buckets[subject]
    }
    assert after_files[buckets[subject]][0] != before_files[buckets[subject]][0]  # a new file, renamed in
    removed = {m for m, _ in gone}
    after_rows = rows_by_memory(analytics.read_partition(tenant))
    assert after_rows == {m: row for m, row in before_rows.items() if m not in removed}
    assert {m for m, _, _ in view_rows(analytics, tenant)} == set(after_rows)
    assert not removed & {m for m, _, _ in view_rows(analytics, tenant)}
    with store.transaction() as conn:
        edges = lineage.records_of_store(conn, tenant_id=tenant, store=STORE)
    assert not {f"{m}:{v}" for m, v in gone} & set(edges)
    assert len(edges) == len(after_rows)
    # Nothing of those rows to remove again: nothing rewritten.
    assert analytics.remove_and_report(store=store, tenant_id=tenant, sources=gone).files_rewritten == []
    assert snapshot(analytics, tenant) == after_files


def test_a_removal_reads_only_its_authors_buckets_unless_a_memory_is_gone_from_the_store(
    store, tenant, analytics, monkeypatch
):
    buckets = buckets_of_users(analytics, store, tenant)
    opened: list[Path] = []

    def spy(path: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(Path(path))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(analytics_files, "open", spy, raising=False)
    analytics.remove(store=store, tenant_id=tenant, sources=sources_of(store, tenant, "user04"))
    assert [p for p in opened if p.name == BUCKET_FILE] == [analytics.bucket_file(tenant, buckets["user04"])]
    # A memory the store no longer holds (a retried deletion): its author is unknown, every bucket read.
    opened.clear()
    gone = sources_of(store, tenant, "user06") | {("m_" + "0" * 32, 1)}
    assert analytics.remove(store=store, tenant_id=tenant, sources=gone) == 2
    assert {p for p in opened if p.name == BUCKET_FILE} == set(analytics.bucket_files(tenant).values())
    assert not {m for m, _ in gone} & set(analytics.read_partition(tenant)["memory_id"].to_pylist())


def test_an_emptied_bucket_is_emptied_at_once_and_its_file_deleted_after_the_grace(store, tenant, analytics):
    buckets = buckets_of_users(analytics, store, tenant)
    subject, other = alone_in_buckets(buckets)[:2]
    path, other_path = analytics.bucket_file(tenant, buckets[subject]), analytics.bucket_file(tenant, buckets[other])
    report = analytics.remove_and_report(store=store, tenant_id=tenant, sources=sources_of(store, tenant, subject))
    # Within the grace a view query that listed the file can still open it: it stays, with no rows.
    assert (report.rows, report.files_deleted) == (2, [])
    assert pq.read_table(path).num_rows == 0
    assert len(view_rows(analytics, tenant)) == 2 * len(USERS) - 1
    now = AnalyticsStore(analytics.root, empty_bucket_grace=0)
    second = now.remove_and_report(store=store, tenant_id=tenant, sources=sources_of(store, tenant, other))
    assert second.files_deleted == [str(other_path.relative_to(now.root))]
    assert not other_path.parent.exists() and path.exists()  # that removal read its own bucket alone
    # A later write that reads the first bucket (here a removal whose memory the store lost) reaps it.
    third = now.remove_and_report(store=store, tenant_id=tenant, sources={("m_" + "0" * 32, 1)})
    assert (third.rows, third.files_rewritten, third.files_deleted) == (0, [], [str(path.relative_to(now.root))])
    assert not path.parent.exists()
    assert set(now.bucket_files(tenant)) == set(buckets.values()) - {buckets[subject], buckets[other]}
    assert now.read_partition(tenant).num_rows == 2 * len(USERS) - 3
    assert len(view_rows(now, tenant)) == 2 * len(USERS) - 3


def test_a_rebuild_drops_buckets_no_longer_needed(store, tenant, analytics):
    buckets = buckets_of_users(analytics, store, tenant)
    subject = alone_in_buckets(buckets)[0]
    store.set_do_not_sell(tenant_id=tenant, user_id=subject, subject=subject)
    now = AnalyticsStore(analytics.root, empty_bucket_grace=0)
    assert now.rebuild(store=store, tenant_id=tenant) == {"rows": 2 * len(USERS) - 1, "excluded_do_not_sell": 2}
    assert set(now.bucket_files(tenant)) == set(buckets.values()) - {buckets[subject]}
    assert not list(now.partition_dir(tenant).glob("**/*.tmp"))
    assert now.check(store=store, tenant_id=tenant)["without_lineage"] == 0


def test_a_reader_never_sees_a_memory_twice_or_not_at_all_during_rebuilds(store, tenant, analytics):
    memories = {cv.memory_id: cv.user_id for cv in store.current_versions(tenant_id=tenant)}
    stop = threading.Event()
    seen: list[tuple[int, int]] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            while not stop.is_set():
                ids = analytics.read_partition(tenant)["memory_id"].to_pylist()
                seen.append((len(ids), len(set(ids))))
                with analytics.connect() as con:
                    row = con.execute(
                        "SELECT count(*), count(DISTINCT memory_id) FROM memories WHERE tenant_id = ?", [tenant]
                    ).fetchone()
                assert row is not None
                seen.append((row[0], row[1]))
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
    assert errors == []
    assert len(seen) > 2
    assert set(seen) == {(len(memories), len(memories))}
    assert set(analytics.read_partition(tenant)["version"].to_pylist()) == {4}


def test_query_sandbox_and_view_have_the_same_columns_and_one_tenant(store, tenant, analytics):
    other = tenant + "-other"
    store.write(tenant_id=other, user_id="user01", text="another tenant's row")
    analytics.rebuild(store=store, tenant_id=other)
    # tenant_id is in the files now, and still last, after the bucket of the path, as it always was.
    expected = [*(name for name in SCHEMA.names if name != "tenant_id"), "bucket", "tenant_id"]
    sandbox = analytics.query("SELECT * FROM memories LIMIT 1", tenant_id=tenant)
    assert sandbox["columns"] == expected
    with analytics.connect() as con:
        assert [r[0] for r in con.execute("DESCRIBE memories").fetchall()] == expected
        in_view = sorted(con.execute("SELECT memory_id, bucket FROM memories WHERE tenant_id = ?", [tenant]).fetchall())
    assert analytics.query("SELECT DISTINCT tenant_id FROM memories", tenant_id=tenant)["rows"] == [[tenant]]
    in_sandbox = analytics.query("SELECT memory_id, bucket FROM memories ORDER BY 1, 2", tenant_id=tenant)["rows"]
    assert [tuple(r) for r in in_sandbox] == in_view
    assert len(in_view) == 2 * len(USERS) + 1
    assert analytics.query("SELECT count(*) FROM memories", tenant_id=other)["rows"] == [[1]]


def test_drop_removes_the_tenant_directory_and_its_lineage(store, tenant, analytics):
    assert analytics.drop(store=store, tenant_id=tenant) == 2 * len(USERS) + 1
    assert not analytics.partition_dir(tenant).exists()
    assert analytics.read_partition(tenant) is None
    with store.transaction() as conn:
        assert lineage.records_of_store(conn, tenant_id=tenant, store=STORE) == {}


def _legacy_rows(n: int) -> pa.Table:
    """A tenant of the one-file layout that is not in PostgreSQL: its conversion needs no key."""
    table = pa.Table.from_pylist(
        [
            {"memory_id": f"m_{i:030d}", "version": 1, "user_pseudonym": f"{i * 37 % 256:02x}" + "0" * 30}
            for i in range(n)
        ],
        schema=pa.schema([SCHEMA.field(name) for name in ("memory_id", "version", "user_pseudonym")]),
    )
    for name in SCHEMA.names[3:]:
        table = table.append_column(SCHEMA.field(name), pa.nulls(n, SCHEMA.field(name).type))
    return table


def legacy_dir(analytics: AnalyticsStore, tenant: str) -> Path:
    return analytics.root / "memories" / f"tenant_id={tenant}"  # named by the raw id, as then


def to_legacy_layout(analytics: AnalyticsStore, tenant: str, table: pa.Table) -> None:
    """What an install from before the buckets holds: one file per tenant, a view over `*/*.parquet`."""
    directory = legacy_dir(analytics, tenant)
    directory.mkdir(parents=True, exist_ok=True)
    if analytics.partition_dir(tenant).exists():
        for path in analytics.bucket_files(tenant).values():
            path.unlink()
            path.parent.rmdir()
        analytics.partition_dir(tenant).rmdir()
    pq.write_table(table.drop_columns([c for c in table.column_names if c == "tenant_id"]), directory / LEGACY_FILE)
    analytics.database.unlink(missing_ok=True)
    import duckdb

    with duckdb.connect(str(analytics.database)) as con:
        pattern = str(analytics.root / "memories" / "*" / "*.parquet")
        con.execute(f"CREATE VIEW memories AS SELECT * FROM read_parquet('{pattern}', hive_partitioning = true)")


def test_the_one_file_layout_is_read_then_converted_at_the_first_write(store, tenant, analytics):
    before = analytics.read_partition(tenant).sort_by("memory_id")
    to_legacy_layout(analytics, tenant, before)
    bystander = tenant + "-legacy"
    to_legacy_layout(analytics, bystander, _legacy_rows(300))
    # A crash in an earlier conversion left bucket files: the old file still wins until removed.
    stale = legacy_dir(analytics, tenant) / "bucket=05" / BUCKET_FILE
    stale.parent.mkdir(parents=True)
    pq.write_table(before.slice(0, 1).drop_columns(["tenant_id"]), stale)

    assert analytics.read_partition(tenant).sort_by("memory_id").equals(before)
    assert analytics.query("SELECT count(*) FROM memories", tenant_id=tenant)["rows"] == [[before.num_rows]]
    with analytics.connect() as con:
        assert con.execute("SELECT count(*) FROM memories WHERE tenant_id = ?", [tenant]).fetchone() == (
            before.num_rows,
        )

    gone = sources_of(store, tenant, "user05")
    now = AnalyticsStore(analytics.root, empty_bucket_grace=0)
    assert now.remove(store=store, tenant_id=tenant, sources=gone) == 2

    for name in (tenant, bystander):
        assert not legacy_dir(now, name).exists()
        assert now.bucket_files(name)
    removed = {m for m, _ in gone}
    after = now.read_partition(tenant).sort_by("memory_id")
    assert after.equals(before.filter(pa.array([m not in removed for m in before["memory_id"].to_pylist()])))
    assert not stale.exists()
    converted = now.read_partition(bystander)
    assert converted.num_rows == 300
    for bucket, path in now.bucket_files(bystander).items():
        assert {bucket_of(p) for p in pq.read_table(path)["user_pseudonym"].to_pylist()} == {bucket}
    # The view now reads the buckets, with their column, and sees both converted tenants.
    assert {m for m, _, _ in view_rows(now, tenant)} == set(after["memory_id"].to_pylist())
    assert len(view_rows(now, bystander)) == 300
    assert now.query("SELECT count(DISTINCT bucket) FROM memories", tenant_id=bystander)["rows"] == [
        [len(now.bucket_files(bystander))]
    ]


def _remove_subject(home: str, root: str, tenant: str, sources: list[tuple[str, int]], start: Any, out: Any) -> None:
    from memory_pipelines.lib.infra.settings import Settings
    from memory_pipelines.lib.runtime import open_store

    store = open_store(Settings.from_env({"MEMORY_PIPELINES_HOME": home}))
    try:
        start.wait(60)
        report = AnalyticsStore(Path(root)).remove_and_report(store=store, tenant_id=tenant, sources=set(sources))
        out.put({"pid": os.getpid(), "rows": report.rows, "files": report.files_rewritten})
    except Exception as exc:
        out.put({"pid": os.getpid(), "error": f"{type(exc).__name__}: {exc}"})
    finally:
        store.close()


@pytest.mark.slow
def test_two_processes_removing_different_subjects_both_succeed(store, tenant, analytics, session_settings):
    buckets = buckets_of_users(analytics, store, tenant)
    first = alone_in_buckets(buckets)[0]
    second = next(u for u in USERS if buckets[u] != buckets[first])
    before = rows_by_memory(analytics.read_partition(tenant))
    gone = {user: sources_of(store, tenant, user) for user in (first, second)}
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    workers = [
        ctx.Process(
            target=_remove_subject,
            args=(str(session_settings.home), str(analytics.root), tenant, sorted(gone[user]), start, out),
        )
        for user in (first, second)
    ]
    for worker in workers:
        worker.start()
    start.set()
    results = [out.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(30)
    assert [r.get("error") for r in results] == [None, None]
    assert sorted(r["rows"] for r in results) == sorted(len(sources) for sources in gone.values())
    assert sorted(f for r in results for f in r["files"]) == sorted(
        str(analytics.bucket_file(tenant, buckets[u]).relative_to(analytics.root)) for u in (first, second)
    )
    removed = {m for sources in gone.values() for m, _ in sources}
    assert rows_by_memory(analytics.read_partition(tenant)) == {m: r for m, r in before.items() if m not in removed}


@pytest.mark.slow
def test_a_subject_forget_rewrites_one_bucket_of_the_shared_analytics_copy(store, derived, tenant):
    populate(store, tenant)
    derived.analytics.rebuild(store=store, tenant_id=tenant)
    analytics = derived.analytics
    buckets = buckets_of_users(analytics, store, tenant)
    subject = next(u for u in USERS if u != "user00")
    before = snapshot(analytics, tenant)
    gone = {m for m, _ in sources_of(store, tenant, subject)}
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject=subject)
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
    after = snapshot(analytics, tenant)
    assert {b: s for b, s in after.items() if b != buckets[subject]} == {
        b: s for b, s in before.items() if b != buckets[subject]
    }
    assert not gone & set(analytics.read_partition(tenant)["memory_id"].to_pylist())
    assert not gone & {m for m, _, _ in view_rows(analytics, tenant)}
    assert analytics.read_partition(tenant).num_rows == 2 * len(USERS) - 1
