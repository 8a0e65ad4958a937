"""Inside a restore's transaction: fetch and decrypt the backup, stage its rows, let both journals
filter them, publish the survivors and replay the journals again (the safety net).

What each step does in PostgreSQL is lib/backups/restore_replay.py's; this module runs them in
order and reports what they did.
"""

from __future__ import annotations

import base64
import tarfile
import time
from pathlib import Path

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq

from memory_pipelines.lib.backups import restore_replay
from memory_pipelines.lib.backups import tables as backup_tables
from memory_pipelines.lib.backups.archive import SealedManifest, object_aad, wrap_aad
from memory_pipelines.lib.backups.base import BackupContext
from memory_pipelines.lib.infra import faults
from memory_pipelines.lib.infra.errors import MemoryPipelinesError, NotFoundError, ValidationError
from memory_pipelines.lib.infra.progress import Progress
from memory_pipelines.lib.memories import crypto, ordering
from memory_pipelines.lib.results import RestoreReport
from memory_pipelines.lib.stores import bytescan

__all__ = [
    "RestoreLoading",
]


class RestoreLoading:
    """Loads a backup into a tenant within the restore's transaction."""

    def __init__(self, context: BackupContext) -> None:
        self.context = context
        self.store = context.store

    def fetch_and_open(self, manifest: SealedManifest, scratch: Path) -> dict[str, pa.Table]:
        """Fetch and decrypt the backup into `scratch` and open each of its tables (empty for a store
        registered since); fails before anything is loaded."""
        archive = self.fetch_archive(manifest, scratch)
        faults.point("restore.fetched")
        folder = scratch / "snapshot"
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
        opened = {}
        for name in backup_tables.load_order():
            file = folder / f"{name}.parquet"
            if not file.exists() and name in backup_tables.store_tables():
                # A store registered after this backup was taken: it held nothing of the store then.
                columns = backup_tables.tables()[name][1]
                opened[name] = pa.schema([pa.field(column, kind) for column, kind in columns]).empty_table()
            else:
                opened[name] = pq.read_table(file)
        return opened

    def fetch_archive(self, manifest: SealedManifest, scratch: Path) -> Path:
        """Download and decrypt the backup object into `scratch`; fails before anything is loaded."""
        tenant_id, backup_id = manifest["tenant_id"], manifest["backup_id"]
        with self.store.transaction() as conn:
            try:
                _, tenant_key = self.store.keys.tenant_key(conn, tenant_id, create=False)
            except MemoryPipelinesError as exc:
                raise NotFoundError(
                    "backup", f"backup {backup_id} is unreadable: the tenant key was destroyed (crypto-shredded)"
                ) from exc
        try:
            object_key = crypto.open_sealed(
                tenant_key, base64.b64decode(manifest["wrapped_object_key"]), wrap_aad(tenant_id, backup_id)
            )
        except crypto.DecryptionError as exc:
            raise ValidationError("backup", f"backup {backup_id}: its object key does not unwrap") from exc
        sealed = scratch / "backup.bin"
        self.context.storage.get_file(manifest["object"], sealed)
        archive = scratch / "snapshot.tar"
        try:
            with sealed.open("rb") as src, archive.open("wb") as dst:
                crypto.decrypt_stream(object_key, src, dst, object_aad(tenant_id, backup_id))
        except crypto.DecryptionError as exc:
            raise ValidationError(
                "backup", f"backup {backup_id} failed authentication ({exc}); nothing was loaded"
            ) from exc
        return archive

    def load_and_replay(
        self,
        conn: psycopg.Connection,
        tenant_id: str,
        manifest: SealedManifest,
        tables: dict[str, pa.Table],
        report: RestoreReport,
        owed: restore_replay.Owed,
        progress: Progress,
    ) -> None:
        """Stage, filter by both journals, publish the survivors, then the safety net; fills `report`."""
        # The gate lock again, held to commit: every journal writer takes it, so the journal the
        # staged rows were filtered by is the one the published rows meet (lib/backups/restore_replay.py).
        ordering.lock_tenant_exclusive(conn, tenant_id)
        clock = [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return round(clock[-1] - clock[-2], 3)

        seconds: dict[str, float] = {}
        report["loaded"] = self._load(conn, tenant_id, tables, progress)
        seconds["stage"] = lap()
        self.context.hook("loaded")
        clock[-1] = time.perf_counter()  # a test's hook is no step of the restore
        removed, report["consent"] = restore_replay.filter_staged(
            conn, tenant_id, since=manifest.get("consent_snapshot")
        )
        seconds["filter"] = lap()
        self.context.hook("filtered")
        clock[-1] = time.perf_counter()
        held = backup_tables.tables()
        restore_replay.publish(conn, tenant_id, [(name, *held[name]) for name in backup_tables.staged()])
        # The replay and every query after it plan on the loaded rows, not an empty tenant.
        restore_replay.analyze_published(conn, tenant_id)
        seconds["publish"] = lap()
        base = bytescan.base_from_key(self.store.keys.control_key(conn))
        after, other, found = restore_replay.replay(conn, tenant_id, base, progress)
        owed.update(found)
        seconds["replay"] = lap()
        entries = conn.execute(
            "SELECT kind, count(*) FROM control.journal WHERE tenant_id = %s GROUP BY kind", (tenant_id,)
        ).fetchall()
        report["replayed"] = {
            "journal_entries": {str(k): int(v) for k, v in entries},
            "rows_removed": {**removed, **other},
            # The safety net: the same rules on the tenant's tables once the survivors are in. Zero
            # unless a journal entry came some way other than through the gate lock.
            "rows_removed_after_load": after,
        }
        report["seconds"] = seconds
        report["load_seconds"] = round(seconds["stage"] + seconds["publish"], 3)
        report["replay_seconds"] = round(seconds["filter"] + seconds["replay"], 3)
        self.context.hook("replayed")

    def _load(
        self, conn: psycopg.Connection, tenant_id: str, tables: dict[str, pa.Table], progress: Progress
    ) -> dict[str, int]:
        """Empty the tenant's replaced tables and stage the backup's rows in temporary tables (the
        journals filter them there); subjects go straight in, lineage is never loaded."""
        from psycopg import sql

        held = backup_tables.tables()
        total = sum(tables[name].num_rows for name in backup_tables.load_order() if name != "lineage")
        done = 0
        for name in backup_tables.replaced():
            schema, table = held[name][0].split(".")
            conn.execute(
                sql.SQL("DELETE FROM {}.{} WHERE tenant_id = %s").format(sql.Identifier(schema), sql.Identifier(table)),
                (tenant_id,),
            )
        loaded = {}
        for name in backup_tables.load_order():
            data = tables[name]
            loaded[name] = data.num_rows
            if name == "subjects":
                # Subjects stay: their epochs and forgotten marks are newer than any backup (ids and
                # flags only; a subject's consent is replayed from the consent journal).
                conn.execute(
                    "INSERT INTO memory.subjects (tenant_id, user_id, do_not_sell, created_at)"
                    " SELECT %s, * FROM unnest(%s::text[], %s::boolean[], %s::timestamptz[])"
                    " ON CONFLICT (tenant_id, user_id) DO NOTHING",
                    (
                        tenant_id,
                        data["user_id"].to_pylist(),
                        data["do_not_sell"].to_pylist(),
                        data["created_at"].to_pylist(),
                    ),
                )
                done += data.num_rows
                progress(done, total, "restore rows")
            elif name == "lineage":
                # Edges describe derived copies that exist now, not at backup time: the tenant's
                # current edges all stay (copies of versions this restore drops included: the rebuild
                # and any forget find them by these edges), and the backup's are not brought back (an
                # edge of a copy since removed would make a sync believe a restored version indexed).
                loaded[name] = 0
            else:
                done = restore_replay.stage(conn, tenant_id, name, held[name][1], data, progress, done, total)
        return loaded
