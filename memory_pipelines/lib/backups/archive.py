"""The sealed backup object: a tar of one Parquet file per table, sealed as one chunked AES-256-GCM
stream under a fresh object key, which is wrapped by the tenant key; the manifest describes it.

Each seal is bound (associated data) to its tenant and backup id.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, NotRequired

from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.results import BackupManifest, BackupStub

__all__ = [
    "FORMAT",
    "PublicManifest",
    "SealedManifest",
    "StoredManifest",
    "object_aad",
    "public",
    "public_manifest",
    "sha256",
    "wrap_aad",
]

FORMAT = 1


def object_aad(tenant_id: str, backup_id: str) -> bytes:
    """The associated data binding a backup object's stream to its tenant and backup id."""
    return crypto.aad("backup-object", tenant_id, backup_id)


def wrap_aad(tenant_id: str, backup_id: str) -> bytes:
    """The associated data binding a backup's wrapped object key to its tenant and backup id."""
    return crypto.aad("backup-object-key", tenant_id, backup_id)


def sha256(path: Path) -> str:
    """The hex SHA-256 of the file at `path`, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


class SealedManifest(BackupManifest):
    """A stored backup's whole manifest, as `BackupService.backup` writes it: with the wrapped key."""

    wrapped_object_key: NotRequired[str]  # always written; NotRequired so that `public_manifest` drops it


class PublicManifest(BackupStub):
    """A manifest without its wrapped key: the stub of a backup in flight or failed, else the whole."""

    rows: NotRequired[dict[str, int]]
    key_ids: NotRequired[dict[str, Any]]
    bytes: NotRequired[int]
    sha256: NotRequired[str]
    snapshot_at: NotRequired[str]
    consent_snapshot: NotRequired[Any]


class StoredManifest(PublicManifest):
    """A manifest as control.backups holds it (the stub, then the sealed manifest)."""

    wrapped_object_key: NotRequired[str]


def public(manifest: StoredManifest) -> PublicManifest:
    """The manifest without the wrapped key (harmless, but of no use to a reader)."""
    public = manifest.copy()
    public.pop("wrapped_object_key", None)
    return public


def public_manifest(manifest: SealedManifest) -> BackupManifest:
    """`public` of a whole manifest."""
    public = manifest.copy()
    public.pop("wrapped_object_key", None)
    return public
