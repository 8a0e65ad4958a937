import dagster as dg

from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.resources import BackupResource, MemoryStoreResource

tenant_backups_job = dg.define_asset_job(
    "backup",
    selection=["tenant_backups"],
    description="Back one tenant up: an encrypted snapshot of its primary rows and lineage.",
)


class RestoreConfig(dg.Config):
    backup_id: str
    restore_id: str | None = None


@dg.op(tags={"domain": "backups"})
def restore_tenant(
    context: dg.OpExecutionContext, config: RestoreConfig, memory_store: MemoryStoreResource, backups: BackupResource
) -> dg.Output[dict]:
    """Load a backup behind the restore gate, replay the deletion journal, verify, reopen reads."""
    service = backups.service(store=memory_store.store())
    report = service.restore(tenant_id=context.partition_key, backup_id=config.backup_id, restore_id=config.restore_id)
    removed = report.get("replayed", {}).get("rows_removed", {})
    metadata = {
        "state": dg.MetadataValue.text(report["state"]),
        "restore_id": dg.MetadataValue.text(report["restore_id"]),
        **{f"loaded_{t}": dg.MetadataValue.int(n) for t, n in report.get("loaded", {}).items()},
        **{f"removed_{reason}": dg.MetadataValue.int(n) for reason, n in removed.items()},
        **{f"left_{reason}": dg.MetadataValue.int(n) for reason, n in report.get("verification", {}).items()},
    }
    if report["state"] != "COMPLETE":
        raise dg.Failure(description="restore verification found forgotten rows; reads stay closed", metadata=metadata)
    return dg.Output(report, metadata=metadata)


@dg.job(
    name="restore",
    partitions_def=tenants_partitions,
    executor_def=dg.in_process_executor,
    description="Restore a tenant from a backup; forgotten data stays forgotten (journal replay).",
    tags={"domain": "backups"},
)
def restore_job() -> None:
    restore_tenant()
