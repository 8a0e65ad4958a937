from datetime import timedelta

import dagster as dg

from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.defs.retention.jobs import DAY_TAG, retention_job, retention_run_config


@dg.schedule(
    name="retention_schedule",
    job=retention_job,
    cron_schedule="0 2 * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Every day at 02:00 UTC: one `retention` run per tenant for the day that just ended.",
)
def retention_schedule(context: dg.ScheduleEvaluationContext) -> list[dg.RunRequest]:
    """One run request per tenant partition for yesterday (UTC), keyed so a tick never doubles it."""
    assert context.scheduled_execution_time is not None
    day = (context.scheduled_execution_time.date() - timedelta(days=1)).isoformat()
    tenants = context.instance.get_dynamic_partitions(tenants_partitions.name or "tenants")
    return [
        dg.RunRequest(
            run_key=f"retention:{day}:{tenant_id}",
            partition_key=tenant_id,
            run_config=retention_run_config(day=day),
            tags={DAY_TAG: day},
        )
        for tenant_id in sorted(tenants)
    ]
