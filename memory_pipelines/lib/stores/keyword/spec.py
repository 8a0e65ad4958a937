"""The blind keyword index: MACs of tokens, no plaintext at rest."""

from memory_pipelines.lib.stores.registry import StoreSpec

SPECS = (
    StoreSpec(
        name="keyword_index",
        owner="team:memory-platform",
        locator_key="(tenant, memory_id, version)",
        adapter_version="keyword-index-v2",
        max_completion_seconds=300,
        verification="no posting for a target; keyword probes return no target",
        adapter="memory_pipelines.lib.stores.keyword.adapter:KeywordIndexAdapter",
        order=40,
    ),
)
