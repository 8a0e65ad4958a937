"""What a deletion's proof can claim in the deployment it ran in, target by target.

A deployment is which parts are ours (embedded, files on this machine) and which are services we
reach by URL: PostgreSQL, Chroma, the backups' storage, the master key. For each target the rows say
what the erasure proves there and what the operator must bound, with the settings that make each
hold. The erasure records the deployment in its report (`of`), every certificate renders the rows of
the one recorded (`rows`), and the table in docs/operating.md is checked against `ROWS` by a test.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from memory_pipelines.lib.infra.settings import (
    ENV_BACKUP_DAYS,
    ENV_CHROMA_URL,
    ENV_ERASURE_HOURS,
    ENV_KEY_VAULT,
    ENV_KMS_KEY_ID,
    ENV_PG_URL,
    ENV_S3_BUCKET,
    Settings,
)

__all__ = [
    "EMBEDDED",
    "EXTERNAL",
    "PARTS",
    "ROWS",
    "Row",
    "of",
    "rows",
]

EMBEDDED = "embedded"
EXTERNAL = "external"
# Each part a target depends on, and the setting that makes it external.
PARTS = {
    "postgres": ENV_PG_URL,
    "chroma": ENV_CHROMA_URL,
    "backups": ENV_S3_BUCKET,
    "masterKey": ENV_KMS_KEY_ID,
}


@dataclass(frozen=True)
class Row:
    target: str
    part: str  # a key of PARTS
    mode: str  # EMBEDDED or EXTERNAL
    proven: str
    operator_bounds: str
    settings: str


_PG_TARGET = "PostgreSQL rows: memories, keyword postings, summaries, prompt snapshots, analytics rows, keys"
ROWS: tuple[Row, ...] = (
    Row(
        _PG_TARGET,
        "postgres",
        EMBEDDED,
        "keys destroyed and the tenant's KEK rotated; rows absent by exact id; the tenant's partitions rewritten"
        " (VACUUM FULL), sampled statistics purged, old WAL segments removed; a byte scan of the data directory"
        " and pg_wal found no fingerprint",
        "free blocks and snapshots of the volume holding HOME/pg (see Limits)",
        f"no {ENV_PG_URL}",
    ),
    Row(
        _PG_TARGET,
        "postgres",
        EXTERNAL,
        "keys destroyed and the tenant's KEK rotated, so every sealed copy (text, queries, summaries, prompts,"
        " wrapped keys) is unreadable wherever it is; rows absent by exact id; the tenant's partitions rewritten."
        " Not proven: the server's files (not scanned)",
        "unsealed rows (ids, lineage, analytics pseudonyms, lengths, categories) stay in WAL archives,"
        " point-in-time backups, replicas and storage snapshots until they expire: keep their retention under"
        f" {ENV_ERASURE_HOURS} plus the provider's backup window, and say that window in the privacy notice",
        f"{ENV_PG_URL} (a role that owns the schemas)",
    ),
    Row(
        "Chroma vectors",
        "chroma",
        EMBEDDED,
        "vectors deleted and verified by exact id; the tenant's collection rebuilt, orphan segments removed, the"
        " SQLite log vacuumed; a byte scan of HOME/chroma found no fingerprint",
        "free blocks and snapshots of the volume holding HOME/chroma",
        f"no {ENV_CHROMA_URL}",
    ),
    Row(
        "Chroma vectors",
        "chroma",
        EXTERNAL,
        "vectors deleted through the API and verified by exact id; the collection rebuilt through the API."
        " Not proven: the server's files (not scanned; vectors are not sealed)",
        "the Chroma server's volume: its SQLite WAL, segment files and snapshots keep deleted vectors until"
        " compacted or expired; run it on a volume without snapshots, or expire them within the erasure deadline",
        f"{ENV_CHROMA_URL}, MEMORY_PIPELINES_CHROMA_TOKEN",
    ),
    Row(
        "Backups",
        "backups",
        EMBEDDED,
        "the scope's rows in every backup are sealed under destroyed keys (SHREDDED); a restore drops them by the"
        " journal; the archives under HOME/backups are byte-scanned",
        "copies of HOME/backups made outside the product",
        f"no {ENV_S3_BUCKET}; {ENV_BACKUP_DAYS}",
    ),
    Row(
        "Backups",
        "backups",
        EXTERNAL,
        "the scope's rows in every backup object are sealed under destroyed keys (SHREDDED); a restore drops them"
        " by the journal; expired objects are deleted. Not proven: the bucket's storage (not scanned)",
        "bucket versioning and replication keep replaced and deleted objects: expire noncurrent versions"
        f" (a lifecycle rule) within {ENV_BACKUP_DAYS}; objects stay sealed meanwhile",
        f"{ENV_S3_BUCKET}, MEMORY_PIPELINES_S3_ENDPOINT_URL; {ENV_BACKUP_DAYS}",
    ),
    Row(
        "Key-encryption keys (the vault)",
        "masterKey",
        EMBEDDED,
        "the rotated KEK's vault file replaced and byte-scanned, sealed by HOME/keys/master.key",
        "snapshots of the vault and the master key together would reopen the old KEK: keep neither in a volume"
        " snapshot",
        f"no {ENV_KMS_KEY_ID}; {ENV_KEY_VAULT} (default HOME/keys/vault)",
    ),
    Row(
        "Key-encryption keys (the vault)",
        "masterKey",
        EXTERNAL,
        "the rotated KEK's vault file replaced on the shared vault volume, sealed by the KMS key; the vault"
        " volume is byte-scanned when it is mounted on the host that erases",
        "snapshots of the vault volume: an old vault file and the KMS key reopen the old KEK; take no snapshots"
        " of it, or expire them within the erasure deadline",
        f"{ENV_KMS_KEY_ID}, {ENV_KEY_VAULT} (one volume shared by every host)",
    ),
)


def of(settings: Settings, *, postgres_files_ours: bool) -> dict[str, str]:
    """The deployment an erasure ran in: each part of PARTS, EMBEDDED or EXTERNAL.

    PostgreSQL counts as ours only when its data directory is readable here (the embedded server);
    a URL to a server on this machine whose files we cannot read is external."""
    return {
        "postgres": EMBEDDED if postgres_files_ours else EXTERNAL,
        "chroma": EXTERNAL if settings.chroma_url else EMBEDDED,
        "backups": EXTERNAL if settings.s3_bucket else EMBEDDED,
        "masterKey": EXTERNAL if settings.kms_key_id else EMBEDDED,
    }


def rows(deployment: Mapping[str, str]) -> list[Row]:
    """The rows of ROWS that hold in `deployment` (one per target), in ROWS' order."""
    return [row for row in ROWS if deployment.get(row.part) == row.mode]
