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

`BackupService` holds one part per concern, each built on what it needs: base.py (the context the
parts share: store, storage, scratch directory, retention, hooks), taking.py (taking a backup),
listing.py (listing, looking up and expiring backups), restore.py (requesting, running and reopening
restores, given the listing and the loading), restore_load.py (the load and replay inside a restore's
transaction); archive.py is the sealed object and its manifest, tables.py what a backup holds.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from memory_pipelines.lib.backups.archive import FORMAT
from memory_pipelines.lib.backups.base import BackupContext, Hook
from memory_pipelines.lib.backups.listing import BackupListing
from memory_pipelines.lib.backups.restore import (
    RESTORE_ID_RE,
    BackupRestore,
    check_restore_id,
    completed_restores,
    restore_report,
    restored_sequences,
    restores,
)
from memory_pipelines.lib.backups.restore_load import RestoreLoading
from memory_pipelines.lib.backups.restore_replay import JobRecords
from memory_pipelines.lib.backups.storage import BackupStorage, LocalBackupStorage, S3BackupStorage
from memory_pipelines.lib.backups.taking import BATCH_ROWS, BackupTaking
from memory_pipelines.lib.infra.home import staging_dir
from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import BackupListing as Listing
from memory_pipelines.lib.results import (
    BackupManifest,
    BackupsExpired,
    BackupTaken,
    RestoreReport,
    RestoreRequest,
    TenantReopened,
)

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


class BackupService:
    """Backs tenants up to `storage`, lists and expires backups, and restores them safely.

    A facade over its parts (`taking`, `listing`, `loading`, `restoring`), which share `context`. A
    restore that owes a deletion job its erasure again writes it through `job_records` (the deletion
    ledger, `lib/forget/ledger.py`'s DeletionLedger), required: a restore that owes one always has where to write it."""

    def __init__(
        self,
        store: MemoryStore,
        storage: BackupStorage,
        *,
        staging: Path,
        days: int = 35,
        hooks: dict[str, Hook] | None = None,
        job_records: JobRecords,
    ) -> None:
        self.context = BackupContext(store, storage, staging, days, hooks or {})
        self.taking = BackupTaking(self.context)
        self.listing = BackupListing(store, storage)
        self.loading = RestoreLoading(self.context)
        self.restoring = BackupRestore(
            self.context, listing=self.listing, loading=self.loading, job_records=job_records
        )

    @property
    def store(self) -> MemoryStore:
        """The memory store backed up and restored."""
        return self.context.store

    @property
    def storage(self) -> BackupStorage:
        """Where the sealed backups and their manifests are kept."""
        return self.context.storage

    @property
    def staging(self) -> Path:
        """The directory of scratch files."""
        return self.context.staging

    @property
    def days(self) -> int:
        """How many days a backup is kept."""
        return self.context.days

    @property
    def hooks(self) -> dict[str, Hook]:
        """Test hooks called between a restore's steps, by step name."""
        return self.context.hooks

    def backup(self, *, tenant_id: str, progress: Progress = no_progress) -> BackupTaken:
        """`BackupTaking.backup`: snapshot, encrypt and store one tenant."""
        return self.taking.backup(tenant_id=tenant_id, progress=progress)

    def list_backups(self, *, tenant_id: str) -> list[Listing]:
        """`BackupListing.list_backups`: the tenant's backups, oldest first."""
        return self.listing.list_backups(tenant_id=tenant_id)

    def sweep_expired(self, *, now: datetime | None = None) -> BackupsExpired:
        """`BackupListing.sweep_expired`: delete backups past their expiry."""
        return self.listing.sweep_expired(now=now)

    def find_backup(self, *, tenant_id: str, backup_id: str) -> BackupManifest:
        """`BackupListing.find_backup`: the manifest of a backup that can be restored now."""
        return self.listing.find_backup(tenant_id=tenant_id, backup_id=backup_id)

    def request_restore(self, *, tenant_id: str, backup_id: str, restore_id: str | None = None) -> RestoreRequest:
        """`BackupRestore.request_restore`: record a restore for the restore sensor to run."""
        return self.restoring.request_restore(tenant_id=tenant_id, backup_id=backup_id, restore_id=restore_id)

    def check_restore_id(self, *, tenant_id: str, backup_id: str, restore_id: str) -> str:
        """`BackupRestore.check_restore_id`: `restore_id` if it may name this restore now."""
        return self.restoring.check_restore_id(tenant_id=tenant_id, backup_id=backup_id, restore_id=restore_id)

    def restore(
        self,
        *,
        tenant_id: str,
        backup_id: str,
        restore_id: str | None = None,
        lock_timeout: float = 60.0,
        progress: Progress = no_progress,
    ) -> RestoreReport:
        """`BackupRestore.restore`: load a backup behind the restore gate, replay, verify, reopen."""
        return self.restoring.restore(
            tenant_id=tenant_id,
            backup_id=backup_id,
            restore_id=restore_id,
            lock_timeout=lock_timeout,
            progress=progress,
        )

    def reopen(self, *, tenant_id: str) -> TenantReopened:
        """`BackupRestore.reopen`: open a tenant whose gate a BLOCKED restore left closed."""
        return self.restoring.reopen(tenant_id=tenant_id)


def backup_service(
    store: MemoryStore,
    *,
    home: Path,
    s3_bucket: str | None = None,
    s3_prefix: str = "memory-pipelines/",
    s3_endpoint_url: str | None = None,
    days: int = 35,
    job_records: JobRecords,
) -> BackupService:
    """Backups in S3 when a bucket is given, else under HOME/backups; scratch files under HOME/backups/.staging;
    a restore's erasure owed written through `job_records`."""
    storage: BackupStorage
    if s3_bucket:
        storage = S3BackupStorage(bucket=s3_bucket, prefix=s3_prefix, endpoint_url=s3_endpoint_url)
    else:
        storage = LocalBackupStorage(home / "backups")
    return BackupService(store, storage, staging=staging_dir(home), days=days, job_records=job_records)
