"""The primary store: the memory versions themselves (sealed text and query), the source of every copy."""

from memory_pipelines.lib.stores.registry import PRIMARY, StoreSpec

SPECS = (
    StoreSpec(
        name="primary",
        owner="team:memory-platform",
        locator_key="(tenant, memory_id, version)",
        adapter_version="primary-v2",
        max_completion_seconds=300,
        verification="no memory_versions row of a target",
        adapter="memory_pipelines.lib.stores.primary.adapter:PrimaryAdapter",
        order=PRIMARY,
        derived=False,
    ),
)
