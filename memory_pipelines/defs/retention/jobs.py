from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg
from pydantic import Field

from memory_pipelines.defs.forget.checks import check_evaluation
from memory_pipelines.defs.forget.ops import (
    certificates,
    data_map_metadata,
    deletion_service,
    proof_metadata,
    report_forgotten,
)
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.defs.runs.executors import leased_in_process
from memory_pipelines.lib.forget import certificate
from memory_pipelines.lib.forget.deletion import DeletionLedger, DeletionService
from memory_pipelines.lib.retention import rules as retention
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
    before = _data_map(context, service, tenant_id)
    result = retention.sweep(service, day=day, tenant_id=tenant_id)
    entry = result["jobs"].get(tenant_id)
    categories: dict[str, int] = dict(entry["categories"]) if entry else {}
    job_ids = ([entry["job_id"]] if entry else []) + result["immediate_forget_job_ids"].get(tenant_id, [])
    states = {job_id: service.status(job_id=job_id)["state"] for job_id in job_ids}
    context.log.info(f"retention {result['date']} of {tenant_id}: {result['removed']} memories removed")
    metadata: dict[str, dg.MetadataValue] = {
        "retention_day": dg.MetadataValue.text(result["date"]),
        "policy_version": dg.MetadataValue.text(result["policy_version"]),
        "basis": dg.MetadataValue.text("retention"),
        "removed": dg.MetadataValue.int(result["removed"]),
        "immediate_forget_jobs": dg.MetadataValue.int(len(job_ids) - (1 if entry else 0)),
        "deletion_job_ids": dg.MetadataValue.json(job_ids),
        "deletion_states": dg.MetadataValue.json(states),
        **{f"category_{c}": dg.MetadataValue.int(n) for c, n in sorted(categories.items())},
    }
    if job_ids:
        # One asset tells what a tenant has forgotten, whoever asked: forget runs and retention sweeps,
        # each materialization with the proofs, certificates and data map a forget run attaches.
        proofs = [service.proof(job_id=j) for j, state in states.items() if state == "COMPLETE"]
        metadata.update(proof_metadata(proofs))
        metadata.update(certificates(service.jobs, proofs))
        metadata.update(data_map_metadata(context, service, tenant_id, before))
        context.log_event(dg.AssetMaterialization(asset_key="memory_deletions", partition=tenant_id, metadata=metadata))
        report_forgotten(context, tenant_id, job_ids, ["retention"], result["stores"].get(tenant_id, {}))
    # Nothing due: no event on `memory_deletions` (the run's own output says so), whose Partitions and
    # Events tabs would otherwise open on an empty sweep above the tenant's last forget.
    return dg.Output(
        {"tenant_id": tenant_id, **{k: v for k, v in result.items() if k not in ("stores",)}},
        metadata=metadata,
    )


def _data_map(context: dg.OpExecutionContext, service: DeletionService, tenant_id: str) -> dict[str, int] | None:
    try:
        return certificate.data_map(service.store, tenant_id)
    except Exception:  # the picture is informative only; it never fails a sweep
        context.log.warning("could not count the tenant's records for the data map")
        return None


@dg.op(tags={"domain": "retention"}, ins={"swept": dg.In(dg.Nothing)})
def deletions_checked(context: dg.OpExecutionContext, memory_store: MemoryStoreResource) -> None:
    """Evaluate the tenant's `deletions_on_track` check against its latest `memory_deletions`
    materialization, so the asset shows the check's result after a sweep too."""
    ledger = DeletionLedger(memory_store.store())
    # log_event takes check evaluations too (it dispatches on them), though its annotation omits them.
    context.log_event(check_evaluation(ledger, context.partition_key, context.instance))  # type: ignore[arg-type]


@dg.job(
    name=RETENTION_JOB,
    partitions_def=tenants_partitions,
    executor_def=leased_in_process,
    description="Retention sweep of one tenant and day (the day in run config and the `retention/day` tag);"
    " policies from assets/retention_policies.yaml.",
    tags={"domain": "retention"},
)
def retention_job() -> None:
    """One tenant's retention sweep of one day, then its `deletions_on_track` check."""
    deletions_checked(retention_sweep())
