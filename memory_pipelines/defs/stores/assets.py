from typing import Any

import dagster as dg

from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.lib.infra.progress import throttled
from memory_pipelines.lib.stores.derived import sync_embeddings, sync_keywords
from memory_pipelines.lib.stores.summaries.store import SummaryStore
from memory_pipelines.resources import AnalyticsResource, ChromaResource, MemoryStoreResource, SummarizerResource

OWNERS = ["team:memory-platform"]
GROUP = "derived_stores"


# Every derived store: one partition per tenant, downstream of `memories`, follows it eagerly.
DERIVED: dict[str, Any] = {
    "deps": ["memories"],
    "partitions_def": tenants_partitions,
    "group_name": GROUP,
    "owners": OWNERS,
    "tags": {"domain": "derived"},
    "automation_condition": dg.AutomationCondition.eager(),
}


def _counts(counts: dict[str, int]) -> dict[str, dg.MetadataValue]:
    return {name: dg.MetadataValue.int(int(value)) for name, value in counts.items()}


@dg.asset(kinds={"chroma"}, **DERIVED)
def memory_embeddings(
    context: dg.AssetExecutionContext, memory_store: MemoryStoreResource, chroma: ChromaResource
) -> dg.MaterializeResult:
    """Vectors of every current memory for semantic recall (Chroma, ids and scope only, no text)."""
    vectors = chroma.vector_store()
    counts = sync_embeddings(
        memory_store.store(), vectors, tenant_id=context.partition_key, progress=throttled(context.log.info)
    )
    metadata = _counts(counts)
    metadata["embedding_model"] = dg.MetadataValue.text(vectors.embedder.name)
    return dg.MaterializeResult(metadata=metadata)


@dg.asset(kinds={"postgres"}, **DERIVED)
def keyword_index(context: dg.AssetExecutionContext, memory_store: MemoryStoreResource) -> dg.MaterializeResult:
    """Exact-token search over current memories, as keyed hashes of tokens (no plaintext at rest)."""
    counts = sync_keywords(memory_store.store(), tenant_id=context.partition_key)
    return dg.MaterializeResult(metadata=_counts(counts))


@dg.asset(kinds={"postgres"}, **DERIVED)
def subject_summaries(
    context: dg.AssetExecutionContext, memory_store: MemoryStoreResource, summarizer: SummarizerResource
) -> dg.MaterializeResult:
    """What the assistant knows about each user, summarised per their mode, encrypted under their key."""
    impl = summarizer.summarizer()
    counts = SummaryStore(memory_store.store(), impl).sync(tenant_id=context.partition_key, scope="subject")
    return dg.MaterializeResult(metadata={**_counts(counts), "summarizer": dg.MetadataValue.text(impl.name)})


@dg.asset(kinds={"postgres"}, **DERIVED)
def team_summaries(
    context: dg.AssetExecutionContext, memory_store: MemoryStoreResource, summarizer: SummarizerResource
) -> dg.MaterializeResult:
    """What each team has shared, summarised and encrypted under the team key."""
    impl = summarizer.summarizer()
    counts = SummaryStore(memory_store.store(), impl).sync(tenant_id=context.partition_key, scope="team")
    return dg.MaterializeResult(metadata={**_counts(counts), "summarizer": dg.MetadataValue.text(impl.name)})


@dg.asset(kinds={"parquet", "duckdb"}, **DERIVED)
def analytics_memories(
    context: dg.AssetExecutionContext, memory_store: MemoryStoreResource, analytics: AnalyticsResource
) -> dg.MaterializeResult:
    """Pseudonymised memory features for analysts (no text, no do-not-sell rows), Parquet per tenant."""
    store_impl = analytics.analytics()
    counts = store_impl.rebuild(store=memory_store.store(), tenant_id=context.partition_key)
    return dg.MaterializeResult(
        metadata={
            **_counts(counts),
            "path": dg.MetadataValue.path(str(store_impl.partition_file(context.partition_key))),
        }
    )
