import dagster as dg

from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.resources import MemoryStoreResource

OWNERS = ["team:memory-platform"]
INTEGRITY_CHECK = "store_integrity"


def stats_metadata(stats: dict) -> dict[str, dg.MetadataValue]:
    """Counts only: memory text never enters Dagster metadata."""
    metadata: dict[str, dg.MetadataValue] = {
        name: dg.MetadataValue.int(int(stats[name]))
        for name in ("memories", "personal", "team_shared", "versions", "subjects", "teams", "do_not_sell_memories")
    }
    metadata["sharing_mode"] = dg.MetadataValue.text(stats["sharing_mode"])
    metadata["by_category"] = dg.MetadataValue.json(stats["by_category"])
    return metadata


@dg.asset(
    partitions_def=tenants_partitions,
    group_name="memory_store",
    kinds={"postgres"},
    owners=OWNERS,
    tags={"domain": "memories"},
    check_specs=[
        dg.AssetCheckSpec(
            INTEGRITY_CHECK,
            asset="memories",
            description="One current version per memory; every version has its subject key.",
        )
    ],
)
def memories(context: dg.AssetExecutionContext, memory_store: MemoryStoreResource) -> dg.MaterializeResult:
    """Every memory of the tenant with its versions, encrypted per subject: the source of truth."""
    store = memory_store.store()
    tenant_id = context.partition_key
    stats = store.tenant_stats(tenant_id=tenant_id)
    problems = store.integrity_problems(tenant_id=tenant_id)
    context.log.info(f"tenant {tenant_id}: {stats['memories']} memories, {stats['versions']} versions")
    return dg.MaterializeResult(
        metadata=stats_metadata(stats),
        data_version=dg.DataVersion(str(stats["change_seq"])),
        check_results=[
            dg.AssetCheckResult(
                check_name=INTEGRITY_CHECK,
                passed=not any(problems.values()),
                metadata={name: dg.MetadataValue.int(count) for name, count in problems.items()},
            )
        ],
    )
