import dagster as dg

from memory_pipelines.defs.memories.partitions import check_result, tenant_asset_check
from memory_pipelines.lib.deletion import NEAR_DEADLINE, DeletionLedger
from memory_pipelines.resources import MemoryStoreResource

CHECK = "deletions_on_track"
DESCRIPTION = (
    f"Fails while the tenant has a BLOCKED deletion job, or an open one within {NEAR_DEADLINE.days} days of its"
    " deadline or past it. Evaluated after every forget run and by `deletions_on_track_sensor` every 5 minutes."
)
# Job ids shown in the check's metadata; the counts are always complete.
SHOWN_IDS = 20


def check_evaluation(ledger: DeletionLedger, tenant_id: str) -> dg.AssetCheckEvaluation:
    """The tenant's `deletions_on_track` evaluation: counts and job ids, never content."""
    found = ledger.attention(tenant_id=tenant_id).get(
        tenant_id, {"open": 0, "blocked": [], "near_deadline": [], "overdue": []}
    )
    late = found["near_deadline"] + found["overdue"]
    passed = not found["blocked"] and not late
    return dg.AssetCheckEvaluation(
        asset_key=dg.AssetKey("memory_deletions"),
        check_name=CHECK,
        passed=passed,
        partition=tenant_id,
        severity=dg.AssetCheckSeverity.ERROR,
        description=None if passed else "deletions need attention: BLOCKED, near their deadline or overdue",
        metadata={
            "open_jobs": dg.MetadataValue.int(found["open"]),
            "blocked_jobs": dg.MetadataValue.int(len(found["blocked"])),
            "near_deadline_jobs": dg.MetadataValue.int(len(found["near_deadline"])),
            "overdue_jobs": dg.MetadataValue.int(len(found["overdue"])),
            "blocked_job_ids": dg.MetadataValue.json(found["blocked"][:SHOWN_IDS]),
            "late_job_ids": dg.MetadataValue.json(late[:SHOWN_IDS]),
        },
    )


@tenant_asset_check(asset="memory_deletions", name=CHECK, description=DESCRIPTION)
def deletions_on_track(
    context: dg.AssetCheckExecutionContext, memory_store: MemoryStoreResource
) -> dg.AssetCheckResult:
    return check_result(check_evaluation(DeletionLedger(memory_store.store()), context.partition_key))
