"""The analytics copy's files and directories are named by the tenant's hash, never by its raw id:
tenants differing in case only (`Acme`, `acme`, one directory on macOS under raw names) keep
directories and rows of their own, each query still sees its own tenant's rows alone, and an install
whose directories are still named `tenant_id=T` is converted on first use.

Only methods the analytics store has always had are used here, and the old layout is written by
hand: run against the code from before the hashed names, these tests fail on what they check.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.stores.analytics import store as analytics_module
from memory_pipelines.lib.stores.analytics.store import SCHEMA, AnalyticsStore
from memory_pipelines.lib.stores.derived import DerivedStores

COUNTS = {"upper": 3, "lower": 5}


class Died(Exception):
    """The process writing the analytics copy died here."""


def write_tenant(store: MemoryStore, tenant: str, n: int) -> None:
    for i in range(n):
        store.write(tenant_id=tenant, user_id=f"user{i % 2}", text=f"{tenant} note {i}: tea at {i} o'clock")


@pytest.fixture
def pair(store: MemoryStore) -> dict[str, str]:
    """Two tenants differing in case only, with 3 and 5 memories (unique per test: one server)."""
    suffix = uuid.uuid4().hex[:10]
    tenants = {"upper": f"Acme-{suffix}", "lower": f"acme-{suffix}"}
    for key, tenant in tenants.items():
        write_tenant(store, tenant, COUNTS[key])
    return tenants


@pytest.fixture
def analytics(store: MemoryStore, pair: dict[str, str], tmp_path: Path) -> AnalyticsStore:
    built = AnalyticsStore(tmp_path / "analytics", store=store)
    for key, tenant in pair.items():
        assert built.rebuild(store=store, tenant_id=tenant)["rows"] == COUNTS[key]
    return built


def names_a_tenant(text: str, tenants: list[str]) -> bool:
    """Whether `text` holds any of `tenants`, in any case (a case-insensitive file system folds)."""
    return any(t.casefold() in text.casefold() for t in tenants)


def components_naming(root: Path, tenants: list[str]) -> list[str]:
    """Every path under `root` (relative) one of whose components holds a tenant id."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            relative = (Path(dirpath) / name).relative_to(root)
            if any(names_a_tenant(part, tenants) for part in relative.parts):
                found.append(str(relative))
    return found


def view_counts(analytics: AnalyticsStore) -> dict[str, int]:
    with analytics.connect() as con:
        return dict(con.execute("SELECT tenant_id, count(*) FROM memories GROUP BY tenant_id").fetchall())


def test_tenants_differing_in_case_have_directories_of_their_own_named_by_no_tenant(analytics, pair):
    upper, lower = pair["upper"], pair["lower"]
    tenants = [upper, lower]
    dirs = {t: analytics.partition_dir(t) for t in tenants}
    # Different even once case is folded, as macOS folds it, and neither names a tenant.
    assert dirs[upper].name.casefold() != dirs[lower].name.casefold()
    for tenant, directory in dirs.items():
        assert directory.is_dir()
        assert not names_a_tenant(str(directory.relative_to(analytics.root)), tenants)
        files = analytics.bucket_files(tenant)
        assert files and all(path.parent.parent == directory for path in files.values())
        rows = pa.concat_tables([pq.read_table(path) for path in files.values()])
        assert rows.num_rows == COUNTS["upper" if tenant == upper else "lower"]
        # The files say whose rows they hold: the directory name no longer does.
        assert set(rows["tenant_id"].to_pylist()) == {tenant}
    assert not set(analytics.bucket_files(upper).values()) & set(analytics.bucket_files(lower).values())
    assert components_naming(analytics.root, tenants) == []


def test_each_tenants_query_sees_its_own_rows_alone(analytics, pair):
    upper, lower = pair["upper"], pair["lower"]
    for key, tenant in pair.items():
        result = analytics.query("SELECT tenant_id, count(*) FROM memories GROUP BY tenant_id", tenant_id=tenant)
        assert result["rows"] == [[tenant, COUNTS[key]]]
        assert analytics.read_partition(tenant).num_rows == COUNTS[key]
        named = analytics.query("SELECT DISTINCT tenant_id FROM memories", tenant_id=tenant)["rows"]
        assert named == [[tenant]]
    assert view_counts(analytics) == {upper: COUNTS["upper"], lower: COUNTS["lower"]}
    with analytics.connect() as con:
        columns = [r[0] for r in con.execute("DESCRIBE memories").fetchall()]
    # The view's columns are the sandbox's, tenant_id last, the path's hash key not among them.
    assert columns == analytics.query("SELECT * FROM memories LIMIT 1", tenant_id=upper)["columns"]
    assert columns[-2:] == ["bucket", "tenant_id"] and "tenant" not in columns

    # A file of the other tenant's, put in this tenant's directory (a copy gone astray): its rows
    # name their own tenant, so this tenant's reads and queries still show none of them.
    stray_bucket = next(b for b in range(analytics_module.BUCKETS) if b not in analytics.bucket_files(upper))
    stray = analytics.bucket_file(upper, stray_bucket)
    stray.parent.mkdir(parents=True)
    shutil.copyfile(next(iter(analytics.bucket_files(lower).values())), stray)
    assert analytics.query("SELECT count(*) FROM memories", tenant_id=upper)["rows"] == [[COUNTS["upper"]]]
    assert set(analytics.read_partition(upper)["tenant_id"].to_pylist()) == {upper}
    assert analytics.query("SELECT count(*) FROM memories", tenant_id=lower)["rows"] == [[COUNTS["lower"]]]


def to_old_layout(analytics: AnalyticsStore, tenant: str) -> pa.Table:
    """What an install from before the hashed names holds for `tenant`: buckets under
    `memories/tenant_id=T/`, rows without a tenant_id column. Returns the tenant's rows."""
    rows = analytics.read_partition(tenant)
    old = analytics.root / "memories" / f"tenant_id={tenant}"
    tables = {b: pq.read_table(p) for b, p in analytics.bucket_files(tenant).items()}
    shutil.rmtree(analytics.partition_dir(tenant))
    for bucket, table in tables.items():
        target = old / f"bucket={bucket:02d}" / "part.parquet"
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.drop_columns([c for c in table.column_names if c == "tenant_id"]), target)
    return rows


def old_view(analytics: AnalyticsStore) -> None:
    """The view of an install from before the hashed names: the tenant from the path."""
    analytics.database.unlink(missing_ok=True)
    pattern = str(analytics.root / "memories" / "*" / "*" / "*.parquet")
    with duckdb.connect(str(analytics.database)) as con:
        con.execute(
            f"CREATE VIEW memories AS SELECT * FROM read_parquet('{pattern}', hive_partitioning = true,"
            " hive_types = {'tenant_id': 'VARCHAR', 'bucket': 'INTEGER'})"
        )


def legacy_rows(n: int) -> pa.Table:
    """The one file of a tenant from before the buckets (not in PostgreSQL: converting needs no key)."""
    names = [name for name in SCHEMA.names if name != "tenant_id"]
    return pa.Table.from_pylist(
        [
            {"memory_id": f"m_{i:030d}", "version": 1, "user_pseudonym": f"{i * 37 % 256:02x}" + "0" * 30}
            for i in range(n)
        ],
        schema=pa.schema([SCHEMA.field(name) for name in names]),
    )


def by_memory(table: pa.Table) -> dict[str, dict[str, Any]]:
    return {row["memory_id"]: row for row in table.to_pylist()}


def test_directories_named_by_the_raw_id_are_converted_on_first_use(store, analytics, pair):
    upper, lower = pair["upper"], pair["lower"]
    legacy = f"Legacy-{uuid.uuid4().hex[:10]}"
    before = {t: to_old_layout(analytics, t) for t in (upper, lower)}
    legacy_dir = analytics.root / "memories" / f"tenant_id={legacy}"
    legacy_dir.mkdir(parents=True)
    pq.write_table(legacy_rows(4), legacy_dir / "memories.parquet")
    old_view(analytics)
    old_files = sorted(p for p in (analytics.root / "memories").rglob("*") if p.is_file())
    assert len(old_files) >= 3

    # Read as they are until converted, each with its own tenant.
    for tenant in (upper, lower):
        assert by_memory(analytics.read_partition(tenant)) == by_memory(before[tenant])
    assert set(analytics.read_partition(legacy)["tenant_id"].to_pylist()) == {legacy}
    assert analytics.query("SELECT count(*) FROM memories", tenant_id=lower)["rows"] == [[COUNTS["lower"]]]
    # (The bucketed install's view never globbed a one-file tenant: that one converted with the view.)
    assert view_counts(analytics) == {upper: COUNTS["upper"], lower: COUNTS["lower"]}

    # The first write converts every tenant: here a removal of one subject of `upper`.
    gone = {cv.source for cv in store.current_versions(tenant_id=upper, user_ids=["user0"])}
    now = AnalyticsStore(analytics.root, store=store, empty_bucket_grace=0)
    assert now.remove(store=store, tenant_id=upper, sources=gone) == len(gone) > 0

    assert not (analytics.root / "memories").exists()
    assert not any(p.exists() for p in old_files)
    assert components_naming(analytics.root, [upper, lower, legacy]) == []
    removed = {m for m, _ in gone}
    expected = {m: r for m, r in by_memory(before[upper]).items() if m not in removed}
    assert by_memory(now.read_partition(upper)) == expected
    assert by_memory(now.read_partition(lower)) == by_memory(before[lower])
    assert now.read_partition(legacy).num_rows == 4
    for tenant in (upper, lower, legacy):
        for path in now.bucket_files(tenant).values():
            table = pq.read_table(path)
            assert table.schema.equals(SCHEMA) and set(table["tenant_id"].to_pylist()) == {tenant}
    # The view switched to the new files, the tenant from them.
    assert view_counts(now) == {upper: len(expected), lower: COUNTS["lower"], legacy: 4}
    for tenant, count in ((upper, len(expected)), (lower, COUNTS["lower"])):
        assert now.query("SELECT count(*) FROM memories", tenant_id=tenant)["rows"] == [[count]]


def test_a_conversion_that_dies_leaves_one_whole_copy_and_is_finished_by_the_next(analytics, pair, monkeypatch):
    upper, lower = pair["upper"], pair["lower"]
    before = {t: to_old_layout(analytics, t) for t in (upper, lower)}
    old_view(analytics)
    real_rmtree = shutil.rmtree
    aside: list[Path] = []

    def dies_after_the_rename(path: Any, *args: Any, **kwargs: Any) -> None:
        # The old directory has been renamed aside: the process dies before unlinking its files.
        if Path(path).parent.parent == analytics.root and not aside:
            aside.append(Path(path))
            raise Died
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(analytics_module.shutil, "rmtree", dies_after_the_rename)
    with pytest.raises(Died):
        AnalyticsStore(analytics.root).refresh_views()
    monkeypatch.setattr(analytics_module.shutil, "rmtree", real_rmtree)

    # One tenant's old directory is gone, aside; each reader sees each tenant's one whole copy.
    assert len(aside) == 1 and aside[0].is_dir() and any(aside[0].rglob("*.parquet"))
    for tenant in (upper, lower):
        assert by_memory(analytics.read_partition(tenant)) == by_memory(before[tenant])
    assert view_counts(analytics) == {upper: COUNTS["upper"], lower: COUNTS["lower"]}

    AnalyticsStore(analytics.root).refresh_views()
    assert not aside[0].exists() and not (analytics.root / "memories").exists()
    assert components_naming(analytics.root, [upper, lower]) == []
    for tenant in (upper, lower):
        assert by_memory(analytics.read_partition(tenant)) == by_memory(before[tenant])
    assert view_counts(analytics) == {upper: COUNTS["upper"], lower: COUNTS["lower"]}


def test_no_path_under_analytics_names_a_tenant(store, derived: DerivedStores, analytics, pair):
    upper, lower = pair["upper"], pair["lower"]
    # Through every write: removal, rebuild after a change, drop, conversion of an old directory.
    gone = {cv.source for cv in store.current_versions(tenant_id=lower, user_ids=["user1"])}
    analytics.remove(store=store, tenant_id=lower, sources=gone)
    store.write(tenant_id=upper, user_id="user2", text="a third author's first note")
    upper_rows = analytics.rebuild(store=store, tenant_id=upper)["rows"]
    assert upper_rows == COUNTS["upper"] + 1
    to_old_layout(analytics, upper)
    analytics.drop(store=store, tenant_id=lower)
    assert analytics.read_partition(lower) is None
    assert analytics.query("SELECT count(*) FROM memories", tenant_id=upper)["rows"] == [[upper_rows]]
    assert components_naming(analytics.root, [upper, lower]) == []
    # And the HOME every product path uses (the session's), materialized as the asset does.
    for tenant in (upper, lower):
        derived.analytics.rebuild(store=store, tenant_id=tenant)
    assert components_naming(derived.analytics.root, [upper, lower]) == []
    # (The removal above took rows from that copy alone: the store still holds them.)
    assert derived.analytics.query("SELECT count(*) FROM memories", tenant_id=lower)["rows"] == [[COUNTS["lower"]]]
