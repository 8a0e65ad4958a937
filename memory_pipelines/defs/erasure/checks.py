from datetime import UTC, datetime

import dagster as dg

from memory_pipelines.defs.memories.partitions import check_result, tenant_asset_check
from memory_pipelines.lib.forget.erasure import ErasureLedger
from memory_pipelines.resources import MemoryStoreResource

CHECK = "erasures_on_time"
DESCRIPTION = (
    "Fails while a COMPLETE deletion of the tenant is past its physical-erasure deadline"
    " (MEMORY_PIPELINES_ERASURE_HOURS after completion, 24 by default) without a clean byte scan."
    " Evaluated after every physical_erasure run and by `erasures_on_time_sensor` every 5 minutes."
)
SHOWN_IDS = 20


def erasure_evaluation(ledger: ErasureLedger, tenant_id: str, now: datetime | None = None) -> dg.AssetCheckEvaluation:
    """The tenant's `erasures_on_time` evaluation: counts, ids and deadlines, never content."""
    now = now or datetime.now(UTC)
    pending = ledger.pending(tenant_id=tenant_id)
    overdue = [job for job in pending if job["erasure_deadline"] is not None and job["erasure_deadline"] < now]
    deadlines = [job["erasure_deadline"] for job in pending if job["erasure_deadline"] is not None]
    passed = not overdue
    return dg.AssetCheckEvaluation(
        asset_key=dg.AssetKey("physical_erasure"),
        check_name=CHECK,
        passed=passed,
        partition=tenant_id,
        severity=dg.AssetCheckSeverity.ERROR,
        description=None if passed else f"{len(overdue)} deletion(s) past their physical-erasure deadline",
        metadata={
            "pending_erasures": dg.MetadataValue.int(len(pending)),
            "overdue_erasures": dg.MetadataValue.int(len(overdue)),
            "next_deadline": dg.MetadataValue.text(min(deadlines).isoformat() if deadlines else "none"),
            "overdue_job_ids": dg.MetadataValue.json([job["job_id"] for job in overdue][:SHOWN_IDS]),
        },
    )


@tenant_asset_check(asset="physical_erasure", name=CHECK, description=DESCRIPTION)
def erasures_on_time(context: dg.AssetCheckExecutionContext, memory_store: MemoryStoreResource) -> dg.AssetCheckResult:
    return check_result(erasure_evaluation(ErasureLedger(memory_store.store()), context.partition_key))
