"""The `memory_deletions` graph asset: one op per phase of the cascade, in `cascade.phases()` order
(freeze, a step per registered store, verify, prove), the same order `run_batch` runs in-process."""

import dagster as dg

from memory_pipelines.defs.forget.ops import phase_op
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.lib.forget.cascade import phases


def build_memory_deletions() -> dg.AssetsDefinition:
    """The forget graph over the stores registered now (a test may register more and build it again)."""
    first, *later = [phase_op(phase) for phase in phases()]

    @dg.graph_asset(
        name="memory_deletions",
        partitions_def=tenants_partitions,
        group_name="forget",
        kinds={"postgres"},
        owners=["team:memory-platform"],
        tags={"domain": "forget"},
    )
    def memory_deletions() -> None:
        """What the tenant has forgotten: its deletion jobs and their proofs."""
        job_ids = first()
        for op in later:  # registry order: copies first, the primary and the keys last; then verify, prove
            job_ids = op(job_ids)
        return job_ids

    return memory_deletions


memory_deletions = build_memory_deletions()
