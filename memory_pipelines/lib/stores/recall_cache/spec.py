"""The recall cache: answers cached by the versions they name and by asker."""

from memory_pipelines.lib.stores.registry import StoreSpec

__all__ = [
    "SPECS",
]

SPECS = (
    StoreSpec(
        name="recall_cache",
        owner="team:memory-platform",
        locator_key="lineage(recall_cache) -> cache_key; cached answers by the versions they name and by asker",
        adapter_version="recall-cache-v2",
        max_completion_seconds=60,
        verification="no cached answer naming a target version or asked by a forgotten subject",
        adapter="memory_pipelines.lib.stores.recall_cache.adapter:RecallCacheAdapter",
        order=10,
        sealed_by="nothing to seal: cached answers name ids and versions only, keyed by a MAC of the query",
        restore_drop="DELETE FROM derived.recall_cache WHERE tenant_id = %(t)s"
        " AND encode(cache_key, 'hex') = ANY(%(ids)s)",
    ),
)
