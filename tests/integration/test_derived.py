"""Derived stores on real engines: lineage both ways, supersession, recall by sharing mode,
do-not-sell exclusion, and asset checks that fail when a store is corrupted on purpose."""

from __future__ import annotations

import dagster as dg
import pytest

from memory_pipelines.defs.memories.assets import memories
from memory_pipelines.defs.stores import assets as derived_assets
from memory_pipelines.lib.infra.errors import NotFoundError, PermissionDeniedError, ValidationError
from memory_pipelines.lib.stores import lineage
from memory_pipelines.lib.stores.derived import sync_embeddings, sync_keywords
from memory_pipelines.lib.stores.keyword import index as keyword_module
from memory_pipelines.resources import AnalyticsResource, ChromaResource, MemoryStoreResource, SummarizerResource

STORES = ("chroma", "keyword_index", "analytics", "subject_summaries")


@pytest.fixture
def team_tenant(store, tenant):
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="alice")
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="bob")
    return tenant


def test_lineage_both_ways_for_every_store(derived, store, team_tenant):
    tenant = team_tenant
    personal = store.write(tenant_id=tenant, user_id="alice", text="Alice rides a red bicycle to work")
    team = store.write(tenant_id=tenant, user_id="alice", text="The core team ships on Thursdays", team_id="core")
    derived.sync_all(tenant_id=tenant)
    hits = derived.recaller.recall(tenant_id=tenant, user_id="alice", query="bicycle commute", k=1)
    assert [h["memory_id"] for h in hits] == [personal.memory_id]

    forward = derived.lineage_of_memory(tenant_id=tenant, memory_id=personal.memory_id)
    by_store = {edge["store"]: edge for edge in forward}
    assert set(by_store) == {*STORES, "recall_cache"}
    assert {edge["version"] for edge in forward} == {1}
    assert by_store["chroma"]["record_id"] == f"{personal.memory_id}:1"
    assert by_store["subject_summaries"]["record_id"] == "subject:alice"
    team_edges = {e["store"]: e for e in derived.lineage_of_memory(tenant_id=tenant, memory_id=team.memory_id)}
    assert team_edges["team_summaries"]["record_id"] == "team:core"
    assert "subject_summaries" not in team_edges

    for edge in forward + list(team_edges.values()):
        back = derived.sources_of_record(tenant_id=tenant, record=f"{edge['store']}:{edge['record_id']}")
        assert {"memory_id": edge["memory_id"], "version": edge["version"]} in back["sources"]
    summary = derived.summaries.read(tenant_id=tenant, scope="team", scope_id="core")
    assert summary["sources"] == [{"memory_id": team.memory_id, "version": 1}]
    assert "Thursdays" in summary["summary"]


def test_a_new_version_supersedes_the_old_one_in_every_store(derived, store, tenant):
    first = store.write(tenant_id=tenant, user_id="alice", text="Favourite fruit is pomegranate")
    derived.sync_all(tenant_id=tenant)
    store.write(tenant_id=tenant, user_id="alice", text="Favourite fruit is now mango", memory_id=first.memory_id)
    counts = derived.sync_all(tenant_id=tenant)
    assert counts["memory_embeddings"]["embedded"] == 1 and counts["memory_embeddings"]["removed"] == 1
    assert counts["keyword_index"]["removed"] == 1

    edges = derived.lineage_of_memory(tenant_id=tenant, memory_id=first.memory_id)
    assert {e["version"] for e in edges} == {2}
    assert {e["store"] for e in edges} == set(STORES)
    assert derived.vectors.ids(tenant) == {f"{first.memory_id}:2"}
    assert derived.keywords.search(tenant_id=tenant, query="pomegranate", limit=5) == []
    assert [s for s, _ in derived.keywords.search(tenant_id=tenant, query="mango", limit=5)] == [(first.memory_id, 2)]
    table = derived.analytics.read_partition(tenant)
    assert table is not None and table["version"].to_pylist() == [2]
    summary = derived.summaries.read(tenant_id=tenant, scope="subject", scope_id="alice")["summary"]
    assert "mango" in summary and "pomegranate" not in summary


@pytest.mark.parametrize("mode", ["strict", "shared_pool", "progressive"])
def test_recall_follows_the_sharing_mode(derived, store, team_tenant, mode):
    tenant = team_tenant
    store.write(tenant_id=tenant, user_id="bob", text="Bob's private note: kayaking trip to Norway in June")
    store.write(tenant_id=tenant, user_id="bob", text="Bob shares: kayaking gear list for the team", shareable=True)
    store.write(tenant_id=tenant, user_id="bob", text="Team kayaking offsite is booked", team_id="core")
    store.write(tenant_id=tenant, user_id="alice", text="Alice went kayaking once and hated it")
    store.set_sharing_mode(tenant_id=tenant, sharing_mode=mode)
    derived.sync_all(tenant_id=tenant)
    expected_team = {
        "strict": set(),
        "shared_pool": {"Team kayaking offsite is booked"},
        "progressive": {"Team kayaking offsite is booked", "Bob shares: kayaking gear list for the team"},
    }[mode]
    for recall_mode in ("semantic", "keyword", "hybrid"):
        personal = derived.recaller.recall(tenant_id=tenant, user_id="alice", query="kayaking", k=10, mode=recall_mode)
        assert {h["text"] for h in personal} == {"Alice went kayaking once and hated it"}, recall_mode
        team = derived.recaller.recall(
            tenant_id=tenant, user_id="alice", team_id="core", query="kayaking", k=10, mode=recall_mode
        )
        assert {h["text"] for h in team} == expected_team, (mode, recall_mode)
        assert all("private" not in h["text"] for h in personal + team)


def test_recall_bad_input(derived, store, team_tenant):
    tenant = team_tenant
    store.write(tenant_id=tenant, user_id="carol", text="carol is not in core")
    cases = [
        (dict(user_id="alice", query="   "), ValidationError, "query"),
        (dict(user_id="alice", query="x", k=0), ValidationError, "k"),
        (dict(user_id="alice", query="x", k=101), ValidationError, "k"),
        (dict(user_id="alice", query="x", mode="fuzzy"), ValidationError, "mode"),
        (dict(user_id="carol", query="x", team_id="core"), PermissionDeniedError, "team"),
        (dict(user_id="alice", query="x", team_id="nope"), NotFoundError, "team"),
    ]
    for kwargs, error, field in cases:
        with pytest.raises(error) as err:
            derived.recaller.recall(tenant_id=tenant, **kwargs)
        assert err.value.field == field
    with pytest.raises(NotFoundError) as err:
        derived.recaller.recall(tenant_id="no-such-tenant-q", user_id="alice", query="x")
    assert err.value.field == "tenant"


def test_recall_cache_is_reused_until_a_source_changes(derived, store, tenant):
    written = store.write(tenant_id=tenant, user_id="alice", text="Keeps bees on the balcony")
    derived.sync_all(tenant_id=tenant)
    first = derived.recaller.recall(tenant_id=tenant, user_id="alice", query="bees", mode="keyword")
    second = derived.recaller.recall(tenant_id=tenant, user_id="alice", query="bees", mode="keyword")
    assert [h["cached"] for h in first + second] == [False, True]
    assert first[0]["memory_id"] == second[0]["memory_id"] == written.memory_id
    store.write(tenant_id=tenant, user_id="alice", text="Keeps bees and hens", memory_id=written.memory_id)
    derived.sync_all(tenant_id=tenant)
    third = derived.recaller.recall(tenant_id=tenant, user_id="alice", query="bees", mode="keyword")
    assert [(h["version"], h["cached"], h["text"]) for h in third] == [(2, False, "Keeps bees and hens")]


def test_do_not_sell_memories_never_reach_analytics(derived, store, tenant):
    store.write(tenant_id=tenant, user_id="alice", text="sellable fact")
    flagged = store.write(tenant_id=tenant, user_id="alice", text="private fact", do_not_sell=True)
    store.write(tenant_id=tenant, user_id="bob", text="bob opted out entirely")
    store.set_do_not_sell(tenant_id=tenant, user_id="bob", subject="bob")
    counts = derived.analytics.rebuild(store=store, tenant_id=tenant)
    assert counts == {"rows": 1, "excluded_do_not_sell": 2}
    table = derived.analytics.read_partition(tenant)
    assert flagged.memory_id not in table["memory_id"].to_pylist()
    assert "text" not in table.column_names and "user_id" not in table.column_names
    assert table["user_pseudonym"].to_pylist()[0] != "alice" and len(table["user_pseudonym"][0].as_py()) == 32
    assert derived.analytics.check(store=store, tenant_id=tenant)["do_not_sell_rows"] == 0


def test_analytics_sql_is_one_read_only_select(derived, store, tenant):
    store.write(tenant_id=tenant, user_id="alice", text="x marks the spot")
    derived.analytics.rebuild(store=store, tenant_id=tenant)
    result = derived.analytics.query("SELECT count(*) FROM memories", tenant_id=tenant)
    assert result["rows"] == [[1]]
    for bad in [
        "DROP VIEW memories",
        "SELECT 1; DROP VIEW memories",
        "COPY (SELECT 1) TO '/tmp/x.csv'",
        "INSERT INTO memories VALUES (1)",
        "",
        "SELEC 1",
    ]:
        with pytest.raises(ValidationError) as err:
            derived.analytics.query(bad, tenant_id=tenant)
        assert err.value.field == "sql"


def _checks_only(session_settings, tenant: str) -> dict[str, bool]:
    """Run only the derived stores' asset checks for one tenant, as the UI's 'execute checks' does."""
    home = str(session_settings.home)
    store_assets = derived_assets.STORE_ASSETS  # each with one or more checks, in the asset's own step
    assert {spec.name for a in store_assets for spec in a.check_specs} == {
        "embeddings_lineage_and_no_documents",
        "keyword_index_lineage",
        "subject_summaries_lineage",
        "team_summaries_lineage",
        "analytics_no_text_no_do_not_sell",
    }
    defs = dg.Definitions(
        assets=[memories, *store_assets],
        jobs=[dg.define_asset_job("checks_only", selection=dg.AssetSelection.checks_for_assets(*store_assets))],
        resources={
            "memory_store": MemoryStoreResource(home=home),
            "chroma": ChromaResource(home=home),
            "summarizer": SummarizerResource(),
            "analytics": AnalyticsResource(home=home),
        },
    )
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [tenant])
        # A checks-only selection has no assets to infer partitions from: pass the partition as a tag.
        result = defs.resolve_job_def("checks_only").execute_in_process(
            instance=instance, tags={"dagster/partition": tenant}
        )
        assert result.get_asset_materialization_events() == []  # checked, not synced
        return {e.check_name: e.passed for e in result.get_asset_check_evaluations()}


def test_asset_checks_fail_when_stores_are_corrupted_on_purpose(derived, store, session_settings, team_tenant):
    tenant = team_tenant
    mine = store.write(tenant_id=tenant, user_id="alice", text="Alice collects vinyl records")
    team_note = store.write(tenant_id=tenant, user_id="alice", text="Core uses trunk-based development", team_id="core")
    derived.sync_all(tenant_id=tenant)
    assert set(_checks_only(session_settings, tenant).values()) == {True}

    # Chroma: a vector with a document and no lineage.
    collection = derived.vectors.collection(tenant)
    collection.add(
        ids=["m_" + "0" * 32 + ":1"],
        embeddings=[[0.1] * 384],
        documents=["leaked text"],
        metadatas=[
            {
                "memory_id": "m_" + "0" * 32,
                "version": 1,
                "user_id": "x",
                "team_id": "",
                "shareable": False,
                "category": "general",
                "epoch": 0,
            }
        ],
    )
    # Keyword index: postings whose lineage was lost.
    with store.transaction() as conn:
        conn.execute("DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s", (tenant, keyword_module.STORE))
    # Summaries and analytics: the source changes and the copies are not rebuilt; a do-not-sell opt-out lands late.
    store.write(tenant_id=tenant, user_id="alice", text="Alice sold her vinyl", memory_id=mine.memory_id)
    store.write(tenant_id=tenant, user_id="alice", text="Core moved to release trains", memory_id=team_note.memory_id)
    store.write(tenant_id=tenant, user_id="alice", text="Alice's other hobby is chess", do_not_sell=False)
    derived.analytics.rebuild(store=store, tenant_id=tenant)
    store.set_do_not_sell(tenant_id=tenant, user_id="alice", subject="alice")

    results = _checks_only(session_settings, tenant)
    assert results == {
        "embeddings_lineage_and_no_documents": False,
        "keyword_index_lineage": False,
        "subject_summaries_lineage": False,
        "team_summaries_lineage": False,
        "analytics_no_text_no_do_not_sell": False,
    }

    # Re-syncing repairs what a sync can repair; the planted foreign vector needs the collection rebuilt.
    derived.vectors.reset(store=store, tenant_id=tenant)
    with store.transaction() as conn:
        conn.execute("DELETE FROM derived.keyword_postings WHERE tenant_id = %s", (tenant,))
    derived.sync_all(tenant_id=tenant)
    assert set(_checks_only(session_settings, tenant).values()) == {True}


def test_sync_helpers_drop_cached_recalls_when_an_index_changes(derived, store, tenant):
    store.write(tenant_id=tenant, user_id="alice", text="Drinks oat milk")
    derived.sync_all(tenant_id=tenant)
    derived.recaller.recall(tenant_id=tenant, user_id="alice", query="milk")
    store.write(tenant_id=tenant, user_id="alice", text="Drinks soy milk too")
    assert sync_keywords(store, tenant_id=tenant)["recall_cache_dropped"] == 1
    assert "recall_cache_dropped" in sync_embeddings(store, derived.vectors, tenant_id=tenant)


def test_a_sync_of_many_chunks_writes_each_once_and_a_forget_accepted_mid_sync_wins(derived, store, tenant):
    """Chunk writes overlap the next chunk's embedding on a server: every version lands once with its
    lineage, progress only grows, and a subject forgotten while chunks are still in flight ends with
    no vector once the cascade has run."""
    from memory_pipelines.lib.forget.deletion import DeletionService
    from memory_pipelines.lib.stores.chroma.sync import EMBED_CHUNK

    assert derived.vectors.url is not None  # the overlapped path is the server's
    count = 3 * EMBED_CHUNK + 100
    items = [{"user_id": f"user{i % 7}", "text": f"Note {i}: trains to Porto on day {i % 30}."} for i in range(count)]
    store.write_many(tenant_id=tenant, items=items)
    service = DeletionService(derived)
    seen: list[tuple[int, int]] = []
    jobs: list[str] = []

    def progress(done: int, total: int, unit: str) -> None:
        seen.append((done, total))
        if len(seen) == 1:  # the first chunk is written; later ones are being embedded or written
            jobs.append(service.request(tenant_id=tenant, subject="user3")["job_id"])

    counts = sync_embeddings(store, derived.vectors, tenant_id=tenant, progress=progress)
    assert counts["embedded"] == count
    assert [done for done, _ in seen] == sorted(done for done, _ in seen) and seen[-1] == (count, count)
    assert len(seen) == 4 and jobs
    assert derived.vectors.check(store=store, tenant_id=tenant) == {
        "records": len(derived.vectors.ids(tenant)),
        "documents": 0,
        "without_lineage": 0,
        "not_current": 0,
    }
    others = {i for i in range(count) if i % 7 != 3}
    assert len(derived.vectors.ids(tenant)) >= len(others)

    service.run_batch(tenant_id=tenant, job_ids=jobs)
    assert service.status(job_id=jobs[0])["state"] == "COMPLETE"
    left = {cv.record_id for cv in store.current_versions(tenant_id=tenant)}
    assert len(left) == len(others)
    assert derived.vectors.ids(tenant) == left  # user3's vectors are gone, every other one is there


def test_a_model_change_rebuilds_the_collection_and_never_mixes_vectors(
    derived, store, tenant, session_settings, endpoints
):
    from memory_pipelines.lib.stores.derived import open_derived
    from memory_pipelines.lib.stores.embedding import HashingEmbedder, MiniLMEmbedder

    written = [
        store.write(tenant_id=tenant, user_id="alice", text=f"Alice visits Porto in month {i}.") for i in range(5)
    ]
    full = open_derived(session_settings, store, embedder=MiniLMEmbedder(quantized=False), endpoints=endpoints)
    assert sync_embeddings(store, full.vectors, tenant_id=tenant)["embedded"] == 5
    sync_keywords(store, tenant_id=tenant)
    assert derived.vectors.existing(tenant).metadata["embedding_model"] == "all-MiniLM-L6-v2"

    # Before the rebuild: int8 queries may search float32 vectors of the same network ...
    hits = derived.recaller.recall(tenant_id=tenant, user_id="alice", query="Porto trip", k=2, mode="semantic")
    assert len(hits) == 2
    # ... but another network's queries get no semantic answer from them, and hybrid still answers by keyword.
    other = open_derived(session_settings, store, embedder=HashingEmbedder(), endpoints=endpoints)
    assert other.vectors.nearest(tenant_id=tenant, vector=HashingEmbedder().embed(["Porto"])[0], limit=3) == []
    hybrid = other.recaller.recall(
        tenant_id=tenant, user_id="alice", query="Porto", k=2, mode="hybrid", use_cache=False
    )
    assert len(hybrid) == 2

    counts = sync_embeddings(store, derived.vectors, tenant_id=tenant)  # the int8 model's sync
    assert counts["embedded"] == 5
    col = derived.vectors.existing(tenant)
    assert col.metadata["embedding_model"] == "all-MiniLM-L6-v2-int8"
    stored = derived.vectors.vectors_of(tenant, sorted(derived.vectors.ids(tenant)))
    expected = derived.vectors.embedder.embed([f"Alice visits Porto in month {i}." for i in range(5)])
    for n, memory in enumerate(written):
        # Every stored vector is the int8 model's (batch-mates move int8 vectors a little: cosine, not equality).
        assert float(stored[f"{memory.memory_id}:1"] @ expected[n]) > 0.999
    assert derived.vectors.check(store=store, tenant_id=tenant)["without_lineage"] == 0
    with store.transaction() as conn:
        edges = lineage.records_of_store(conn, tenant_id=tenant, store="chroma")
    assert sorted(edges) == sorted(f"{m.memory_id}:1" for m in written)
