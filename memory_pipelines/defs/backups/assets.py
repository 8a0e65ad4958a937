import os

import dagster as dg

from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.lib.backups.catalog import catalog
from memory_pipelines.lib.infra import settings as env
from memory_pipelines.lib.infra.progress import throttled
from memory_pipelines.resources import BackupResource, MemoryStoreResource

# Newest first; a tenant keeps a backup a night for the expiry period (30 days by default).
SHOWN_BACKUPS = 60
BACKUPS_SCHEMA = dg.TableSchema(
    columns=[
        dg.TableColumn("backup_id", "string", description="The id a restore takes (launchpad: backup_id)"),
        dg.TableColumn("created_at", "string", description="When the snapshot was taken (UTC)"),
        dg.TableColumn("expires_at", "string", description="When the backup is deleted (UTC)"),
        dg.TableColumn("bytes", "int", description="Size of the encrypted object"),
        dg.TableColumn("memories", "int", description="Memories in the snapshot"),
        dg.TableColumn(
            "status",
            "string",
            description="AVAILABLE, IN_FLIGHT (being taken), FAILED, EXPIRED, or SHREDDED (tenant key destroyed)",
        ),
        dg.TableColumn("restorable", "bool", description="A restore can use it now"),
        dg.TableColumn(
            "subject_keys_shredded",
            "int",
            description="Subjects forgotten since: their rows stay unreadable and are dropped on restore",
        ),
    ]
)


def backups_table(rows: list[dict]) -> dg.TableMetadataValue:
    """The tenant's backups, newest first, as the `backups` metadata table (ids, dates, counts; no content)."""
    newest = list(reversed(rows))[:SHOWN_BACKUPS]
    records = [dg.TableRecord({col.name: row[col.name] for col in BACKUPS_SCHEMA.columns}) for row in newest]
    return dg.MetadataValue.table(records=records, schema=BACKUPS_SCHEMA)


def backup_kinds(s3_bucket: str | None) -> set[str]:
    """Where the encrypted Parquet archive goes: S3 when a bucket is configured, else files under HOME."""
    return {"parquet", "s3"} if s3_bucket else {"parquet", "file"}


def build_tenant_backups(kinds: set[str]) -> dg.AssetsDefinition:
    @dg.asset(
        name="tenant_backups",
        partitions_def=tenants_partitions,
        deps=["memories"],
        group_name="backups",
        tags={"domain": "backups"},
        kinds=kinds,
        owners=["team:memory-platform"],
        check_specs=[
            dg.AssetCheckSpec(
                "backup_object_stored",
                asset="tenant_backups",
                description="The backup's encrypted object is in the backup storage after the run.",
            )
        ],
    )
    def tenant_backups(
        context: dg.AssetExecutionContext, memory_store: MemoryStoreResource, backups: BackupResource
    ) -> dg.MaterializeResult:
        """Nightly encrypted snapshot of the tenant's memories; destroying the tenant key shreds it."""
        service = backups.service(store=memory_store.store())
        manifest = service.backup(tenant_id=context.partition_key, progress=throttled(context.log.info))
        swept = service.sweep_expired()
        stored = service.storage.exists(manifest["object"])
        listed = catalog(service, tenant_id=context.partition_key)
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
                # Where a restore from the UI finds its backup_id (the `restore` job's launchpad).
                "backups": backups_table(listed),
                "restorable_backups": dg.MetadataValue.int(sum(1 for r in listed if r["restorable"])),
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
