import dagster as dg

from memory_pipelines.defs.memories.partitions import check_result, tenant_asset_check
from memory_pipelines.launch.dagster_internals import AssetCheckEvaluationTargetMaterializationData, check_target
from memory_pipelines.lib.forget.deletion import NEAR_DEADLINE, DeletionLedger
from memory_pipelines.resources import MemoryStoreResource

CHECK = "deletions_on_track"
DESCRIPTION = (
    f"Fails while the tenant has a BLOCKED deletion job, or an open one within {NEAR_DEADLINE.days} days of its"
    " deadline or past it. Evaluated after every forget run and by `deletions_on_track_sensor` every 5 minutes."
)
# Job ids shown in the check's metadata; the counts are always complete.
SHOWN_IDS = 20
ASSET = dg.AssetKey("memory_deletions")


def latest_materialization(
    instance: dg.DagsterInstance, tenant_id: str
) -> AssetCheckEvaluationTargetMaterializationData | None:
    """The tenant's latest `memory_deletions` materialization, as the target of a check evaluation.

    The UI shows a partition's check result only when it targets the partition's latest
    materialization; an evaluation reported outside the check's own step must name it."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=ASSET, asset_partitions=[tenant_id]), limit=1
    ).records
    if not records:
        return None
    return check_target(records[0])


def check_evaluation(
    ledger: DeletionLedger, tenant_id: str, instance: dg.DagsterInstance | None = None
) -> dg.AssetCheckEvaluation:
    """The tenant's `deletions_on_track` evaluation: counts and job ids, never content. With the
    instance, it targets the tenant's latest materialization (reported by a sensor or another step)."""
    found = ledger.attention(tenant_id=tenant_id).get(
        tenant_id, {"open": 0, "blocked": [], "near_deadline": [], "overdue": []}
    )
    late = found["near_deadline"] + found["overdue"]
    passed = not found["blocked"] and not late
    return dg.AssetCheckEvaluation(
        asset_key=ASSET,
        check_name=CHECK,
        passed=passed,
        partition=tenant_id,
        target_materialization_data=None if instance is None else latest_materialization(instance, tenant_id),
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
