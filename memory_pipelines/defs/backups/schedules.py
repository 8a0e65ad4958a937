import dagster as dg

from memory_pipelines.defs.backups.jobs import tenant_backups_job
from memory_pipelines.defs.memories.partitions import tenants_partitions


@dg.schedule(
    job=tenant_backups_job,
    cron_schedule="30 1 * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Every night at 01:30: one encrypted backup per tenant.",
)
def nightly_backups(context: dg.ScheduleEvaluationContext) -> list[dg.RunRequest]:
    night = context.scheduled_execution_time.strftime("%Y-%m-%d")
    tenants = context.instance.get_dynamic_partitions(tenants_partitions.name or "tenants")
    return [dg.RunRequest(run_key=f"backup:{night}:{tenant}", partition_key=tenant) for tenant in sorted(tenants)]
