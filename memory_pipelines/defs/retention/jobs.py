import dagster as dg

from memory_pipelines.defs.forget.jobs import deletion_service
from memory_pipelines.lib import retention
from memory_pipelines.resources import AnalyticsResource, ChromaResource, MemoryStoreResource, SummarizerResource

# Day partitions (UTC). The first one also covers nothing earlier: start it before the oldest data's
# retention ends, or backfill from here.
retention_days = dg.DailyPartitionsDefinition(start_date=retention.FIRST_DAY, end_offset=0)


@dg.op(tags={"domain": "retention"})
def retention_sweep(
    context: dg.OpExecutionContext,
    memory_store: MemoryStoreResource,
    chroma: ChromaResource,
    summarizer: SummarizerResource,
    analytics: AnalyticsResource,
) -> dg.Output[dict]:
    """Remove every memory whose retention ended on this day, through the forget cascade, with proofs."""
    service = deletion_service(memory_store, chroma, summarizer, analytics)
    result = retention.sweep(service, day=context.partition_key)
    by_category: dict[str, int] = {}
    for entry in result["jobs"].values():
        for category, count in entry["categories"].items():
            by_category[category] = by_category.get(category, 0) + count
    context.log.info(f"retention {result['date']}: {result['removed']} memories in {len(result['jobs'])} tenant(s)")
    return dg.Output(
        result,
        metadata={
            "removed": dg.MetadataValue.int(result["removed"]),
            "tenants": dg.MetadataValue.int(len(result["jobs"])),
            "policy_version": dg.MetadataValue.text(result["policy_version"]),
            "immediate_forget_jobs": dg.MetadataValue.int(sum(result["immediate_forget_jobs"].values())),
            **{f"removed_{c}": dg.MetadataValue.int(n) for c, n in sorted(by_category.items())},
        },
    )


@dg.job(
    name="retention",
    partitions_def=retention_days,
    executor_def=dg.in_process_executor,
    description="Retention sweep of one day: policies from assets/retention_policies.yaml; backfillable.",
    tags={"domain": "retention"},
)
def retention_job() -> None:
    retention_sweep()
