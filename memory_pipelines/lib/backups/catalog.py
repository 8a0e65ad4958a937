"""A tenant's backups as a restore chooser sees them: which ids exist and which can still be restored.

A backup can be restored once it is stored (not IN_FLIGHT: registered before its snapshot, still
being taken or uploaded; not FAILED), while it has not expired and the tenant key that wraps its
object key still exists; once that key is destroyed (the tenant crypto-shredded), the backup is unreadable
for good. Subject keys destroyed since the backup only leave those subjects' rows unreadable:
the backup stays restorable and the restore's journal replay drops them.
"""

from __future__ import annotations

import re
from typing import Any

from memory_pipelines.lib.backups.service import BackupService
from memory_pipelines.lib.infra.errors import ValidationError

__all__ = [
    "BACKUP_ID_RE",
    "catalog",
    "check_backup_id",
]

# As BackupService.backup names them: b_YYYYmmddTHHMMSS_<8 hex>.
BACKUP_ID_RE = re.compile(r"b_\d{8}T\d{6}_[0-9a-f]{8}")


def check_backup_id(value: object) -> str:
    """`value` if it has the form of a backup id, else a ValidationError naming `backup_id`."""
    if not isinstance(value, str) or not value:
        raise ValidationError("backup_id", "is required (a backup id such as b_20260101T013000_1a2b3c4d)")
    if not BACKUP_ID_RE.fullmatch(value):
        raise ValidationError("backup_id", f"malformed backup id {value[:80]!r}: expected b_YYYYmmddTHHMMSS_<8 hex>")
    return value


def catalog(service: BackupService, *, tenant_id: str) -> list[dict[str, Any]]:
    """The tenant's backups, oldest first: ids, sizes, dates and whether each can be restored (no text)."""
    backups = service.list_backups(tenant_id=tenant_id)
    subject_keys = sorted({k for b in backups for k in b.get("key_ids", {}).get("subject_keys", [])})
    with service.store.transaction() as conn:
        row = conn.execute("SELECT key_id FROM keystore.tenant_keys WHERE tenant_id = %s", (tenant_id,)).fetchone()
        alive = {
            r[0]
            for r in conn.execute(
                "SELECT key_id FROM keystore.subject_keys WHERE tenant_id = %(t)s AND key_id = ANY(%(k)s)"
                " UNION ALL SELECT key_id FROM keystore.retired_keys WHERE tenant_id = %(t)s AND key_id = ANY(%(k)s)",
                {"t": tenant_id, "k": subject_keys},
            )
        }
    tenant_key = row[0] if row else None
    rows = []
    for b in backups:
        keys = b.get("key_ids", {})
        shredded = keys.get("tenant_key") != tenant_key
        if b.get("state", "DONE") != "DONE":
            status = str(b["state"])  # IN_FLIGHT or FAILED
        elif b["expired"]:
            status = "EXPIRED"
        elif shredded:
            status = "SHREDDED"
        else:
            status = "AVAILABLE"
        rows.append(
            {
                "backup_id": b["backup_id"],
                "created_at": b["created_at"],
                "expires_at": b["expires_at"],
                "bytes": int(b.get("bytes", 0)),
                "memories": int(b.get("rows", {}).get("memories", 0)),
                "status": status,
                "restorable": status == "AVAILABLE",
                "subject_keys_shredded": sum(1 for k in keys.get("subject_keys", []) if k not in alive),
            }
        )
    return rows
