"""`Backups`: encrypted backups and safe restores."""

from __future__ import annotations

from memory_pipelines.lib.results import (
    BackupListing,
    BackupsExpired,
    BackupTaken,
    RestoreReport,
    RestoreRequest,
    TenantReopened,
)
from memory_pipelines.platform.parts import PlatformParts, check_tenant

__all__ = ["Backups"]


class Backups:
    """Encrypted backups and safe restores."""

    def __init__(self, parts: PlatformParts) -> None:
        self.parts = parts

    def backup(self, *, tenant_id: str) -> BackupTaken:
        """Back the tenant up now, encrypted; returns the manifest (backup_id, counts, expiry; no text)."""
        check_tenant(tenant_id)
        return self.parts.backups.backup(tenant_id=tenant_id)

    def restore(self, *, tenant_id: str, backup_id: str) -> RestoreReport:
        """Restore the tenant from a backup: journal replayed so forgotten data stays forgotten, verified.

        Returns the report; `state` is COMPLETE, or BLOCKED when verification failed (the tenant's
        rows are as before and it stays closed until a later restore succeeds). Recall rebuilds its
        indexes from the restored memories on its next call.
        """
        check_tenant(tenant_id)
        return self.parts.backups.restore(tenant_id=tenant_id, backup_id=backup_id)

    def list_backups(self, *, tenant_id: str) -> list[BackupListing]:
        """The tenant's backups, oldest first, in flight and failed ones included (ids and counts only)."""
        check_tenant(tenant_id)
        return self.parts.backups.list_backups(tenant_id=tenant_id)

    def sweep_backups(self) -> BackupsExpired:
        """Delete every tenant's backups past their expiry (S3's lifecycle rule does the same there)."""
        return self.parts.backups.sweep_expired()

    def request_restore(self, *, tenant_id: str, backup_id: str, restore_id: str | None = None) -> RestoreRequest:
        """Record a restore for the restore sensor to run; the backup and `restore_id` are checked now."""
        check_tenant(tenant_id)
        return self.parts.backups.request_restore(tenant_id=tenant_id, backup_id=backup_id, restore_id=restore_id)

    def check_restore(self, *, tenant_id: str, backup_id: str, restore_id: str | None = None) -> None:
        """Refuse a restore before it is launched elsewhere (a Dagster run): the backup must be the
        tenant's, stored and not expired, and `restore_id` (when given) free or this restore's own."""
        check_tenant(tenant_id)
        backups = self.parts.backups
        backups.find_backup(tenant_id=tenant_id, backup_id=backup_id)
        if restore_id is not None:
            backups.check_restore_id(tenant_id=tenant_id, backup_id=backup_id, restore_id=restore_id)

    def reopen_tenant(self, *, tenant_id: str) -> TenantReopened:
        """Open a tenant a BLOCKED restore left closed; its rows are those before that restore."""
        check_tenant(tenant_id)
        return self.parts.backups.reopen(tenant_id=tenant_id)
