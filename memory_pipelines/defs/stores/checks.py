import warnings

import dagster as dg

from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.defs.stores.assets import (
    analytics_memories,
    keyword_index,
    memory_embeddings,
    subject_summaries,
    team_summaries,
)
from memory_pipelines.lib.stores.keyword.index import KeywordIndex
from memory_pipelines.lib.stores.summaries.store import ExtractiveSummarizer, SummaryStore
from memory_pipelines.resources import AnalyticsResource, ChromaResource, MemoryStoreResource

# Per-tenant checks need partitioned asset checks, a preview feature in this Dagster release.
warnings.filterwarnings("ignore", message="Specifying a partitions_def on an AssetCheckSpec", category=Warning)


def _result(problems: dict[str, int], *, must_be_zero: tuple[str, ...]) -> dg.AssetCheckResult:
    """Passes when every named count is zero; every count is shown (numbers only, never text)."""
    return dg.AssetCheckResult(
        passed=all(problems[name] == 0 for name in must_be_zero),
        metadata={name: dg.MetadataValue.int(int(value)) for name, value in problems.items()},
    )


@dg.asset_check(asset=memory_embeddings, partitions_def=tenants_partitions, blocking=False)
def embeddings_lineage_and_no_documents(
    context: dg.AssetCheckExecutionContext, memory_store: MemoryStoreResource, chroma: ChromaResource
) -> dg.AssetCheckResult:
    """Every vector has lineage and a current source version; Chroma holds no documents."""
    problems = chroma.vector_store().check(store=memory_store.store(), tenant_id=context.partition_key)
    return _result(problems, must_be_zero=("documents", "without_lineage", "not_current"))


@dg.asset_check(asset=keyword_index, partitions_def=tenants_partitions)
def keyword_index_lineage(
    context: dg.AssetCheckExecutionContext, memory_store: MemoryStoreResource
) -> dg.AssetCheckResult:
    """Every posting has lineage and a current source version."""
    problems = KeywordIndex(memory_store.store()).check(tenant_id=context.partition_key)
    return _result(problems, must_be_zero=("without_lineage", "not_current"))


def _summary_check(scope: str, memory_store: MemoryStoreResource, tenant_id: str) -> dg.AssetCheckResult:
    # Checking reads no summary text, so the summarizer behind the asset does not matter here.
    problems = SummaryStore(memory_store.store(), ExtractiveSummarizer()).check(tenant_id=tenant_id, scope=scope)
    return _result(problems, must_be_zero=("without_lineage", "from_non_current_versions"))


@dg.asset_check(asset=subject_summaries, partitions_def=tenants_partitions)
def subject_summaries_lineage(
    context: dg.AssetCheckExecutionContext, memory_store: MemoryStoreResource
) -> dg.AssetCheckResult:
    """Every subject summary has lineage, and only to current versions."""
    return _summary_check("subject", memory_store, context.partition_key)


@dg.asset_check(asset=team_summaries, partitions_def=tenants_partitions)
def team_summaries_lineage(
    context: dg.AssetCheckExecutionContext, memory_store: MemoryStoreResource
) -> dg.AssetCheckResult:
    """Every team summary has lineage, and only to current versions."""
    return _summary_check("team", memory_store, context.partition_key)


@dg.asset_check(asset=analytics_memories, partitions_def=tenants_partitions)
def analytics_no_text_no_do_not_sell(
    context: dg.AssetCheckExecutionContext, memory_store: MemoryStoreResource, analytics: AnalyticsResource
) -> dg.AssetCheckResult:
    """No text column, no do-not-sell row; every row has lineage and a current source version."""
    problems = analytics.analytics().check(store=memory_store.store(), tenant_id=context.partition_key)
    return _result(problems, must_be_zero=("text_columns", "do_not_sell_rows", "without_lineage", "not_current"))
