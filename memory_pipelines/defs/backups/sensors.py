import dagster as dg

from memory_pipelines.defs.backups.jobs import restore_job
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.defs.stores.jobs import DERIVED_ASSETS
from memory_pipelines.launch.dagster_internals import backfill_request
from memory_pipelines.lib.backups.service import completed_restores, restores
from memory_pipelines.lib.forget.canary import is_reserved_tenant, retired_tenants
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
        if is_reserved_tenant(r["tenant_id"]):
            continue  # a canary drill restores its own tenant in its own run
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
    store = memory_store.store()
    done = completed_restores(store, after=after)
    graph = context.repository_def.asset_graph if context.repository_def is not None else None
    known = set(context.instance.get_dynamic_partitions(tenants_partitions.name or "tenants"))
    # A canary drill restores its tenant and offboards it before any tick: a backfill of a tenant that is
    # gone fails (its partitions are removed). Those restores are passed over, the cursor moves past them.
    gone = retired_tenants(store, sorted({r["tenant_id"] for r in done}))
    requests = []
    for r in done:
        tenant = r["tenant_id"]
        if tenant in gone:
            context.log.info(f"restore {r['restore_id']}: tenant {tenant} is gone (offboarded, internal): no backfill")
            continue
        # The sensor daemon turns this into a backfill (under Backfills) in the same tick that stores
        # the cursor, so each restore is backfilled once.
        requests.append(
            backfill_request(
                graph,  # type: ignore[arg-type]
                [dg.AssetKey(name) for name in REBUILT_ASSETS],
                tenant,
                tags={"memory_pipelines/restore_id": r["restore_id"], "memory_pipelines/tenant": tenant},
            )
        )
    # A live tenant restored before the partitions sensor saw it becomes a partition in this tick (the
    # daemon adds partitions before it stores the backfills).
    new = sorted({r["tenant_id"] for r in done} - gone - known)
    return dg.SensorResult(
        run_requests=requests,
        cursor=str(max((r["completion_seq"] for r in done), default=after)),
        dynamic_partitions_requests=[tenants_partitions.build_add_request(new)] if new else [],
    )
