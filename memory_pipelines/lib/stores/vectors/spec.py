"""The Chroma vector index (ids and scope only, no text)."""

from memory_pipelines.lib.stores.registry import StoreSpec

SPECS = (
    StoreSpec(
        name="chroma",
        owner="team:memory-platform",
        locator_key="memory_id:version (collection per tenant)",
        adapter_version="chroma-v2",
        max_completion_seconds=600,
        verification="collection.get(ids=targets) is empty; paraphrase probes return no target",
        adapter="memory_pipelines.lib.stores.vectors.adapter:ChromaAdapter",
        order=30,
    ),
)
