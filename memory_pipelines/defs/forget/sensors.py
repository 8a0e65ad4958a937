import hashlib
from datetime import UTC, datetime, timedelta

import dagster as dg

from memory_pipelines.defs.forget.jobs import forget_job
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.lib.deletion import DeletionLedger
from memory_pipelines.resources import MemoryStoreResource

NEAR_DEADLINE = timedelta(days=3)


@dg.sensor(
    job=forget_job,
    minimum_interval_seconds=15,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Batches each tenant's pending deletion requests into one `forget` run (run_key per batch).",
)
def forget_requests_sensor(
    context: dg.SensorEvaluationContext,
    memory_store: MemoryStoreResource,
) -> dg.SensorResult:
    pending = DeletionLedger(memory_store.store()).pending(states=("REQUESTED",))
    known = set(context.instance.get_dynamic_partitions(tenants_partitions.name or "tenants"))
    requests = []
    for tenant_id, job_ids in sorted(pending.items()):
        batch = hashlib.sha256("\x1f".join(sorted(job_ids)).encode()).hexdigest()[:16]
        requests.append(
            dg.RunRequest(
                run_key=f"forget:{tenant_id}:{batch}",
                partition_key=tenant_id,
                run_config={"ops": {"forget_batch": {"config": {"job_ids": sorted(job_ids)}}}},
                tags={"forget/jobs": str(len(job_ids))},
            )
        )
    new = sorted(set(pending) - known)
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[tenants_partitions.build_add_request(new)] if new else [],
    )


@dg.sensor(
    minimum_interval_seconds=300,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Surfaces BLOCKED deletion jobs and open jobs within three days of their deadline.",
)
def deletion_alerts_sensor(
    context: dg.SensorEvaluationContext,
    memory_store: MemoryStoreResource,
) -> dg.SkipReason:
    ledger = DeletionLedger(memory_store.store())
    now = datetime.now(UTC)
    alerts = []
    for job in ledger.list_jobs():
        if job["state"] == "COMPLETE":
            continue
        deadline = datetime.fromisoformat(job["deadline"])
        if job["state"] == "BLOCKED" or deadline - now < NEAR_DEADLINE:
            failed = {store: status for store, status in job["targets"].items() if not status.startswith("DONE")}
            alerts.append(f"{job['job_id']} {job['state']} deadline {job['deadline']} {failed}")
    for alert in alerts:
        context.log.warning(f"deletion needs attention: {alert}")
    return dg.SkipReason(f"{len(alerts)} deletion job(s) need attention" + (": " + "; ".join(alerts) if alerts else ""))
