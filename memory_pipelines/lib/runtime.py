"""Builds a ready MemoryStore from Settings: services up, schema migrated, master key chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memory_pipelines.lib.infra.services import Endpoints, ensure_services
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.keys import KeyStore
from memory_pipelines.lib.memories.store import MemoryStore

if TYPE_CHECKING:  # backups load pyarrow: imported only by what takes or restores one
    from memory_pipelines.lib.backups.service import BackupService

__all__ = [
    "master_key",
    "open_backups",
    "open_store",
]


def master_key(settings: Settings) -> crypto.MasterKey:
    """KMS when MEMORY_PIPELINES_KMS_KEY_ID is set, else the local key file under HOME."""
    if settings.kms_key_id:
        import boto3

        return crypto.KmsMasterKey(settings.kms_key_id, boto3.client("kms"))
    return crypto.LocalMasterKey(settings.master_key_path)


def open_store(settings: Settings, endpoints: Endpoints | None = None) -> MemoryStore:
    endpoints = endpoints or ensure_services(settings)
    return MemoryStore(endpoints.store_conninfo, KeyStore(master_key(settings), vault=settings.key_vault_path))


def open_backups(settings: Settings, store: MemoryStore) -> BackupService:
    from memory_pipelines.lib.backups.service import backup_service
    from memory_pipelines.lib.forget.ledger import DeletionLedger

    return backup_service(
        store,
        home=settings.home,
        s3_bucket=settings.s3_bucket,
        s3_prefix=settings.s3_prefix,
        s3_endpoint_url=settings.s3_endpoint_url,
        days=settings.backup_days,
        job_records=DeletionLedger(store),
    )
