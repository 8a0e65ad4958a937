import dagster as dg

canary_drill_job = dg.define_asset_job(
    "canary_drill",
    selection=["deletion_canary"],
    description="Write, copy, forget and hunt canary memories in an isolated tenant.",
    tags={"domain": "forget"},
)

weekly_canary_drill = dg.ScheduleDefinition(
    job=canary_drill_job,
    cron_schedule="0 3 * * 1",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Every Monday at 03:00: the end-to-end deletion canary drill.",
)
