"""The backups recorded in control.backups: listing a tenant's, looking up one to restore, and
deleting those past their expiry."""

from __future__ import annotations

from datetime import UTC, datetime

from memory_pipelines.lib.backups.archive import SealedManifest, public, public_manifest
from memory_pipelines.lib.backups.storage import BackupStorage
from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import ConflictError, NotFoundError, ValidationError
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import BackupListing as Listing
from memory_pipelines.lib.results import BackupManifest, BackupsExpired

__all__ = [
    "BackupListing",
]


class BackupListing:
    """Lists and expires backups."""

    def __init__(self, store: MemoryStore, storage: BackupStorage) -> None:
        self.store = store
        self.storage = storage

    def list_backups(self, *, tenant_id: str) -> list[Listing]:
        """The tenant's backups, oldest first, in flight and failed ones included (ids and counts only)."""
        validation.check_id("tenant", tenant_id)
        with self.store.transaction() as conn:
            rows = conn.execute(
                "SELECT manifest, location, expired_at, state, snapshot_at FROM control.backups WHERE tenant_id = %s"
                " ORDER BY created_at",
                (tenant_id,),
            ).fetchall()
        # IN_FLIGHT: registered, snapshot being taken or uploaded (it may hold anything forgotten since).
        return [
            {
                **public(manifest),
                "location": location,
                "expired": expired is not None,
                "state": state,
                "snapshot_at": None if taken is None else taken.isoformat(),
            }
            for manifest, location, expired, state, taken in rows
        ]

    def sweep_expired(self, *, now: datetime | None = None) -> BackupsExpired:
        """Delete backups past their expiry (local ones; S3's lifecycle rule does the same there)."""
        now = now or datetime.now(UTC)
        with self.store.transaction() as conn:
            due = conn.execute(
                "SELECT backup_id, object_key, tenant_id FROM control.backups"
                " WHERE expired_at IS NULL AND expires_at <= %s",
                (now,),
            ).fetchall()
        for backup_id, object_key, tenant_id in due:
            self.storage.delete(object_key)
            self.storage.delete(f"{tenant_id}/{backup_id}.manifest.json")
            with self.store.transaction() as conn:
                conn.execute("UPDATE control.backups SET expired_at = %s WHERE backup_id = %s", (now, backup_id))
        return {"expired": len(due)}

    def find_backup(self, *, tenant_id: str, backup_id: str) -> BackupManifest:
        """The manifest (less its wrapped key) of the tenant's backup `backup_id` if it can be restored
        now: stored and not expired. Else ValidationError (malformed id, another tenant's backup),
        NotFoundError (unknown, failed or expired) or ConflictError (still being taken), naming `backup`."""
        return public_manifest(self.backup_row(tenant_id, backup_id))

    def backup_row(self, tenant_id: str, backup_id: str) -> SealedManifest:
        """The whole stored manifest (with its wrapped key) of a backup `find_backup` accepts; raises as it does."""
        validation.check_id("tenant", tenant_id)
        if not isinstance(backup_id, str) or not backup_id.startswith("b_") or len(backup_id) > 64:
            raise ValidationError("backup", f"malformed backup id {backup_id!r}")
        with self.store.transaction() as conn:
            row = conn.execute(
                "SELECT tenant_id, manifest, expired_at, state FROM control.backups WHERE backup_id = %s", (backup_id,)
            ).fetchone()
        if row is None:
            raise NotFoundError("backup", f"no backup {backup_id!r}")
        if row[0] != tenant_id:
            raise ValidationError("backup", f"backup {backup_id} belongs to another tenant, not {tenant_id!r}")
        if row[3] == "FAILED":
            raise NotFoundError("backup", f"backup {backup_id} failed before it was stored")
        if row[2] is not None:
            raise NotFoundError("backup", f"backup {backup_id} expired and was deleted")
        if row[3] != "DONE":
            raise ConflictError("backup", f"backup {backup_id} is still being taken; restore it once it is stored")
        stored: SealedManifest = row[1]  # the jsonb column, decoded: the manifest `backup` stored
        return stored.copy()
