import dagster as dg
from dagster._core.definitions.assets.graph.asset_graph_subset import AssetGraphSubset
from dagster._core.definitions.events import AssetKeyPartitionKey

from memory_pipelines.defs.backups.jobs import restore_job
from memory_pipelines.defs.derived.jobs import DERIVED_ASSETS
from memory_pipelines.lib.backups import completed_restores, restores
from memory_pipelines.resources import MemoryStoreResource

REBUILT_ASSETS = ("memories", *DERIVED_ASSETS)


# By job name: a sensor holding the op job itself is rebuilt with resources at load, which makes
# this Dagster release emit a spurious BetaWarning about sensor owners.
@dg.sensor(
    job_name=restore_job.name,
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
                tags={"memory_pipelines/tenant": r["tenant_id"]},
            )
        )
    return dg.SensorResult(run_requests=requests)


@dg.sensor(
    minimum_interval_seconds=15,
    default_status=dg.DefaultSensorStatus.RUNNING,
    asset_selection=dg.AssetSelection.assets(*REBUILT_ASSETS),
    description="After each completed restore, launches one asset backfill of `memories` and every derived"
    " store for the restored tenant (cursor: the restores' commit sequence).",
)
def restored_tenants_backfill_sensor(
    context: dg.SensorEvaluationContext, memory_store: MemoryStoreResource
) -> dg.SensorResult:
    # Before migration 0010 the cursor was a completed_at timestamp; those restores have no sequence.
    after = int(context.cursor) if context.cursor and context.cursor.isdigit() else 0
    done = completed_restores(memory_store.store(), after=after)
    graph = context.repository_def.asset_graph if context.repository_def is not None else None
    requests = []
    for r in done:
        wanted = {AssetKeyPartitionKey(dg.AssetKey(name), r["tenant_id"]) for name in REBUILT_ASSETS}
        # A RunRequest with an asset graph subset: the sensor daemon turns it into a backfill (under
        # Backfills) in the same tick that stores the cursor, so each restore is backfilled once.
        requests.append(
            dg.RunRequest.for_asset_graph_subset(
                AssetGraphSubset.from_asset_partition_set(wanted, graph),  # type: ignore[arg-type]
                tags={"memory_pipelines/restore_id": r["restore_id"], "memory_pipelines/tenant": r["tenant_id"]},
            )
        )
    return dg.SensorResult(
        run_requests=requests,
        cursor=str(max((r["completion_seq"] for r in done), default=after)),
    )
