"""Derived stores against real external services started locally: a `chroma run` server and an
OpenAI-compatible summarizer; and what happens when either is down or answers garbage."""

from __future__ import annotations

import dagster as dg
import pytest

from memory_pipelines.defs.memories.assets import memories
from memory_pipelines.defs.stores.assets import STORE_ASSETS
from memory_pipelines.lib.infra.errors import ServiceError
from memory_pipelines.lib.stores.chroma.index import VectorStore
from memory_pipelines.lib.stores.embedding import HashingEmbedder
from memory_pipelines.lib.stores.summaries.store import OpenAICompatibleSummarizer, SummarizerError, SummaryStore
from memory_pipelines.resources import AnalyticsResource, ChromaResource, MemoryStoreResource, SummarizerResource
from tests.support.servers import FakeLLM, chroma_server, free_port

pytestmark = pytest.mark.slow


def test_chroma_server_sync_query_and_down(store, tenant, tmp_path):
    first = store.write(tenant_id=tenant, user_id="alice", text="Plays the cello in an orchestra")
    store.write(tenant_id=tenant, user_id="alice", text="Works as a tax accountant")
    with chroma_server(tmp_path / "chroma-server") as (url, _proc):
        vectors = VectorStore(embedder=HashingEmbedder(), url=url)
        assert vectors.sync(store=store, tenant_id=tenant) == {"records": 2, "embedded": 2, "removed": 0}
        store.write(tenant_id=tenant, user_id="alice", text="Plays the cello and the viola", memory_id=first.memory_id)
        assert vectors.sync(store=store, tenant_id=tenant) == {"records": 2, "embedded": 1, "removed": 1}
        hits = vectors.query(tenant_id=tenant, text="cello viola", limit=1, where={"user_id": "alice"})
        assert [source for source, _ in hits] == [(first.memory_id, 2)]
        assert vectors.check(store=store, tenant_id=tenant) == {
            "records": 2,
            "documents": 0,
            "without_lineage": 0,
            "not_current": 0,
        }
    # The server is gone: a clear error that names the store, not a stack of HTTP internals.
    with pytest.raises(ServiceError) as err:
        vectors.sync(store=store, tenant_id=tenant)
    assert err.value.field == "chroma" and url in err.value.message
    with pytest.raises(ServiceError, match="chroma"):
        VectorStore(embedder=HashingEmbedder(), url=f"http://127.0.0.1:{free_port()}").ids(tenant)


def test_ten_thousand_probe_vectors_reach_a_chroma_server_in_pages(store, tenant, tmp_path):
    """A run_batch of 100 subjects verifies with about 10,000 paraphrase probes; sent in one query
    the server refused them ("Payload too large") and the batch blocked."""
    import numpy as np

    store.write(tenant_id=tenant, user_id="alice", text="Plays the cello in an orchestra")
    with chroma_server(tmp_path / "chroma-server") as (url, _proc):
        vectors = VectorStore(embedder=HashingEmbedder(), url=url)
        vectors.sync(store=store, tenant_id=tenant)
        probes = list(np.random.default_rng(3).random((10_000, 384), dtype=np.float32))
        found = vectors.query_vectors(tenant_id=tenant, vectors=probes, limit=10)
    assert len(found) == 10_000 and all(len(hits) == 1 for hits in found)


def test_openai_compatible_summarizer_and_its_failures(store, tenant):
    store.write(tenant_id=tenant, user_id="alice", text="Prefers window seats")
    store.write(tenant_id=tenant, user_id="alice", text="Is allergic to peanuts", category="medical")
    with FakeLLM() as llm:
        summaries = SummaryStore(store, OpenAICompatibleSummarizer(base_url=llm.base_url, model="m", api_key="k"))
        summaries.set_mode(tenant_id=tenant, subject="alice", mode="summary")
        assert summaries.sync(tenant_id=tenant, scope="subject")["rebuilt"] == 1
        assert (
            summaries.read(tenant_id=tenant, scope="subject", scope_id="alice")["summary"] == "LLM summary of 2 facts"
        )
        assert llm.requests[-1]["auth"] == "Bearer k" and llm.requests[-1]["body"]["model"] == "m"

        # hybrid: medical stays verbatim, the rest goes to the LLM.
        summaries.set_mode(tenant_id=tenant, subject="alice", mode="hybrid")
        summaries.sync(tenant_id=tenant, scope="subject")
        hybrid = summaries.read(tenant_id=tenant, scope="subject", scope_id="alice")["summary"]
        assert hybrid == "LLM summary of 1 facts\n- Is allergic to peanuts"

        store.write(tenant_id=tenant, user_id="alice", text="Now prefers aisle seats")
        for mode, expected in (("garbage", "not a chat completion"), ("error", "HTTP 500"), ("empty", "empty")):
            llm.mode = mode
            with pytest.raises(SummarizerError, match=expected) as err:
                summaries.sync(tenant_id=tenant, scope="subject")
            assert err.value.field == "summarizer"
            # The previous summary stays, readable and unchanged.
            assert summaries.read(tenant_id=tenant, scope="subject", scope_id="alice")["summary"] == hybrid
    with pytest.raises(SummarizerError, match="cannot reach"):
        summaries.sync(tenant_id=tenant, scope="subject")


def test_summaries_asset_run_fails_clearly_when_the_endpoint_is_down(session_settings, store, tenant):
    store.write(tenant_id=tenant, user_id="alice", text="Learns Portuguese on Tuesdays")
    defs = dg.Definitions(
        assets=[memories, *(a for a in STORE_ASSETS if a.key == dg.AssetKey("subject_summaries"))],
        resources={
            "memory_store": MemoryStoreResource(home=str(session_settings.home)),
            "summarizer": SummarizerResource(base_url=f"http://127.0.0.1:{free_port()}/v1", model="m"),
            # Every store asset takes every store's resource; the summaries step makes only its own store.
            "chroma": ChromaResource(home=str(session_settings.home)),
            "analytics": AnalyticsResource(home=str(session_settings.home)),
        },
    )
    job = dg.define_asset_job("summaries_only", selection=["subject_summaries"])
    defs = dg.Definitions.merge(defs, dg.Definitions(jobs=[job]))
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [tenant])
        result = defs.resolve_job_def("summaries_only").execute_in_process(
            instance=instance, partition_key=tenant, raise_on_error=False
        )
        assert not result.success
        [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
        assert "summarizer: cannot reach" in failure.step_failure_data.error.to_string()
        assert result.get_asset_materialization_events() == []
