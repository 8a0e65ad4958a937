"""Encrypted tenant backups and restores that cannot resurrect forgotten data.

A backup is a Parquet snapshot of the tenant's primary rows (memory text stays ciphertext under
each author's subject key), lineage and settings, tarred and sealed as one chunked AES-256-GCM
stream under a fresh object key. The object key is wrapped by the tenant key, so destroying the
tenant key shreds every backup of the tenant, and destroying a subject key leaves that subject's
rows unreadable in every backup. The key store is never part of a backup.

A backup is registered (IN_FLIGHT) before its snapshot is taken, so a deletion completing while it
uploads counts it among the backups that may hold its scope.

A restore closes the tenant's reads (the restore gate), loads the snapshot into temporary tables,
applies the deletion journal (subject epochs, tombstones, key destructions) and the consent journal
there, copies only what survives into the tenant's tables, replays and verifies again on them, and
only then reopens reads (lib/backups/restore_replay.py). A restore id names one restore of one tenant.

`BackupService` is assembled from one module per concern: taking.py (taking a backup), archive.py
(the sealed object and its manifest), listing.py (listing, looking up and expiring backups),
restore.py (requesting, running and reopening restores), restore_load.py (the load and replay
inside a restore's transaction); tables.py says what a backup holds.
"""

from __future__ import annotations

from pathlib import Path

from memory_pipelines.lib.backups.archive import FORMAT
from memory_pipelines.lib.backups.base import Hook
from memory_pipelines.lib.backups.restore import (
    RESTORE_ID_RE,
    BackupRestore,
    check_restore_id,
    completed_restores,
    restore_report,
    restored_sequences,
    restores,
)
from memory_pipelines.lib.backups.storage import BackupStorage, LocalBackupStorage, S3BackupStorage
from memory_pipelines.lib.backups.taking import BATCH_ROWS, BackupTaking
from memory_pipelines.lib.infra.home import staging_dir
from memory_pipelines.lib.memories.store import MemoryStore

__all__ = [
    "BATCH_ROWS",
    "FORMAT",
    "RESTORE_ID_RE",
    "BackupService",
    "Hook",
    "backup_service",
    "check_restore_id",
    "completed_restores",
    "restore_report",
    "restored_sequences",
    "restores",
]


class BackupService(BackupTaking, BackupRestore):
    """Backs tenants up to `storage`, lists and expires backups, and restores them safely."""

    def __init__(
        self,
        store: MemoryStore,
        storage: BackupStorage,
        *,
        staging: Path,
        days: int = 35,
        hooks: dict[str, Hook] | None = None,
    ) -> None:
        self.store = store
        self.storage = storage
        self.staging = staging
        self.days = days
        self.hooks = hooks or {}


def backup_service(
    store: MemoryStore,
    *,
    home: Path,
    s3_bucket: str | None = None,
    s3_prefix: str = "memory-pipelines/",
    s3_endpoint_url: str | None = None,
    days: int = 35,
) -> BackupService:
    """Backups in S3 when a bucket is given, else under HOME/backups; scratch files under HOME/backups/.staging."""
    storage: BackupStorage
    if s3_bucket:
        storage = S3BackupStorage(bucket=s3_bucket, prefix=s3_prefix, endpoint_url=s3_endpoint_url)
    else:
        storage = LocalBackupStorage(home / "backups")
    return BackupService(store, storage, staging=staging_dir(home), days=days)
