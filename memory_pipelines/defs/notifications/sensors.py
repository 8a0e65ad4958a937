from datetime import UTC, datetime

import dagster as dg

from memory_pipelines.defs.notifications.jobs import NOTIFY_JOB, notify_job
from memory_pipelines.defs.runs.sensors import NOT_ENDED
from memory_pipelines.lib.notify.outbox import due
from memory_pipelines.resources import MemoryStoreResource, NotifierResource


@dg.sensor(
    job=notify_job,
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="A `notify` run when deletion notices are due (new, or a failed one's retry time has come);"
    " skips while notifications are off (no MEMORY_PIPELINES_SMTP_HOST nor MEMORY_PIPELINES_NOTIFY_WEBHOOK_URL).",
)
def deletion_notifications_sensor(
    context: dg.SensorEvaluationContext, memory_store: MemoryStoreResource, notifier: NotifierResource
) -> dg.SensorResult | dg.SkipReason:
    channels = notifier.channels()
    if not channels:
        return dg.SkipReason("notifications are off: no SMTP host and no webhook URL is configured")
    now = datetime.now(UTC)
    waiting = due(db=memory_store.store(), channels=channels, events=notifier.settings().events, now=now)
    if not waiting:
        return dg.SkipReason("no notice is due")
    if context.instance.get_run_records(dg.RunsFilter(job_name=NOTIFY_JOB, statuses=NOT_ENDED), limit=1):
        return dg.SkipReason(f"{waiting} due; a notify run is already on its way")
    return dg.SensorResult(run_requests=[dg.RunRequest(run_key=f"notify:{now.strftime('%Y%m%dT%H%M%S')}")])
