import dagster as dg
from pydantic import Field

from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.defs.runs.executors import leased_in_process
from memory_pipelines.lib.backups.catalog import catalog, check_backup_id
from memory_pipelines.lib.backups.service import BackupService
from memory_pipelines.lib.infra.errors import ConflictError, ValidationError
from memory_pipelines.lib.infra.progress import throttled
from memory_pipelines.resources import BackupResource, MemoryStoreResource

tenant_backups_job = dg.define_asset_job(
    "backup",
    selection=["tenant_backups"],
    description="Back one tenant up: an encrypted snapshot of its primary rows and lineage.",
    tags={"domain": "backups"},
)
# Backup ids a failed restore lists (newest first); the asset's `backups` table shows them all.
SHOWN_IDS = 20


class RestoreConfig(dg.Config):
    """Which backup to restore; the tenant is the run's partition."""

    backup_id: str = Field(
        default="",
        description="The backup to restore, e.g. b_20260101T013000_1a2b3c4d. The tenant's ids are in the"
        " `backups` table of its latest `tenant_backups` materialization (Assets > tenant_backups > this"
        " partition), or from `memory-pipelines backup list --tenant T`.",
    )
    restore_id: str | None = Field(
        default=None,
        description="Optional id for the restore report, r_ and up to 62 of a-z, 0-9, _ and -; empty: a new"
        " r_... id. An id that names another restore (of any tenant) is refused.",
    )


def require_restore_id(service: BackupService, tenant_id: str, backup_id: str, restore_id: str | None) -> None:
    """Fail the run before anything is touched when `restore_id` is malformed or names another restore."""
    if restore_id is None or restore_id == "":
        return
    try:
        service.check_restore_id(tenant_id=tenant_id, backup_id=backup_id, restore_id=restore_id)
    except (ValidationError, ConflictError) as exc:
        raise dg.Failure(
            description=f"restore_id: {exc.message}",
            metadata={"field": "restore_id"},
            allow_retries=False,
        ) from exc


def require_restorable(service: BackupService, tenant_id: str, backup_id: str) -> None:
    """Fail the run before anything is touched unless `backup_id` is one of the tenant's restorable
    backups; the failure names the field and lists the ids that would work."""
    rows = catalog(service, tenant_id=tenant_id)
    available = [r["backup_id"] for r in reversed(rows) if r["restorable"]]
    status = {r["backup_id"]: r["status"] for r in rows}
    try:
        check_backup_id(backup_id)
    except ValidationError as exc:
        problem = exc.message
    else:
        if backup_id in available:
            return
        problem = (
            f"backup {backup_id} of tenant {tenant_id!r} is {status[backup_id]}, not restorable"
            if backup_id in status
            else f"unknown backup id {backup_id!r} for tenant {tenant_id!r}"
        )
    shown = ", ".join(available[:SHOWN_IDS]) if available else "none (run the `backup` job first)"
    raise dg.Failure(
        description=f"backup_id: {problem}. Restorable backups of {tenant_id} (newest first): {shown}."
        " They are listed in the `backups` table of the tenant_backups asset's latest materialization.",
        metadata={"field": "backup_id", "available_backup_ids": dg.MetadataValue.json(available[:SHOWN_IDS])},
        allow_retries=False,
    )


@dg.op(tags={"domain": "backups"})
def restore_tenant(
    context: dg.OpExecutionContext, config: RestoreConfig, memory_store: MemoryStoreResource, backups: BackupResource
) -> dg.Output[dict]:
    """Load a backup behind the restore gate, replay the deletion and consent journals, verify, reopen reads."""
    service = backups.service(store=memory_store.store())
    require_restorable(service, context.partition_key, config.backup_id)
    require_restore_id(service, context.partition_key, config.backup_id, config.restore_id)
    report = service.restore(
        tenant_id=context.partition_key,
        backup_id=config.backup_id,
        restore_id=config.restore_id or None,
        progress=throttled(context.log.info),
    )
    replayed = report.get("replayed", {})
    owed = report.get("erasure_owed", {})
    metadata = {
        "state": dg.MetadataValue.text(report["state"]),
        "restore_id": dg.MetadataValue.text(report["restore_id"]),
        **{f"loaded_{t}": dg.MetadataValue.int(n) for t, n in report.get("loaded", {}).items()},
        **{f"removed_{reason}": dg.MetadataValue.int(n) for reason, n in replayed.get("rows_removed", {}).items()},
        # The safety net on the tenant's own tables: zero, or the jobs named below owe an erasure again.
        **{
            f"removed_after_load_{reason}": dg.MetadataValue.int(n)
            for reason, n in replayed.get("rows_removed_after_load", {}).items()
        },
        **{f"consent_{k}": dg.MetadataValue.int(n) for k, n in report.get("consent", {}).items()},
        **{f"left_{reason}": dg.MetadataValue.int(n) for reason, n in report.get("verification", {}).items()},
        **({"erasure_owed_jobs": dg.MetadataValue.json(owed.get("jobs", []))} if owed else {}),
    }
    if report["state"] != "COMPLETE":
        raise dg.Failure(description="restore verification found forgotten rows; reads stay closed", metadata=metadata)
    return dg.Output(dict(report), metadata=metadata)  # a plain dict, as `dg.Output[dict]` says


@dg.job(
    name="restore",
    partitions_def=tenants_partitions,
    executor_def=leased_in_process,
    description="Restore a tenant from a backup; forgotten data stays forgotten (journal replay).",
    tags={"domain": "backups"},
)
def restore_job() -> None:
    restore_tenant()
