import dagster as dg

from memory_pipelines.defs.memories.partitions import tenants_partitions

memories_snapshot_job = dg.define_asset_job(
    "memories_snapshot",
    selection=["memories"],
    partitions_def=tenants_partitions,
    description="Records the tenant's memory counts and store integrity as a `memories` materialization.",
)
