"""Per-tenant LIST partitions (migration 0011, lib/memories/table_partitions.py), on the session's real PostgreSQL.

The point of them: compacting one tenant (VACUUM FULL of its partitions, ACCESS EXCLUSIVE) never
makes another tenant's reads wait, prepared statements included.
"""

from __future__ import annotations

import hashlib
import secrets
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from memory_pipelines.lib.infra import migrations
from memory_pipelines.lib.infra.errors import NotFoundError, ServiceError, ValidationError
from memory_pipelines.lib.infra.services import Endpoints
from memory_pipelines.lib.memories import crypto, table_partitions
from memory_pipelines.lib.memories.keys import KeyStore
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.memories.table_partitions import PARTITIONED_TABLES
from memory_pipelines.lib.stores.analytics.store import AnalyticsStore
from memory_pipelines.lib.stores.keyword.index import KeywordIndex
from memory_pipelines.lib.stores.summaries.store import ExtractiveSummarizer, SummaryStore

pytestmark = pytest.mark.slow

# More than psycopg's prepare threshold (5) plus PostgreSQL's 5 custom plans before a generic one.
READS = 12
# A read that waits on a lock fails this fast instead of hanging the test.
LOCK_WAIT = "2s"


def _bound(tenant_id: str) -> str:
    return "FOR VALUES IN ('" + tenant_id.replace("'", "''") + "')"


def _children(
    conn: psycopg.Connection, tenant_id: str, parents: tuple[str, ...] = PARTITIONED_TABLES
) -> dict[str, list[str]]:
    """parent -> every partition whose bound is exactly this tenant (straight from the catalog)."""
    rows = conn.execute(
        "SELECT i.inhparent::regclass::text, c.oid::regclass::text FROM pg_inherits i"
        " JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = ANY(%s::regclass[])"
        " AND pg_get_expr(c.relpartbound, 0) = %s",
        (list(parents), _bound(tenant_id)),
    ).fetchall()
    out: dict[str, list[str]] = {}
    for parent, child in rows:
        out.setdefault(parent, []).append(child)
    return out


def _populate(store: MemoryStore, tenant_id: str) -> dict[str, Any]:
    """Rows of the tenant in every partitioned table, through the store's own API."""
    store.create_tenant(tenant_id=tenant_id, sharing_mode="shared_pool")
    store.add_team_member(tenant_id=tenant_id, team_id="crew", user_id="alice")
    store.add_team_member(tenant_id=tenant_id, team_id="crew", user_id="bob")
    first = store.write(tenant_id=tenant_id, user_id="alice", text="Alice drinks green tea every morning")
    second = store.write(
        tenant_id=tenant_id, user_id="alice", text="Alice drinks oolong tea now", memory_id=first.memory_id
    )
    team = store.write(tenant_id=tenant_id, user_id="bob", text="The crew deploys on Tuesdays", team_id="crew")
    KeywordIndex(store).sync(tenant_id=tenant_id)
    AnalyticsStore(store=store).rebuild(store=store, tenant_id=tenant_id)
    summaries = SummaryStore(store, ExtractiveSummarizer())
    summaries.sync(tenant_id=tenant_id, scope="subject")
    summaries.sync(tenant_id=tenant_id, scope="team")
    snapshot_id = "ps_" + secrets.token_hex(12)
    with store.transaction() as conn:
        key_id, key = store.keys.subject_key(conn, tenant_id, "alice", create=False)
        conn.execute(
            "INSERT INTO derived.prompt_snapshots (tenant_id, snapshot_id, run_id, subject_id, prompt_ct, key_id)"
            " VALUES (%s, %s, 'run-1', 'alice', %s, %s)",
            (tenant_id, snapshot_id, crypto.seal(key, b"the prompt", crypto.aad("prompt", tenant_id)), key_id),
        )
    return {"personal": (second.memory_id, second.version), "team": (team.memory_id, team.version)}


@pytest.fixture
def other_tenant() -> str:
    return "t-" + uuid.uuid4().hex[:12]


@pytest.fixture
def impatient_store(store: MemoryStore) -> Iterator[MemoryStore]:
    """The store on connections whose lock waits fail after LOCK_WAIT (a blocked read fails the test
    instead of hanging it); everything else as the store's own, `plan_cache_mode` included."""
    options = str(conninfo_to_dict(store.conninfo).get("options") or "") + f" -c lock_timeout={LOCK_WAIT}"
    impatient = MemoryStore(make_conninfo(store.conninfo, options=options.strip()), store.keys)
    yield impatient
    impatient.close()


# -- one partition per table, bound to the tenant ---------------------------------------------------


def test_a_new_tenant_gets_one_partition_of_each_table(store: MemoryStore, tenant: str) -> None:
    with psycopg.connect(store.conninfo, autocommit=True) as conn:
        declared = conn.execute("SELECT memory.partitioned_tables()::text[]").fetchone()
        assert declared is not None and tuple(declared[0]) == PARTITIONED_TABLES
        assert _children(conn, tenant) == {}
        store.create_tenant(tenant_id=tenant)
        children = _children(conn, tenant)
        assert {parent: len(found) for parent, found in children.items()} == dict.fromkeys(PARTITIONED_TABLES, 1)
        found = table_partitions.tenant_partitions(conn, tenant)
        assert found == {parent: names[0] for parent, names in children.items()}
        digest = hashlib.md5(tenant.encode()).hexdigest()[:16]
        assert all(name.endswith(f"__t_{digest}") for name in found.values())
        # No DEFAULT partition anywhere: a row of a tenant without partitions has nowhere to go.
        defaults = conn.execute(
            "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
            " WHERE i.inhparent = ANY(%s::regclass[]) AND pg_get_expr(c.relpartbound, 0) = 'DEFAULT'",
            (list(PARTITIONED_TABLES),),
        ).fetchone()
        assert defaults == (0,)
        table_partitions.ensure_tenant(conn, tenant)  # idempotent
        assert table_partitions.tenant_partitions(conn, tenant) == found


def test_odd_tenant_ids_get_partitions(store: MemoryStore) -> None:
    # The longest id validation allows, with every character it allows besides letters and digits.
    longest = ("T." + uuid.uuid4().hex + "_-x" * 11)[:64]
    store.create_tenant(tenant_id=longest)
    with psycopg.connect(store.conninfo) as conn:
        assert set(table_partitions.tenant_partitions(conn, longest)) == set(PARTITIONED_TABLES)
        # Ids validation refuses still reach the trigger safely: quotes, backslashes, unicode, 300 bytes.
        odd = [
            'o\'brien\\ "q" ; DROP TABLE memory.tenants; --' + uuid.uuid4().hex,
            "ünïcødé-租户-🙂-" + uuid.uuid4().hex,
            "x" * 300 + uuid.uuid4().hex,
        ]
        with conn.transaction(force_rollback=True):
            for tenant_id in odd:
                conn.execute("INSERT INTO memory.tenants (tenant_id) VALUES (%s)", (tenant_id,))
                found = table_partitions.tenant_partitions(conn, tenant_id)
                assert set(found) == set(PARTITIONED_TABLES)
                assert all(len(name.encode()) <= 63 for name in found.values())
                conn.execute(
                    "INSERT INTO keystore.tenant_keys (tenant_id, key_id, provider) VALUES (%s, 'tk_x', 'test')",
                    (tenant_id,),
                )
                row = conn.execute(
                    sql.SQL("SELECT tenant_id FROM {}").format(sql.SQL(found["keystore.tenant_keys"]))
                ).fetchall()
                assert row == [(tenant_id,)]


def test_a_name_collision_takes_the_next_suffix(store: MemoryStore, tenant: str, other_tenant: str) -> None:
    """Two tenants whose md5 starts alike: the second gets `_2`, and both are found by their bounds."""
    digest = hashlib.md5(tenant.encode()).hexdigest()[:16]
    taken = f"tenant_keys__t_{digest}"
    with psycopg.connect(store.conninfo) as conn, conn.transaction(force_rollback=True):
        # `other_tenant`'s partition under `tenant`'s name, as a real 64-bit prefix collision would be.
        conn.execute(sql.SQL("CREATE TABLE keystore.{} (LIKE keystore.tenant_keys)").format(sql.Identifier(taken)))
        conn.execute(
            sql.SQL("ALTER TABLE keystore.tenant_keys ATTACH PARTITION keystore.{} FOR VALUES IN ({})").format(
                sql.Identifier(taken), sql.Literal(other_tenant)
            )
        )
        conn.execute("INSERT INTO memory.tenants (tenant_id) VALUES (%s)", (tenant,))
        assert table_partitions.tenant_partitions(conn, tenant)["keystore.tenant_keys"] == f"keystore.{taken}_2"
        assert table_partitions.tenant_partitions(conn, other_tenant) == {"keystore.tenant_keys": f"keystore.{taken}"}
        assert _children(conn, tenant)["keystore.tenant_keys"] == [f"keystore.{taken}_2"]
        table_partitions.ensure_tenant(conn, tenant)  # finds `_2`, makes nothing
        assert len(_children(conn, tenant)["keystore.tenant_keys"]) == 1


def test_rows_land_in_the_tenants_partitions(store: MemoryStore, tenant: str, other_tenant: str) -> None:
    _populate(store, tenant)
    store.create_tenant(tenant_id=other_tenant)
    with psycopg.connect(store.conninfo) as conn:
        mine = table_partitions.tenant_partitions(conn, tenant)
        theirs = table_partitions.tenant_partitions(conn, other_tenant)
        for parent in PARTITIONED_TABLES:
            in_parent = conn.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE tenant_id = %s").format(sql.SQL(parent)), (tenant,)
            ).fetchone()
            in_partition = conn.execute(
                sql.SQL("SELECT count(*), count(*) FILTER (WHERE tenant_id = %s) FROM {}").format(
                    sql.SQL(mine[parent])
                ),
                (tenant,),
            ).fetchone()
            # Team keys only wrap team summaries built before per-build keys (migration 0015), retired
            # keys sealed texts before version keys (0021): none here.
            empty = ("keystore.team_keys", "keystore.retired_keys")
            assert in_parent is not None and (in_parent[0] > 0 or parent in empty), parent
            assert in_partition == (in_parent[0], in_parent[0]), parent
            assert conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.SQL(theirs[parent]))).fetchone() == (0,)


# -- the point: one tenant's compaction never blocks another's reads -----------------------------


def _reads(store: MemoryStore, tenant_id: str, ids: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """Every kind of read a tenant's users make, through the normal store API."""
    keyword = KeywordIndex(store)
    summaries = SummaryStore(store, ExtractiveSummarizer())

    def keys() -> Any:
        with store.transaction() as conn:
            key_id, _ = store.keys.subject_key(conn, tenant_id, "alice", create=False)
            team_summary_key = conn.execute(
                "SELECT key_id FROM derived.summaries WHERE tenant_id = %s AND scope = 'team'", (tenant_id,)
            ).fetchone()
            assert team_summary_key is not None
            store.keys.key_by_id(conn, tenant_id, team_summary_key[0])  # the team summary's build key
            store.keys.tenant_subkey(conn, tenant_id, "keyword-index", create=False)
            return store.keys.keys_by_id(conn, tenant_id, [key_id])

    def snapshots() -> Any:
        with store.transaction() as conn:  # what AgentRuns.explain reads
            return conn.execute(
                "SELECT snapshot_id, prompt_ct FROM derived.prompt_snapshots WHERE tenant_id = %s AND run_id = %s",
                (tenant_id, "run-1"),
            ).fetchall()

    return {
        "open_texts": lambda: store.open_texts(tenant_id=tenant_id, sources=[ids["personal"], ids["team"]]),
        "list_visible": lambda: store.list_visible(tenant_id=tenant_id, user_id="alice"),
        "list_visible_team": lambda: store.list_visible(tenant_id=tenant_id, user_id="alice", team_id="crew"),
        "keyword_search": lambda: keyword.search(tenant_id=tenant_id, query="oolong tea", limit=5),
        "export": lambda: "".join(store.export_json(tenant_id=tenant_id, subject="alice")),
        "summary": lambda: summaries.read(tenant_id=tenant_id, scope="subject", scope_id="alice"),
        "team_summary": lambda: summaries.read(tenant_id=tenant_id, scope="team", scope_id="crew"),
        "keys": keys,
        "stats": lambda: store.tenant_stats(tenant_id=tenant_id),
        "integrity": lambda: store.integrity_problems(tenant_id=tenant_id),
        "prompt_snapshots": snapshots,
    }


def test_compacting_one_tenant_never_blocks_another_tenants_reads(
    store: MemoryStore, impatient_store: MemoryStore, endpoints: Endpoints, tenant: str, other_tenant: str
) -> None:
    a, b = tenant, other_tenant
    ids = {a: _populate(store, a), b: _populate(store, b)}
    expected = {name: read() for name, read in _reads(store, b, ids[b]).items()}
    assert expected["open_texts"][ids[b]["personal"]] == "Alice drinks oolong tea now"
    assert expected["keyword_search"] and expected["summary"]["summary"] and expected["prompt_snapshots"]

    # The worst moment of A's compaction: ACCESS EXCLUSIVE on every partition of A (what VACUUM FULL
    # holds), and a real compaction of A queued behind it (every later reader of A queues behind that).
    holder = psycopg.connect(store.conninfo)
    outcome: dict[str, Any] = {}
    compaction = threading.Thread(
        target=lambda: outcome.update(table_partitions.compact_tenant(endpoints.store_conninfo, a, lock_timeout="60s")),
        daemon=True,
    )
    try:
        for name in table_partitions.tenant_partitions(holder, a).values():
            holder.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(sql.SQL(name)))
        compaction.start()
        _wait_for_queued_vacuum(store)

        for name, read in _reads(impatient_store, b, ids[b]).items():
            for _ in range(3 if name == "export" else READS):  # export: a new connection each time
                result = read()  # a lock wait raises after LOCK_WAIT instead of passing
                assert _comparable(name, result) == _comparable(name, expected[name]), name
        with impatient_store.transaction() as conn:  # the reads above ran as server-side prepared statements
            assert conn.execute("SHOW plan_cache_mode").fetchone() == ("force_custom_plan",)
            prepared = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
            assert prepared is not None and prepared[0] >= 5
        with psycopg.connect(impatient_store.conninfo) as conn:  # lookups never deparse through a lock
            assert set(table_partitions.tenant_partitions(conn, b)) == set(PARTITIONED_TABLES)
            assert table_partitions.tenant_partitions(conn, "t-none-" + uuid.uuid4().hex[:8]) == {}  # all bounds read
        for n in range(READS):  # B's writes too
            impatient_store.write(tenant_id=b, user_id="alice", text=f"Alice's note number {n}")

        # The same read of A does wait: the test can fail.
        with pytest.raises((ServiceError, psycopg.errors.LockNotAvailable)):
            impatient_store.open_texts(tenant_id=a, sources=[ids[a]["personal"]])
        # ...and so does B's read on a generic plan: why store connections force custom plans.
        with psycopg.connect(impatient_store.conninfo, autocommit=True) as generic:
            generic.execute("SET plan_cache_mode = force_generic_plan")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                for _ in range(2):
                    generic.execute(
                        "SELECT text_ct FROM memory.memory_versions WHERE tenant_id = %s AND memory_id = %s",
                        (b, ids[b]["personal"][0]),
                        prepare=True,
                    ).fetchall()
        assert compaction.is_alive() and not outcome  # still queued behind the lock
    finally:
        holder.rollback()
        holder.close()
        compaction.join(60)
    assert set(outcome) == set(PARTITIONED_TABLES) and all(size > 0 for size in outcome.values())
    assert store.open_texts(tenant_id=a, sources=[ids[a]["personal"]]) == {
        ids[a]["personal"]: "Alice drinks oolong tea now"
    }


def _wait_for_queued_vacuum(store: MemoryStore) -> None:
    with psycopg.connect(store.conninfo, autocommit=True) as probe:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            row = probe.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'VACUUM FULL %'"
            ).fetchone()
            if row and row[0]:
                return
            time.sleep(0.05)
    pytest.fail("the compaction never queued for its lock")


def _comparable(name: str, result: Any) -> Any:
    """What must be equal between two runs of a read (timestamps of the moment left out)."""
    if name == "export":
        return [line for line in result.splitlines() if '"exported_at"' not in line]
    if name == "summary" or name == "team_summary":
        return {k: v for k, v in result.items() if k != "created_at"}
    return result


def test_compaction_finishes_once_the_lock_is_released(store: MemoryStore, endpoints: Endpoints, tenant: str) -> None:
    _populate(store, tenant)
    holder = psycopg.connect(store.conninfo)
    try:
        holder.execute(
            sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(
                sql.SQL(table_partitions.tenant_partitions(holder, tenant)["derived.summaries"])
            )
        )
        # A lock not granted in time is a clear, typed error (the job retries later).
        with pytest.raises(table_partitions.CompactionLockTimeout, match=r"derived\.summaries"):
            table_partitions.compact_tenant(
                endpoints.store_conninfo, tenant, tables=["derived.summaries"], lock_timeout="200ms"
            )
        result: dict[str, Any] = {}
        worker = threading.Thread(
            target=lambda: result.update(table_partitions.compact_tenant(endpoints.store_conninfo, tenant)), daemon=True
        )
        worker.start()
        time.sleep(0.5)
        holder.rollback()
        worker.join(60)
        assert not worker.is_alive()
        assert set(result) == set(PARTITIONED_TABLES) and all(size > 0 for size in result.values())
    finally:
        holder.close()


# -- compaction, files, drop ------------------------------------------------------------------------


def _data_directory(conn: psycopg.Connection) -> Path | None:
    row = conn.execute("SHOW data_directory").fetchone()
    path = Path(row[0]) if row else None
    return path if path is not None and path.is_dir() else None  # an external server's is elsewhere


def _main_forks(files: list[str]) -> set[str]:
    return {f for f in files if "_" not in Path(f).name}


def test_compact_tenant_rewrites_only_that_tenants_files(
    store: MemoryStore, endpoints: Endpoints, tenant: str, other_tenant: str
) -> None:
    _populate(store, tenant)
    _populate(store, other_tenant)
    with psycopg.connect(store.conninfo, autocommit=True) as conn:
        data = _data_directory(conn)
        before, theirs = table_partitions.tenant_files(conn, tenant), table_partitions.tenant_files(conn, other_tenant)
        assert before and not set(before) & set(theirs)
        # Main forks of each partition, its TOAST table, their indexes (at least a key and the TOAST one).
        main = _main_forks(before)
        assert len(main) >= 4 * len(PARTITIONED_TABLES)
        if data is not None:
            assert all((data / f).is_file() for f in before)
        written = table_partitions.compact_tenant(endpoints.store_conninfo, tenant)
        assert set(written) == set(PARTITIONED_TABLES) and all(size > 0 for size in written.values())
        after = table_partitions.tenant_files(conn, tenant)
        # Every main fork moved to a new file (the rewrite); the other tenant's did not.
        assert not main & set(after)
        assert _main_forks(table_partitions.tenant_files(conn, other_tenant)) == _main_forks(theirs)
        if data is not None:
            assert all((data / f).is_file() for f in after)
        with pytest.raises(ValidationError):
            table_partitions.compact_tenant(endpoints.store_conninfo, tenant, tables=["memory.memories"])
        with pytest.raises(NotFoundError):
            table_partitions.compact_tenant(endpoints.store_conninfo, "t-never-" + uuid.uuid4().hex[:8])
    # Still the same rows, readable.
    assert store.list_visible(tenant_id=tenant, user_id="alice")[0]["text"] == "Alice drinks oolong tea now"


def test_drop_tenant_removes_its_partitions(store: MemoryStore, tenant: str, other_tenant: str) -> None:
    _populate(store, tenant)
    store.create_tenant(tenant_id=other_tenant)
    with psycopg.connect(store.conninfo, autocommit=True) as conn:
        names = table_partitions.tenant_partitions(conn, tenant)
        theirs = table_partitions.tenant_partitions(conn, other_tenant)
        # A drop interrupted after one detach (marked, no longer a partition) is finished too.
        parent, name = "derived.summaries", names["derived.summaries"]
        conn.execute(
            sql.SQL("COMMENT ON TABLE {} IS {}").format(
                sql.SQL(name), sql.Literal(table_partitions._DROP_MARK + tenant)
            )
        )
        conn.execute(sql.SQL("ALTER TABLE {} DETACH PARTITION {}").format(sql.SQL(parent), sql.SQL(name)))
        assert parent not in table_partitions.tenant_partitions(conn, tenant)
        assert table_partitions.drop_tenant(conn, tenant) == len(PARTITIONED_TABLES)
        assert table_partitions.tenant_partitions(conn, tenant) == {}
        assert _children(conn, tenant) == {}
        gone = conn.execute(
            "SELECT count(*) FROM unnest(%s::text[]) n WHERE to_regclass(n) IS NOT NULL", (list(names.values()),)
        )
        assert gone.fetchone() == (0,)
        assert table_partitions.tenant_partitions(conn, other_tenant) == theirs
        # A row for the tenant fails loudly: no DEFAULT partition to land in.
        with pytest.raises(psycopg.errors.CheckViolation, match="no partition"):
            conn.execute(
                "INSERT INTO keystore.tenant_keys (tenant_id, key_id, provider) VALUES (%s, 'tk_x', 'test')", (tenant,)
            )
        assert table_partitions.drop_tenant(conn, tenant) == 0
        table_partitions.ensure_tenant(conn, tenant)
        assert set(table_partitions.tenant_partitions(conn, tenant)) == set(PARTITIONED_TABLES)
    # Inside a transaction: dropped directly, and a rollback keeps them.
    with psycopg.connect(store.conninfo) as conn:
        with conn.transaction(force_rollback=True):
            assert table_partitions.drop_tenant(conn, tenant) == len(PARTITIONED_TABLES)
            assert table_partitions.tenant_partitions(conn, tenant) == {}
        assert set(table_partitions.tenant_partitions(conn, tenant)) == set(PARTITIONED_TABLES)
        assert table_partitions.drop_tenant(conn, tenant) == len(PARTITIONED_TABLES)
        conn.commit()


# -- the upgrade of a database in the old layout -------------------------------------------------


# The tables 0011 partitions (the others came later, partitioned from the start: build keys with 0015,
# group, version and retired keys with 0021, the analytics rows with 0023).
LATER_TABLES = (
    "keystore.build_keys",
    "keystore.group_keys",
    "keystore.version_keys",
    "keystore.retired_keys",
    "derived.analytics_rows",
)
OLD_LAYOUT_TABLES = tuple(t for t in PARTITIONED_TABLES if t not in LATER_TABLES)


def _all_rows(conn: psycopg.Connection) -> dict[str, list[tuple[Any, ...]]]:
    return {
        table: conn.execute(sql.SQL("SELECT * FROM {} ORDER BY 1, 2, 3, 4").format(sql.SQL(table))).fetchall()
        for table in OLD_LAYOUT_TABLES
    }


def _populate_old_layout(conn: psycopg.Connection, tenant_id: str) -> None:
    """Rows of the tenant in every table 0011 partitions, as the 0010 layout holds them. Written as
    SQL: today's store writes columns and tables of later migrations (key vaults, the consent
    journal), so it cannot write a 0010 database. Ciphertexts are opaque bytes here; reading rows
    wrapped the old way is tested in test_wal_keys (rotation of rows written before key vaults)."""
    blob = secrets.token_bytes
    conn.execute("INSERT INTO memory.tenants (tenant_id, sharing_mode) VALUES (%s, 'shared_pool')", (tenant_id,))
    for user in ("alice", "bob"):
        conn.execute("INSERT INTO memory.subjects (tenant_id, user_id) VALUES (%s, %s)", (tenant_id, user))
    conn.execute("INSERT INTO memory.teams (tenant_id, team_id) VALUES (%s, 'crew')", (tenant_id,))
    conn.execute(
        "INSERT INTO memory.team_members (tenant_id, team_id, user_id) VALUES (%s, 'crew', 'bob')", (tenant_id,)
    )
    conn.execute(
        "INSERT INTO keystore.tenant_keys (tenant_id, key_id, wrapped, provider) VALUES (%s, %s, %s, 'local')",
        (tenant_id, f"tk_{tenant_id}", blob(60)),
    )
    for user in ("alice", "bob"):
        conn.execute(
            "INSERT INTO keystore.subject_keys (tenant_id, user_id, key_id, tenant_key_id, wrapped)"
            " VALUES (%s, %s, %s, %s, %s)",
            (tenant_id, user, f"sk_{tenant_id}_{user}", f"tk_{tenant_id}", blob(60)),
        )
    conn.execute(
        "INSERT INTO keystore.team_keys (tenant_id, team_id, key_id, tenant_key_id, wrapped)"
        " VALUES (%s, 'crew', %s, %s, %s)",
        (tenant_id, f"tmk_{tenant_id}_crew", f"tk_{tenant_id}", blob(60)),
    )
    for memory_id, user, team, versions in (("m_" + "a" * 32, "alice", None, 2), ("m_" + "b" * 32, "bob", "crew", 1)):
        conn.execute(
            "INSERT INTO memory.memories (tenant_id, memory_id, user_id, team_id, memory_type, current_version)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            (tenant_id, memory_id, user, team, "personal" if team is None else "team_shared", versions),
        )
        for version in range(1, versions + 1):
            conn.execute(
                "INSERT INTO memory.memory_versions (tenant_id, memory_id, version, category, confidence, text_ct,"
                " text_mac, key_id, superseded_at) VALUES (%s, %s, %s, 'general', 0.8, %s, %s, %s,"
                " CASE WHEN %s THEN now() END)",
                (tenant_id, memory_id, version, blob(48), blob(32), f"sk_{tenant_id}_{user}", version < versions),
            )
            conn.execute(
                "INSERT INTO derived.keyword_postings (tenant_id, token_mac, memory_id, version)"
                " VALUES (%s, %s, %s, %s)",
                (tenant_id, blob(32), memory_id, version),
            )
    for scope, scope_id, key_id in (
        ("subject", "alice", f"sk_{tenant_id}_alice"),
        ("team", "crew", f"tmk_{tenant_id}_crew"),
    ):
        conn.execute(
            "INSERT INTO derived.summaries (tenant_id, scope, scope_id, mode, summary_ct, key_id, sources_hash,"
            " source_count, summarizer) VALUES (%s, %s, %s, 'hybrid', %s, %s, %s, 1, 'extractive')",
            (tenant_id, scope, scope_id, blob(64), key_id, blob(32)),
        )
    conn.execute(
        "INSERT INTO derived.prompt_snapshots (tenant_id, snapshot_id, run_id, subject_id, prompt_ct, key_id)"
        " VALUES (%s, %s, 'run-1', 'alice', %s, %s)",
        (tenant_id, "ps_" + secrets.token_hex(12), blob(40), f"sk_{tenant_id}_alice"),
    )


def test_migration_moves_rows_of_the_old_layout_into_partitions(
    store: MemoryStore, scratch_database: str, tmp_path: Path
) -> None:
    steps = {}
    for upto in (10, 11):
        steps[upto] = tmp_path / f"migrations-{upto}"
        steps[upto].mkdir()
        for version, _, path in migrations.available():
            if version <= upto:
                shutil.copy(path, steps[upto] / path.name)
    with psycopg.connect(scratch_database) as conn:
        assert migrations.migrate(conn, steps[10])[-1] == "0010_restore_sequence"
    with psycopg.connect(scratch_database) as conn:
        for tenant_id in ("acme", "globex"):
            _populate_old_layout(conn, tenant_id)
    with psycopg.connect(scratch_database) as conn:
        assert conn.execute("SELECT count(*) FROM pg_inherits").fetchone() == (0,)
        rows = _all_rows(conn)
        assert all(rows.values())
    with psycopg.connect(scratch_database) as conn:
        assert migrations.migrate(conn, steps[11]) == ["0011_tenant_partitions"]
    with psycopg.connect(scratch_database) as conn:
        assert _all_rows(conn) == rows
        for tenant_id in ("acme", "globex"):
            children = _children(conn, tenant_id, OLD_LAYOUT_TABLES)
            assert {parent: len(names) for parent, names in children.items()} == dict.fromkeys(OLD_LAYOUT_TABLES, 1)
            for parent, [child] in children.items():
                moved = conn.execute(sql.SQL("SELECT * FROM {} ORDER BY 1, 2, 3, 4").format(sql.SQL(child)))
                assert moved.fetchall() == [r for r in rows[parent] if r[0] == tenant_id], (tenant_id, parent)
        assert conn.execute("SELECT to_regclass('memory.memory_versions_pre0011')").fetchone() == (None,)
    # Every later migration applies on top, and the store writes and reads on the new layout.
    with psycopg.connect(scratch_database) as conn:
        migrations.migrate(conn)
    upgraded = MemoryStore(scratch_database, KeyStore(store.keys.master))
    try:
        with upgraded.transaction() as conn:
            for parent in OLD_LAYOUT_TABLES:
                count = conn.execute(
                    sql.SQL("SELECT count(*) FROM {} WHERE tenant_id = 'acme'").format(sql.SQL(parent))
                )
                assert count.fetchone() == (len([r for r in rows[parent] if r[0] == "acme"]),), parent
        upgraded.create_tenant(tenant_id="initech")
        written = upgraded.write(tenant_id="initech", user_id="carol", text="Carol joined after the upgrade")
        assert upgraded.open_texts(tenant_id="initech", sources=[(written.memory_id, 1)]) == {
            (written.memory_id, 1): "Carol joined after the upgrade"
        }
        with psycopg.connect(scratch_database) as conn:
            assert set(table_partitions.tenant_partitions(conn, "initech")) == set(PARTITIONED_TABLES)
    finally:
        upgraded.close()


def test_a_bulk_write_refreshes_the_planner_statistics_of_the_tenants_partitions(store, tenant):
    """Until autovacuum reaches a new partition the planner takes a bulk-loaded tenant for an empty
    one; `write_many` of ANALYZE_AFTER memories or more analyzes the tenant's partitions itself."""
    from memory_pipelines.lib.memories.bulk_write import FIRST_ANALYZE as ANALYZE_AFTER

    items = [{"user_id": f"u{i % 7}", "text": f"note {i} of {tenant}"} for i in range(ANALYZE_AFTER)]
    store.write_many(tenant_id=tenant, items=items)
    with store.transaction() as conn:
        part = table_partitions.tenant_partitions(conn, tenant)["memory.memory_versions"]
        analyzed, tuples = conn.execute(
            "SELECT s.last_analyze IS NOT NULL OR s.last_autoanalyze IS NOT NULL, c.reltuples"
            " FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid WHERE s.relid = %s::regclass",
            (part,),
        ).fetchone()
    assert analyzed and tuples == ANALYZE_AFTER
    with store.transaction() as conn:
        # The shared heads table too: the tenant's rows are in its statistics now.
        seen = conn.execute(
            "SELECT %s = ANY(most_common_vals::text::text[]) OR n_distinct < 0 FROM pg_stats"
            " WHERE schemaname = 'memory' AND tablename = 'memories' AND attname = 'tenant_id'",
            (tenant,),
        ).fetchone()
    assert seen is not None
