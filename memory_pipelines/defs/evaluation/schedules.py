import dagster as dg

from memory_pipelines.defs.evaluation.jobs import memory_evaluation_job

monthly_evaluation = dg.build_schedule_from_partitioned_job(
    memory_evaluation_job,
    day_of_month=1,
    hour_of_day=4,
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="On the 1st at 04:00: evaluate the month that just ended.",
)
