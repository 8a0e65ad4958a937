import dagster as dg
from pydantic import Field

from memory_pipelines.defs.derived.jobs import DERIVED_ASSETS
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.lib.deletion import DeletionService
from memory_pipelines.resources import (
    AnalyticsResource,
    ChromaResource,
    MemoryStoreResource,
    SummarizerResource,
    derived_stores,
)

TOUCHED_ASSETS = ("memories", *DERIVED_ASSETS)


class ForgetConfig(dg.Config):
    job_ids: list[str] = Field(
        default_factory=list, description="Deletion job ids; empty: every REQUESTED or BLOCKED job of the tenant"
    )


def deletion_service(
    memory_store: MemoryStoreResource,
    chroma: ChromaResource,
    summarizer: SummarizerResource,
    analytics: AnalyticsResource,
) -> DeletionService:
    return DeletionService(derived_stores(memory_store, chroma, summarizer, analytics))


@dg.op(tags={"domain": "forget"})
def forget_batch(
    context: dg.OpExecutionContext,
    config: ForgetConfig,
    memory_store: MemoryStoreResource,
    chroma: ChromaResource,
    summarizer: SummarizerResource,
    analytics: AnalyticsResource,
) -> dg.Output[dict]:
    """Runs a batch of deletion jobs for one tenant; every touched asset partition is reported."""
    tenant_id = context.partition_key
    service = deletion_service(memory_store, chroma, summarizer, analytics)
    job_ids = config.job_ids or service.pending(tenant_id=tenant_id, states=("REQUESTED", "BLOCKED")).get(tenant_id, [])
    context.log.info(f"forgetting {len(job_ids)} deletion job(s) for tenant {tenant_id}")
    result = service.run_batch(tenant_id=tenant_id, job_ids=job_ids)
    counts = {store: dg.MetadataValue.int(n) for store, n in result["stores"].items()}
    for asset in TOUCHED_ASSETS:
        # Counts only: the forget run itself purged and rebuilt these partitions.
        context.log_event(
            dg.AssetMaterialization(
                asset_key=asset,
                partition=tenant_id,
                metadata={"forget_jobs": dg.MetadataValue.int(len(result["jobs"])), **counts},
            )
        )
    return dg.Output(
        {"jobs": result["jobs"], "stores": result["stores"]},
        metadata={
            "jobs_completed": dg.MetadataValue.int(len(result["jobs"])),
            "seconds": dg.MetadataValue.json(result.get("seconds", {})),
            **counts,
        },
    )


@dg.job(
    name="forget",
    partitions_def=tenants_partitions,
    executor_def=dg.in_process_executor,
    description="Forget: cascade a batch of deletion jobs of one tenant through every store, verify, prove.",
    tags={"domain": "forget"},
)
def forget_job() -> None:
    forget_batch()
