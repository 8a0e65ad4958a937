import dagster as dg

from memory_pipelines.defs.forget.ops import STORE_OPS, freeze, prove, verify
from memory_pipelines.defs.memories.partitions import tenants_partitions


@dg.graph_asset(
    partitions_def=tenants_partitions,
    group_name="forget",
    kinds={"postgres"},
    owners=["team:memory-platform"],
    tags={"domain": "forget"},
)
def memory_deletions() -> None:
    """What the tenant has forgotten: its deletion jobs and their proofs."""
    job_ids = freeze()
    for store_op in STORE_OPS:  # registry order: copies first, the primary and the keys last
        job_ids = store_op(job_ids)
    return prove(verify(job_ids))
