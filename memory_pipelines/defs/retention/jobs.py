from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg
from pydantic import Field

from memory_pipelines.defs.forget.ops import deletion_service, report_forgotten
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.lib import retention
from memory_pipelines.resources import AnalyticsResource, ChromaResource, MemoryStoreResource, SummarizerResource

RETENTION_JOB = "retention"
DAY_TAG = "retention/day"


class RetentionConfig(dg.Config):
    """The sweep's day; the tenant is the run's partition."""

    day: str = Field(default="", description="The day (UTC, YYYY-MM-DD) whose retention ended; empty: yesterday")


def retention_run_config(*, day: str) -> dict[str, Any]:
    """Run config of a `retention` run of one day (the tenant is the run's partition)."""
    return {"ops": {"retention_sweep": {"config": {"day": day}}}}


@dg.op(tags={"domain": "retention"})
def retention_sweep(
    context: dg.OpExecutionContext,
    config: RetentionConfig,
    memory_store: MemoryStoreResource,
    chroma: ChromaResource,
    summarizer: SummarizerResource,
    analytics: AnalyticsResource,
) -> dg.Output[dict]:
    """Remove the tenant's memories whose retention ended by the day, through the forget cascade, with proofs."""
    tenant_id = context.partition_key
    day = config.day or (datetime.now(UTC).date() - timedelta(days=1)).isoformat()
    service = deletion_service(memory_store, chroma, summarizer, analytics)
    result = retention.sweep(service, day=day, tenant_id=tenant_id)
    entry = result["jobs"].get(tenant_id)
    categories: dict[str, int] = dict(entry["categories"]) if entry else {}
    job_ids = ([entry["job_id"]] if entry else []) + result["immediate_forget_job_ids"].get(tenant_id, [])
    states = {job_id: service.status(job_id=job_id)["state"] for job_id in job_ids}
    context.log.info(f"retention {result['date']} of {tenant_id}: {result['removed']} memories removed")
    metadata = {
        "retention_day": dg.MetadataValue.text(result["date"]),
        "policy_version": dg.MetadataValue.text(result["policy_version"]),
        "basis": dg.MetadataValue.text("retention"),
        "removed": dg.MetadataValue.int(result["removed"]),
        "immediate_forget_jobs": dg.MetadataValue.int(len(job_ids) - (1 if entry else 0)),
        "deletion_job_ids": dg.MetadataValue.json(job_ids),
        "deletion_states": dg.MetadataValue.json(states),
        **{f"category_{c}": dg.MetadataValue.int(n) for c, n in sorted(categories.items())},
    }
    # One asset tells what a tenant has forgotten, whoever asked: forget runs and retention sweeps.
    context.log_event(dg.AssetMaterialization(asset_key="memory_deletions", partition=tenant_id, metadata=metadata))
    if job_ids:
        report_forgotten(context, tenant_id, job_ids, ["retention"], result["stores"].get(tenant_id, {}))
    return dg.Output(
        {"tenant_id": tenant_id, **{k: v for k, v in result.items() if k not in ("stores",)}},
        metadata=metadata,
    )


@dg.job(
    name=RETENTION_JOB,
    partitions_def=tenants_partitions,
    executor_def=dg.in_process_executor,
    description="Retention sweep of one tenant and day (the day in run config and the `retention/day` tag);"
    " policies from assets/retention_policies.yaml.",
    tags={"domain": "retention"},
)
def retention_job() -> None:
    """One tenant's retention sweep of one day."""
    retention_sweep()
