import dagster as dg

from memory_pipelines.defs.backups.jobs import restore_job
from memory_pipelines.defs.derived.jobs import DERIVED_ASSETS
from memory_pipelines.lib.backups import restores
from memory_pipelines.resources import MemoryStoreResource


@dg.sensor(
    job=restore_job,
    minimum_interval_seconds=15,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Runs each requested restore (`restore` without --wait) once, as a `restore` run.",
)
def restore_requests_sensor(memory_store: MemoryStoreResource) -> dg.SensorResult:
    requests = []
    for r in restores(memory_store.store(), states=("REQUESTED",)):
        config = {"backup_id": r["backup_id"], "restore_id": r["restore_id"]}
        requests.append(
            dg.RunRequest(
                run_key=f"restore:{r['restore_id']}",
                partition_key=r["tenant_id"],
                run_config={"ops": {"restore_tenant": {"config": config}}},
            )
        )
    return dg.SensorResult(run_requests=requests)


@dg.sensor(
    minimum_interval_seconds=15,
    default_status=dg.DefaultSensorStatus.RUNNING,
    asset_selection=dg.AssetSelection.assets("memories", *DERIVED_ASSETS),
    description="After each finished restore, rebuilds every derived store of that tenant from the restored primary.",
)
def restored_tenants_backfill_sensor(
    context: dg.SensorEvaluationContext, memory_store: MemoryStoreResource
) -> dg.SensorResult:
    done = [r for r in restores(memory_store.store(), states=("COMPLETE",)) if r["completed_at"] is not None]
    fresh = [r for r in done if context.cursor is None or r["completed_at"].isoformat() > context.cursor]
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(run_key=f"backfill-after:{r['restore_id']}", partition_key=r["tenant_id"]) for r in fresh
        ],
        cursor=max((r["completed_at"].isoformat() for r in done), default=context.cursor),
    )
