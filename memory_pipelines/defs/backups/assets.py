import os

import dagster as dg

from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.lib import settings as env
from memory_pipelines.resources import BackupResource, MemoryStoreResource


def backup_kinds(s3_bucket: str | None) -> set[str]:
    """Where the encrypted Parquet archive goes: S3 when a bucket is configured, else files under HOME."""
    return {"parquet", "s3"} if s3_bucket else {"parquet", "file"}


def build_tenant_backups(kinds: set[str]) -> dg.AssetsDefinition:
    @dg.asset(
        name="tenant_backups",
        partitions_def=tenants_partitions,
        deps=["memories"],
        group_name="backups",
        kinds=kinds,
        owners=["team:memory-platform"],
        check_specs=[dg.AssetCheckSpec("backup_object_stored", asset="tenant_backups")],
    )
    def tenant_backups(
        context: dg.AssetExecutionContext, memory_store: MemoryStoreResource, backups: BackupResource
    ) -> dg.MaterializeResult:
        """Nightly encrypted snapshot of the tenant's memories; destroying the tenant key shreds it."""
        service = backups.service(store=memory_store.store())
        manifest = service.backup(tenant_id=context.partition_key)
        swept = service.sweep_expired()
        stored = service.storage.exists(manifest["object"])
        context.log.info(f"backup {manifest['backup_id']} of {context.partition_key}: {manifest['bytes']} bytes")
        return dg.MaterializeResult(
            metadata={
                "backup_id": dg.MetadataValue.text(manifest["backup_id"]),
                "location": dg.MetadataValue.text(service.storage.location),
                "bytes": dg.MetadataValue.int(manifest["bytes"]),
                "expires_at": dg.MetadataValue.text(manifest["expires_at"]),
                "seconds": dg.MetadataValue.float(manifest["seconds"]),
                "expired_backups_removed": dg.MetadataValue.int(swept["expired"]),
                **{f"rows_{table}": dg.MetadataValue.int(n) for table, n in manifest["rows"].items()},
            },
            check_results=[
                dg.AssetCheckResult(
                    check_name="backup_object_stored",
                    passed=stored,
                    metadata={"object": dg.MetadataValue.text(manifest["object"])},
                )
            ],
        )

    return tenant_backups


@dg.definitions
def backup_assets() -> dg.Definitions:
    # Read when the code location loads (like defs/resources.py), not at import: the same settings
    # that pick the BackupResource's storage decide the kinds the UI shows.
    return dg.Definitions(assets=[build_tenant_backups(backup_kinds(os.environ.get(env.ENV_S3_BUCKET)))])
