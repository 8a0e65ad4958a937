import dagster as dg

from memory_pipelines.defs.backups.jobs import tenant_backups_job
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.lib.forget.canary import is_reserved_tenant
from memory_pipelines.resources import MemoryStoreResource


@dg.schedule(
    job=tenant_backups_job,
    cron_schedule="30 1 * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Every night at 01:30: one encrypted backup per tenant (offboarded and internal ones skipped).",
)
def nightly_backups(context: dg.ScheduleEvaluationContext, memory_store: MemoryStoreResource) -> list[dg.RunRequest]:
    night = context.scheduled_execution_time.strftime("%Y-%m-%d")
    tenants = sorted(context.instance.get_dynamic_partitions(tenants_partitions.name or "tenants"))
    # Partitions lag the store (the sensor deletes them later): back up only tenants that are live
    # now, not deleted or being offboarded, and never an internal one.
    live = {t["tenant_id"] for t in memory_store.store().tenants()}
    return [
        dg.RunRequest(
            run_key=f"backup:{night}:{tenant}", partition_key=tenant, tags={"memory_pipelines/tenant": tenant}
        )
        for tenant in tenants
        if tenant in live and not is_reserved_tenant(tenant)
    ]
