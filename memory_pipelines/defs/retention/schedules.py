import dagster as dg

from memory_pipelines.defs.retention.jobs import retention_job

daily_retention = dg.build_schedule_from_partitioned_job(
    retention_job,
    hour_of_day=2,
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Every day at 02:00 UTC: sweep the day that just ended.",
)
