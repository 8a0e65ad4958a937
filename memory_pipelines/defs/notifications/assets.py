import dagster as dg

from memory_pipelines.lib.notify.outbox import deliver
from memory_pipelines.resources import MemoryStoreResource, NotifierResource


@dg.asset(
    group_name="forget",
    kinds={"postgres", "email"},
    owners=["team:memory-platform"],
    tags={"domain": "forget"},
    description="Notices that deletion jobs reached COMPLETE (and ERASED, if configured), delivered by email and/or"
    " a signed webhook: job id, scope hash, state and dates, never memory text or a subject id. Each"
    " materialization says what was delivered, what failed and will be retried, and what is left.",
)
def deletion_notifications(
    context: dg.AssetExecutionContext, memory_store: MemoryStoreResource, notifier: NotifierResource
) -> dg.MaterializeResult:
    settings = notifier.settings()
    result = deliver(db=memory_store.store(), channels=notifier.channels(), events=settings.events)
    for failure in result["failed"]:
        context.log.warning(
            f"{failure['channel']} notice of {failure['job_id']} ({failure['event']}) failed: {failure['error']};"
            f" next attempt at {failure['next_attempt_at']}"
        )
    context.log.info(f"delivered {len(result['delivered'])}, failed {len(result['failed'])}, left {result['pending']}")
    return dg.MaterializeResult(
        metadata={
            "channels": dg.MetadataValue.text(", ".join(result["channels"]) or "none (notifications are off)"),
            "delivered": dg.MetadataValue.int(len(result["delivered"])),
            "failed": dg.MetadataValue.int(len(result["failed"])),
            "pending": dg.MetadataValue.int(result["pending"]),
            "deliveries": dg.MetadataValue.json(result["delivered"]),
            "failures": dg.MetadataValue.json(result["failed"]),
        }
    )
