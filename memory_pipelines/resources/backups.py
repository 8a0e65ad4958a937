from pathlib import Path

import dagster as dg
from pydantic import Field

from memory_pipelines.lib.backups.service import BackupService, backup_service
from memory_pipelines.lib.forget.ledger import DeletionLedger
from memory_pipelines.lib.infra.settings import DEFAULT_BACKUP_DAYS, DEFAULT_HOME
from memory_pipelines.lib.memories.store import MemoryStore


class BackupResource(dg.ConfigurableResource):
    """Encrypted tenant backups: under `home`/backups by default, or in an S3 bucket (MinIO via endpoint)."""

    home: str = DEFAULT_HOME
    s3_bucket: str | None = Field(default=None, description="Bucket; unset keeps backups under HOME/backups")
    s3_prefix: str = "memory-pipelines/"
    s3_endpoint_url: str | None = Field(default=None, description="For MinIO or a local S3; unset for AWS")
    retention_days: int = Field(default=DEFAULT_BACKUP_DAYS, ge=1, description="Lifetime of a backup")

    def service(self, *, store: MemoryStore) -> BackupService:
        return backup_service(
            store,
            home=Path(self.home).resolve(),
            s3_bucket=self.s3_bucket,
            s3_prefix=self.s3_prefix,
            s3_endpoint_url=self.s3_endpoint_url,
            days=self.retention_days,
            job_records=DeletionLedger(store),
        )
