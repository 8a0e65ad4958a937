"""Taking a backup: register it (IN_FLIGHT), snapshot the tenant's tables in one transaction, seal
the archive, upload it with its manifest, and mark it DONE (or FAILED, deleting what landed)."""

from __future__ import annotations

import base64
import json
import secrets
import tarfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq

from memory_pipelines.lib.backups import tables as backup_tables
from memory_pipelines.lib.backups.archive import (
    FORMAT,
    SealedManifest,
    object_aad,
    public_manifest,
    sha256,
    wrap_aad,
)
from memory_pipelines.lib.backups.base import BackupContext
from memory_pipelines.lib.infra import faults, validation
from memory_pipelines.lib.infra.errors import MemoryPipelinesError
from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.memories import consent, crypto
from memory_pipelines.lib.results import BackupTaken

__all__ = [
    "BATCH_ROWS",
    "BackupTaking",
]

BATCH_ROWS = 20_000


def _select(table: str, columns: list[tuple[str, pa.DataType]]) -> psycopg.sql.Composed:
    from psycopg import sql

    schema, name = table.split(".")
    return sql.SQL("SELECT {} FROM {}.{} WHERE tenant_id = %s ORDER BY 1").format(
        sql.SQL(", ").join(sql.Identifier(c) for c, _ in columns), sql.Identifier(schema), sql.Identifier(name)
    )


class BackupTaking:
    """Backs tenants up to the context's storage, each backup kept for the context's `days`."""

    def __init__(self, context: BackupContext) -> None:
        self.context = context
        self.store = context.store
        self.storage = context.storage
        self.days = context.days

    def backup(self, *, tenant_id: str, progress: Progress = no_progress) -> BackupTaken:
        """Snapshot, encrypt and store one tenant; returns the manifest (ids and counts only).
        `progress` hears of each chunk of rows dumped ("backup rows") and each table ("backup tables")."""
        validation.check_id("tenant", tenant_id)
        self.store.require_tenant(tenant_id=tenant_id)  # nothing is registered for a bad tenant
        self.storage.ensure_expiry(self.days)
        started = time.perf_counter()
        backup_id = "b_" + datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "_" + secrets.token_hex(4)
        created = self._register(tenant_id, backup_id)
        try:
            manifest = self._take(tenant_id, backup_id, created, progress)
        except BaseException:
            self._fail(tenant_id, backup_id)
            raise
        with self.store.transaction() as conn:
            conn.execute(
                "UPDATE control.backups SET state = 'DONE', manifest = %s, snapshot_at = %s WHERE backup_id = %s",
                (json.dumps(manifest), manifest["snapshot_at"], backup_id),
            )
        return {**public_manifest(manifest), "seconds": round(time.perf_counter() - started, 3)}

    def _register(self, tenant_id: str, backup_id: str) -> datetime:
        """Record the backup as IN_FLIGHT before its snapshot: from now on a proof counts it, and
        its expiry bounds its lifetime even if this process dies before the upload lands."""
        created = datetime.now(UTC)
        stub = {
            "format": FORMAT,
            "backup_id": backup_id,
            "tenant_id": tenant_id,
            "object": f"{tenant_id}/{backup_id}.bin",
            "created_at": created.isoformat(),
            "expires_at": (created + timedelta(days=self.days)).isoformat(),
        }
        with self.store.transaction() as conn:
            conn.execute(
                "INSERT INTO control.backups (backup_id, tenant_id, location, object_key, manifest, created_at,"
                " expires_at, state) VALUES (%s, %s, %s, %s, %s, %s, %s, 'IN_FLIGHT')",
                (
                    backup_id,
                    tenant_id,
                    self.storage.location,
                    stub["object"],
                    json.dumps(stub),
                    created,
                    created + timedelta(days=self.days),
                ),
            )
        return created

    def _fail(self, tenant_id: str, backup_id: str) -> None:
        """A backup that failed in flight: whatever landed is deleted, and it counts for nothing more."""
        try:
            for name in (f"{tenant_id}/{backup_id}.bin", f"{tenant_id}/{backup_id}.manifest.json"):
                self.storage.delete(name)
        except MemoryPipelinesError:
            return  # what landed stays until the expiry sweep deletes it: counted as in flight until then
        with self.store.transaction() as conn:
            conn.execute(
                "UPDATE control.backups SET state = 'FAILED', expired_at = now() WHERE backup_id = %s",
                (backup_id,),
            )

    def _take(self, tenant_id: str, backup_id: str, created: datetime, progress: Progress) -> SealedManifest:
        """Snapshot, seal and upload; returns the manifest."""
        with self.context.scratch(tenant_id) as scratch:
            snapshot = scratch / "snapshot"
            snapshot.mkdir()
            with self.store.transaction() as conn:
                # One snapshot for every table: a write between two dumps cannot split a memory
                # from its versions.
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                self.store.tenant_mode(conn, tenant_id)
                # The consent entries this snapshot saw; a restore replays every other one.
                seen = consent.snapshot(conn)
                snapshot_at = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
                tenant_key_id, tenant_key = self.store.keys.tenant_key(conn, tenant_id)
                rows: dict[str, int] = {}
                order = backup_tables.load_order()
                for name in order:
                    rows[name] = self._dump(conn, tenant_id, name, snapshot, progress, sum(rows.values()))
                    progress(len(rows), len(order), "backup tables")
                # The subject keys of the snapshot's authors (and the keys that sealed texts before
                # version keys): the catalog counts those destroyed since as subjects shredded.
                key_ids = sorted(
                    {
                        str(r[0])
                        for r in conn.execute(
                            "SELECT k.key_id FROM keystore.subject_keys k WHERE k.tenant_id = %(t)s AND EXISTS"
                            " (SELECT 1 FROM memory.memories m WHERE m.tenant_id = %(t)s AND m.user_id = k.user_id)"
                            " UNION SELECT DISTINCT key_id FROM memory.memory_versions"
                            " WHERE tenant_id = %(t)s AND key_id NOT LIKE 'vk\\_%%'",
                            {"t": tenant_id},
                        )
                    }
                )
            with self.store.transaction() as conn:
                conn.execute(
                    "UPDATE control.backups SET snapshot_at = %s WHERE backup_id = %s", (snapshot_at, backup_id)
                )
            faults.point("backup.snapshot_written")
            archive = scratch / "snapshot.tar"
            with tarfile.open(archive, "w") as tar:
                for name in order:
                    tar.add(snapshot / f"{name}.parquet", arcname=f"{name}.parquet")
            object_key = crypto.new_key()
            sealed = scratch / "backup.bin"
            with archive.open("rb") as src, sealed.open("wb") as dst:
                size = crypto.encrypt_stream(object_key, src, dst, object_aad(tenant_id, backup_id))
            digest = sha256(sealed)
            manifest: SealedManifest = {
                "format": FORMAT,
                "backup_id": backup_id,
                "tenant_id": tenant_id,
                "rows": rows,
                "key_ids": {"tenant_key": tenant_key_id, "subject_keys": key_ids},
                "wrapped_object_key": base64.b64encode(
                    crypto.seal(tenant_key, object_key, wrap_aad(tenant_id, backup_id))
                ).decode(),
                "object": f"{tenant_id}/{backup_id}.bin",
                "bytes": size,
                "sha256": digest,
                "created_at": created.isoformat(),
                "expires_at": (created + timedelta(days=self.days)).isoformat(),
                "snapshot_at": snapshot_at.isoformat(),
                "consent_snapshot": seen,
            }
            del object_key
            manifest_file = scratch / "manifest.json"
            manifest_file.write_text(json.dumps(manifest, indent=2))
            faults.point("backup.sealed")
            self.storage.put_file(str(manifest["object"]), sealed)
            faults.point("backup.object_uploaded")
            self.storage.put_file(f"{tenant_id}/{backup_id}.manifest.json", manifest_file)
        return manifest

    def _dump(
        self, conn: psycopg.Connection, tenant_id: str, name: str, folder: Path, progress: Progress, before: int
    ) -> int:
        table, columns = backup_tables.tables()[name]
        schema = pa.schema(columns)
        count = 0
        with (
            pq.ParquetWriter(folder / f"{name}.parquet", schema) as writer,
            conn.cursor(name=f"backup_{name}") as cur,
        ):
            cur.execute(_select(table, columns), (tenant_id,))
            while rows := cur.fetchmany(BATCH_ROWS):
                arrays = [pa.array([_plain(r[i]) for r in rows], type=dtype) for i, (_, dtype) in enumerate(columns)]
                writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=schema))
                count += len(rows)
                progress(before + count, None, "backup rows")
        return count


def _plain(value: Any) -> Any:
    return bytes(value) if isinstance(value, memoryview) else value
