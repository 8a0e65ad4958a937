"""The sealed backup object: a tar of one Parquet file per table, sealed as one chunked AES-256-GCM
stream under a fresh object key, which is wrapped by the tenant key; the manifest describes it.

Each seal is bound (associated data) to its tenant and backup id.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from memory_pipelines.lib.memories import crypto

__all__ = [
    "FORMAT",
]

FORMAT = 1


def _object_aad(tenant_id: str, backup_id: str) -> bytes:
    return crypto.aad("backup-object", tenant_id, backup_id)


def _wrap_aad(tenant_id: str, backup_id: str) -> bytes:
    return crypto.aad("backup-object-key", tenant_id, backup_id)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _public(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest without the wrapped key (harmless, but of no use to a reader)."""
    return {k: v for k, v in manifest.items() if k != "wrapped_object_key"}
