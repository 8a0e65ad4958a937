"""Encrypted tenant backups and restores that cannot resurrect forgotten data.

A backup is a Parquet snapshot of the tenant's primary rows (memory text stays ciphertext under
each author's subject key), lineage and settings, tarred and sealed as one chunked AES-256-GCM
stream under a fresh object key. The object key is wrapped by the tenant key, so destroying the
tenant key shreds every backup of the tenant, and destroying a subject key leaves that subject's
rows unreadable in every backup. The key store is never part of a backup.

A restore closes the tenant's reads (the restore gate), loads the snapshot, replays the deletion
journal (subject epochs, tombstones, key destructions), verifies that nothing forgotten is left,
and only then reopens reads.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.parquet as pq

from memory_pipelines.lib import crypto, ordering, partitions, validation
from memory_pipelines.lib.backup_storage import BackupStorage, LocalBackupStorage, S3BackupStorage
from memory_pipelines.lib.errors import ConflictError, MemoryPipelinesError, NotFoundError, ValidationError
from memory_pipelines.lib.progress import Progress, no_progress
from memory_pipelines.lib.store import MemoryStore, repair_heads

FORMAT = 1
BATCH_ROWS = 20_000
_TS = pa.timestamp("us", tz="UTC")

# What a backup holds, per table: columns with their Arrow types, read with a bound tenant id.
# Text columns are ciphertext as stored; the key store is deliberately absent.
TABLES: dict[str, tuple[str, list[tuple[str, pa.DataType]]]] = {
    "subjects": (
        "memory.subjects",
        [("user_id", pa.string()), ("do_not_sell", pa.bool_()), ("created_at", _TS)],
    ),
    "teams": ("memory.teams", [("team_id", pa.string()), ("created_at", _TS)]),
    "team_members": (
        "memory.team_members",
        [("team_id", pa.string()), ("user_id", pa.string()), ("added_at", _TS)],
    ),
    "memories": (
        "memory.memories",
        [
            ("memory_id", pa.string()),
            ("user_id", pa.string()),
            ("team_id", pa.string()),
            ("memory_type", pa.string()),
            ("current_version", pa.int32()),
            ("do_not_sell", pa.bool_()),
            ("created_at", _TS),
            ("updated_at", _TS),
        ],
    ),
    "memory_versions": (
        "memory.memory_versions",
        [
            ("memory_id", pa.string()),
            ("version", pa.int32()),
            ("shareable", pa.bool_()),
            ("category", pa.string()),
            ("confidence", pa.float64()),
            ("text_ct", pa.binary()),
            ("text_mac", pa.binary()),
            ("original_query_ct", pa.binary()),
            ("key_id", pa.string()),
            ("restored_from", pa.int32()),
            ("created_at", _TS),
            ("superseded_at", _TS),
        ],
    ),
    "lineage": (
        "derived.lineage",
        [
            ("store", pa.string()),
            ("record_id", pa.string()),
            ("source_memory_id", pa.string()),
            ("source_version", pa.int32()),
            ("created_at", _TS),
        ],
    ),
    "summary_modes": ("derived.summary_modes", [("user_id", pa.string()), ("mode", pa.string())]),
}
# Load order respects foreign keys; deletion runs in reverse.
_LOAD_ORDER = ["subjects", "teams", "team_members", "memories", "memory_versions", "lineage", "summary_modes"]
# Lineage is kept as it is, never replaced nor loaded: edges of derived records made after the backup
# (vectors, postings, summaries, prompt snapshots) must survive, or a later forget could not find them.
_REPLACED = ["summary_modes", "memory_versions", "memories", "team_members", "teams"]

Hook = Callable[[str], None]


def _select(table: str, columns: list[tuple[str, pa.DataType]]) -> psycopg.sql.Composed:
    from psycopg import sql

    schema, name = table.split(".")
    return sql.SQL("SELECT {} FROM {}.{} WHERE tenant_id = %s ORDER BY 1").format(
        sql.SQL(", ").join(sql.Identifier(c) for c, _ in columns), sql.Identifier(schema), sql.Identifier(name)
    )


class BackupService:
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

    @contextmanager
    def _scratch(self) -> Iterator[Path]:
        # Scratch files hold ciphertext columns and ids only; they are removed whatever happens.
        self.staging.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix="scratch-", dir=self.staging))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # -- backup --------------------------------------------------------------------------------

    def backup(self, *, tenant_id: str, progress: Progress = no_progress) -> dict[str, Any]:
        """Snapshot, encrypt and store one tenant; returns the manifest (ids and counts only).
        `progress` hears of each chunk of rows dumped ("backup rows") and each table ("backup tables")."""
        validation.check_id("tenant", tenant_id)
        self.storage.ensure_expiry(self.days)
        started = time.perf_counter()
        backup_id = "b_" + datetime.now(UTC).strftime("%Y%m%dT%H%M%S") + "_" + secrets.token_hex(4)
        with self._scratch() as scratch:
            snapshot = scratch / "snapshot"
            snapshot.mkdir()
            with self.store.transaction() as conn:
                # One snapshot for every table: a write between two dumps cannot split a memory
                # from its versions.
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                self.store._tenant_mode(conn, tenant_id)
                tenant_key_id, tenant_key = self.store.keys.tenant_key(conn, tenant_id)
                rows: dict[str, int] = {}
                for name in _LOAD_ORDER:
                    rows[name] = self._dump(conn, tenant_id, name, snapshot, progress, sum(rows.values()))
                    progress(len(rows), len(_LOAD_ORDER), "backup tables")
                key_ids = sorted(
                    {
                        str(r[0])
                        for r in conn.execute(
                            "SELECT DISTINCT key_id FROM memory.memory_versions WHERE tenant_id = %s", (tenant_id,)
                        )
                    }
                )
            archive = scratch / "snapshot.tar"
            with tarfile.open(archive, "w") as tar:
                for name in _LOAD_ORDER:
                    tar.add(snapshot / f"{name}.parquet", arcname=f"{name}.parquet")
            object_key = crypto.new_key()
            sealed = scratch / "backup.bin"
            with archive.open("rb") as src, sealed.open("wb") as dst:
                size = crypto.encrypt_stream(object_key, src, dst, _object_aad(tenant_id, backup_id))
            digest = _sha256(sealed)
            created = datetime.now(UTC)
            manifest = {
                "format": FORMAT,
                "backup_id": backup_id,
                "tenant_id": tenant_id,
                "rows": rows,
                "key_ids": {"tenant_key": tenant_key_id, "subject_keys": key_ids},
                "wrapped_object_key": base64.b64encode(
                    crypto.seal(tenant_key, object_key, _wrap_aad(tenant_id, backup_id))
                ).decode(),
                "object": f"{tenant_id}/{backup_id}.bin",
                "bytes": size,
                "sha256": digest,
                "created_at": created.isoformat(),
                "expires_at": (created + timedelta(days=self.days)).isoformat(),
            }
            del object_key
            manifest_file = scratch / "manifest.json"
            manifest_file.write_text(json.dumps(manifest, indent=2))
            self.storage.put_file(str(manifest["object"]), sealed)
            self.storage.put_file(f"{tenant_id}/{backup_id}.manifest.json", manifest_file)
        with self.store.transaction() as conn:
            conn.execute(
                "INSERT INTO control.backups (backup_id, tenant_id, location, object_key, manifest, created_at,"
                " expires_at) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (
                    backup_id,
                    tenant_id,
                    self.storage.location,
                    manifest["object"],
                    json.dumps(manifest),
                    created,
                    created + timedelta(days=self.days),
                ),
            )
        return {**_public(manifest), "seconds": round(time.perf_counter() - started, 3)}

    def _dump(
        self, conn: psycopg.Connection, tenant_id: str, name: str, folder: Path, progress: Progress, before: int
    ) -> int:
        table, columns = TABLES[name]
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

    # -- listing and expiry --------------------------------------------------------------------

    def list_backups(self, *, tenant_id: str) -> list[dict[str, Any]]:
        validation.check_id("tenant", tenant_id)
        with self.store.transaction() as conn:
            rows = conn.execute(
                "SELECT manifest, location, expired_at FROM control.backups WHERE tenant_id = %s ORDER BY created_at",
                (tenant_id,),
            ).fetchall()
        return [
            {**_public(manifest), "location": location, "expired": expired is not None}
            for manifest, location, expired in rows
        ]

    def sweep_expired(self, *, now: datetime | None = None) -> dict[str, int]:
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

    def _backup_row(self, tenant_id: str, backup_id: str) -> dict[str, Any]:
        validation.check_id("tenant", tenant_id)
        if not isinstance(backup_id, str) or not backup_id.startswith("b_") or len(backup_id) > 64:
            raise ValidationError("backup", f"malformed backup id {backup_id!r}")
        with self.store.transaction() as conn:
            row = conn.execute(
                "SELECT tenant_id, manifest, expired_at FROM control.backups WHERE backup_id = %s", (backup_id,)
            ).fetchone()
        if row is None:
            raise NotFoundError("backup", f"no backup {backup_id!r}")
        if row[0] != tenant_id:
            raise ValidationError("backup", f"backup {backup_id} belongs to another tenant, not {tenant_id!r}")
        if row[2] is not None:
            raise NotFoundError("backup", f"backup {backup_id} expired and was deleted")
        return dict(row[1])

    # -- restore -------------------------------------------------------------------------------

    def request_restore(self, *, tenant_id: str, backup_id: str) -> dict[str, Any]:
        """Record a restore for the restore sensor to run; the backup is checked now."""
        self._backup_row(tenant_id, backup_id)
        restore_id = "r_" + secrets.token_hex(8)
        with self.store.transaction() as conn:
            conn.execute(
                "INSERT INTO control.restores (restore_id, tenant_id, backup_id, state) VALUES (%s, %s, %s,"
                " 'REQUESTED')",
                (restore_id, tenant_id, backup_id),
            )
        return {"restore_id": restore_id, "tenant_id": tenant_id, "backup_id": backup_id, "state": "REQUESTED"}

    def restore(
        self,
        *,
        tenant_id: str,
        backup_id: str,
        restore_id: str | None = None,
        lock_timeout: float = 60.0,
        progress: Progress = no_progress,
    ) -> dict[str, Any]:
        """Load a backup into the tenant behind the restore gate, replay the journal, verify, reopen;
        `progress` hears of each chunk of rows loaded ("restore rows") and each replay step ("restore replay").

        Load, replay and verification are one transaction: a restore that fails verification (or
        fails at all) rolls back to the tenant's rows as they were, is reported BLOCKED, and keeps
        the gate closed until a later restore succeeds or `reopen` is called. Never interleaves with
        a forget run of the tenant (same advisory lock); waits up to `lock_timeout` seconds.
        """
        manifest = self._backup_row(tenant_id, backup_id)
        with self._tenant_lock(tenant_id, lock_timeout), self._scratch() as scratch:
            self._require_restorable(tenant_id)
            tables = self._fetch_and_open(manifest, scratch)
            restore_id = restore_id or "r_" + secrets.token_hex(8)
            with self.store.transaction() as conn:
                # Closing the gate waits for every write in flight (they hold the lock shared) and is
                # seen by every later one: a restore never meets a write that began before it closed.
                ordering.lock_tenant_exclusive(conn, tenant_id)
                conn.execute("UPDATE memory.tenants SET restoring_since = now() WHERE tenant_id = %s", (tenant_id,))
                conn.execute(
                    "INSERT INTO control.restores (restore_id, tenant_id, backup_id, state) VALUES (%s, %s, %s,"
                    " 'RUNNING') ON CONFLICT (restore_id) DO UPDATE SET state = 'RUNNING'",
                    (restore_id, tenant_id, backup_id),
                )
            report: dict[str, Any] = {"restore_id": restore_id, "tenant_id": tenant_id, "backup_id": backup_id}
            try:
                with self.store.transaction() as conn:
                    started = time.perf_counter()
                    report["loaded"] = self._load(conn, tenant_id, tables, progress)
                    # The replay and every query after it plan on the loaded rows, not an empty tenant.
                    partitions.analyze_tenant(conn, tenant_id)
                    report["load_seconds"] = round(time.perf_counter() - started, 3)
                    self._hook("loaded")
                    started = time.perf_counter()
                    report["replayed"] = self._replay(conn, tenant_id, progress)
                    report["replay_seconds"] = round(time.perf_counter() - started, 3)
                    self._hook("replayed")
                    report["verification"] = self._verify(conn, tenant_id)
                    if any(report["verification"].values()):
                        raise _VerificationFailed  # rolls the load back: forgotten rows never commit
                    # The sequence the restore leaves: the partitions sensor leaves this change to the
                    # backfill sensor (one rebuild, not a second one by eager automation).
                    report["change_seq"] = conn.execute(
                        "UPDATE memory.tenants SET restoring_since = NULL, change_seq = change_seq + 1,"
                        " updated_at = now() WHERE tenant_id = %s RETURNING change_seq",
                        (tenant_id,),
                    ).fetchone()[0]  # type: ignore[index]
                    report["state"] = "COMPLETE"
                    # Held to commit: numbers become visible in commit order, never a lower one later.
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (_COMPLETION_LOCK,))
                    conn.execute(
                        "UPDATE control.restores SET state = 'COMPLETE', report = %s, completed_at = now(),"
                        " completion_seq = nextval('control.restore_completion_seq') WHERE restore_id = %s",
                        (json.dumps(report), restore_id),
                    )
            except _VerificationFailed:
                self._mark_blocked(restore_id, report)
                return report
            except MemoryPipelinesError:
                self._mark_blocked(restore_id, report)
                raise
            except Exception as exc:
                self._mark_blocked(restore_id, {**report, "error": type(exc).__name__})
                raise
        return report

    def _require_restorable(self, tenant_id: str) -> None:
        """The tenant exists and is not deleted; a gate left closed by a BLOCKED restore is no obstacle."""
        with self.store.transaction() as conn:
            row = conn.execute("SELECT deleted_at FROM memory.tenants WHERE tenant_id = %s", (tenant_id,)).fetchone()
        if row is None:
            raise NotFoundError("tenant", f"unknown tenant {tenant_id!r}")
        if row[0] is not None:
            raise NotFoundError("tenant", f"tenant {tenant_id!r} was deleted")

    def reopen(self, *, tenant_id: str) -> dict[str, Any]:
        """Open a tenant whose gate a BLOCKED restore left closed; its rows are those before that restore."""
        validation.check_id("tenant", tenant_id)
        with self.store.transaction() as conn:
            row = conn.execute(
                "UPDATE memory.tenants SET restoring_since = NULL, change_seq = change_seq + 1 WHERE tenant_id = %s"
                " AND restoring_since IS NOT NULL RETURNING tenant_id",
                (tenant_id,),
            ).fetchone()
        if row is None:
            self.store.require_tenant(tenant_id=tenant_id)  # an unknown tenant is not found, not "already open"
        return {"tenant_id": tenant_id, "reopened": row is not None}

    def _hook(self, step: str) -> None:
        if step in self.hooks:
            self.hooks[step](step)

    def _mark_blocked(self, restore_id: str, report: dict[str, Any]) -> None:
        # The load rolled back; the gate stays closed until a restore succeeds or `reopen`.
        with self.store.transaction() as conn:
            conn.execute(
                "UPDATE control.restores SET state = 'BLOCKED', report = %s WHERE restore_id = %s",
                (json.dumps({**report, "state": "BLOCKED"}), restore_id),
            )
        report["state"] = "BLOCKED"

    @contextmanager
    def _tenant_lock(self, tenant_id: str, timeout: float) -> Iterator[None]:
        lock_key = f"forget\x1f{tenant_id}"
        conn = psycopg.connect(self.store.conninfo, autocommit=True)
        try:
            deadline = time.monotonic() + timeout
            while not conn.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 2))", (lock_key,)).fetchone()[
                0  # type: ignore[index]
            ]:
                if time.monotonic() >= deadline:
                    raise ConflictError(
                        "tenant", f"a forget run of {tenant_id!r} is in progress; restore again when it ends"
                    )
                time.sleep(0.2)
            try:
                yield
            finally:
                conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 2))", (lock_key,))
        finally:
            conn.close()

    def _fetch_and_open(self, manifest: dict[str, Any], scratch: Path) -> dict[str, pa.Table]:
        archive = self._fetch_archive(manifest, scratch)
        folder = scratch / "snapshot"
        with tarfile.open(archive) as tar:
            tar.extractall(folder, filter="data")
        return {name: pq.read_table(folder / f"{name}.parquet") for name in _LOAD_ORDER}

    def _fetch_archive(self, manifest: dict[str, Any], scratch: Path) -> Path:
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
                tenant_key, base64.b64decode(manifest["wrapped_object_key"]), _wrap_aad(tenant_id, backup_id)
            )
        except crypto.DecryptionError as exc:
            raise ValidationError("backup", f"backup {backup_id}: its object key does not unwrap") from exc
        sealed = scratch / "backup.bin"
        self.storage.get_file(manifest["object"], sealed)
        archive = scratch / "snapshot.tar"
        try:
            with sealed.open("rb") as src, archive.open("wb") as dst:
                crypto.decrypt_stream(object_key, src, dst, _object_aad(tenant_id, backup_id))
        except crypto.DecryptionError as exc:
            raise ValidationError(
                "backup", f"backup {backup_id} failed authentication ({exc}); nothing was loaded"
            ) from exc
        return archive

    def _load(
        self, conn: psycopg.Connection, tenant_id: str, tables: dict[str, pa.Table], progress: Progress
    ) -> dict[str, int]:
        from psycopg import sql

        total = sum(tables[name].num_rows for name in _LOAD_ORDER if name != "lineage")
        done = 0

        for name in _REPLACED:
            schema, table = TABLES[name][0].split(".")
            conn.execute(
                sql.SQL("DELETE FROM {}.{} WHERE tenant_id = %s").format(sql.Identifier(schema), sql.Identifier(table)),
                (tenant_id,),
            )
        loaded = {}
        for name in _LOAD_ORDER:
            qualified, columns = TABLES[name]
            schema, table = qualified.split(".")
            names = ["tenant_id", *(c for c, _ in columns)]
            data = tables[name]
            if name == "subjects":
                # Subjects stay: their epochs and forgotten marks are newer than any backup.
                statement = sql.SQL(
                    "INSERT INTO memory.subjects (tenant_id, user_id, do_not_sell, created_at)"
                    " SELECT %s, * FROM unnest(%s::text[], %s::boolean[], %s::timestamptz[])"
                    " ON CONFLICT (tenant_id, user_id) DO NOTHING"
                )
                conn.execute(
                    statement,
                    (
                        tenant_id,
                        data["user_id"].to_pylist(),
                        data["do_not_sell"].to_pylist(),
                        data["created_at"].to_pylist(),
                    ),
                )
                loaded[name] = data.num_rows
                done += data.num_rows
                progress(done, total, "restore rows")
                continue
            if name == "lineage":
                # Edges describe derived copies that exist now, not at backup time: the tenant's
                # current edges all stay (copies of versions this restore drops included: the rebuild
                # and any forget find them by these edges), and the backup's are not brought back (an
                # edge of a copy since removed would make a sync believe a restored version indexed).
                loaded[name] = 0
                continue
            copy = sql.SQL("COPY {}.{} ({}) FROM STDIN").format(
                sql.Identifier(schema), sql.Identifier(table), sql.SQL(", ").join(map(sql.Identifier, names))
            )
            with conn.cursor() as cur, cur.copy(copy) as writer:
                for batch in data.to_batches(BATCH_ROWS):
                    cols = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
                    for row in zip(*cols, strict=True):
                        writer.write_row((tenant_id, *row))
                    done += batch.num_rows
                    progress(done, total, "restore rows")
            loaded[name] = data.num_rows
        return loaded

    def _replay(self, conn: psycopg.Connection, tenant_id: str, progress: Progress = no_progress) -> dict[str, Any]:
        """Apply every journal entry of the tenant to the loaded rows; returns entries and rows removed.
        Each kind of entry is applied to all rows at once (set-based SQL), so `progress` hears of
        replay steps ("restore replay"), not of single entries."""
        entries: dict[str, int] = dict(
            conn.execute(
                "SELECT kind, count(*) FROM control.journal WHERE tenant_id = %s GROUP BY kind", (tenant_id,)
            ).fetchall()
        )
        steps = len(_FORGOTTEN) + 3
        removed: dict[str, int] = {}
        for reason in _FORGOTTEN:
            removed[reason] = conn.execute(_forgotten_query(reason, delete=True), (tenant_id, tenant_id)).rowcount
            progress(len(removed), steps, "restore replay")
        removed["empty_memories"] = repair_heads(conn, tenant_id=tenant_id)
        removed.update(_drop_copies_of_dropped_versions(conn, tenant_id))
        progress(len(_FORGOTTEN) + 2, steps, "restore replay")
        # Edges to versions the restored rows no longer hold that are left describe copies outside
        # PostgreSQL (vectors, the analytics file); they stay, so the rebuild after this restore, or a
        # forget before it, finds and removes those copies.
        row = conn.execute(
            "SELECT count(*) FROM derived.lineage l WHERE l.tenant_id = %s AND NOT EXISTS (SELECT 1 FROM"
            " memory.memory_versions v WHERE v.tenant_id = l.tenant_id AND v.memory_id = l.source_memory_id"
            " AND v.version = l.source_version)",
            (tenant_id,),
        ).fetchone()
        removed["derived_edges_left_for_rebuild"] = int(row[0]) if row else 0
        removed["team_members"] = conn.execute(
            "DELETE FROM memory.team_members tm USING memory.subjects s WHERE tm.tenant_id = %s"
            " AND s.tenant_id = tm.tenant_id AND s.user_id = tm.user_id AND s.epoch > 0"
            " AND tm.added_at < (SELECT max(j.created_at) FROM control.journal j WHERE j.tenant_id = tm.tenant_id"
            " AND j.kind = 'SUBJECT_EPOCH' AND j.subject_id = tm.user_id)",
            (tenant_id,),
        ).rowcount
        progress(steps, steps, "restore replay")
        return {"journal_entries": {k: int(v) for k, v in entries.items()}, "rows_removed": removed}

    @staticmethod
    def _verify(conn: psycopg.Connection, tenant_id: str) -> dict[str, int]:
        """Rows of forgotten scopes left after replay; all must be zero before reads reopen."""
        counts = {}
        for reason in _FORGOTTEN:
            row = conn.execute(_forgotten_query(reason, delete=False), (tenant_id, tenant_id)).fetchone()
            counts[reason] = int(row[0]) if row else 0
        return counts


# Rows the journal says must not exist: (other tables, condition) on memory_versions v, run as a
# DELETE by the replay and as a count by the verification. Each takes (tenant_id, tenant_id). An
# epoch forgets what its subject wrote before it; a version whose key was destroyed, or whose key
# is unknown to the key store, can never be read again.
_FORGOTTEN: dict[str, tuple[str, str]] = {
    "subject_epochs": (
        "memory.memories m, control.journal j",
        "v.tenant_id = %s AND m.tenant_id = v.tenant_id AND m.memory_id = v.memory_id"
        " AND j.tenant_id = %s AND j.kind = 'SUBJECT_EPOCH' AND j.subject_id = m.user_id"
        " AND v.created_at < j.created_at",
    ),
    "tombstones": (
        "control.tombstones t",
        "v.tenant_id = %s AND t.tenant_id = %s AND t.memory_id = v.memory_id AND t.version = v.version",
    ),
    "forgotten_memories": (
        "control.journal j",
        "v.tenant_id = %s AND j.tenant_id = %s AND j.kind = 'MEMORY_FORGOTTEN' AND j.memory_id = v.memory_id"
        " AND v.created_at < j.created_at",
    ),
    "destroyed_keys": (
        "",
        # The key store is read at the tenant's partition only (a constant bound, not a correlation).
        "v.tenant_id = %s AND (NOT EXISTS (SELECT 1 FROM keystore.subject_keys k WHERE k.tenant_id = %s"
        " AND k.key_id = v.key_id) OR v.key_id IN (SELECT j.key_id FROM control.journal j"
        " WHERE j.tenant_id = v.tenant_id AND j.kind = 'KEY_DESTROYED'))",
    ),
}


# Copies in PostgreSQL of versions a restore dropped (written after the backup, or forgotten), removed
# in the restore's own transaction: cached recalls and prompt snapshots that read them, summaries
# that state them (the rebuild after the restore makes them again), and their postings.
_ORPHAN = (
    " FROM derived.lineage l WHERE l.tenant_id = %(t)s AND l.store = %(store)s AND NOT EXISTS (SELECT 1"
    " FROM memory.memory_versions v WHERE v.tenant_id = l.tenant_id AND v.memory_id = l.source_memory_id"
    " AND v.version = l.source_version)"
)
_DROP_RECORDS = {
    "prompt_snapshots": "DELETE FROM derived.prompt_snapshots WHERE tenant_id = %(t)s AND snapshot_id = ANY(%(ids)s)",
    "recall_cache": "DELETE FROM derived.recall_cache WHERE tenant_id = %(t)s"
    " AND encode(cache_key, 'hex') = ANY(%(ids)s)",
    "subject_summaries": "DELETE FROM derived.summaries WHERE tenant_id = %(t)s AND scope = 'subject'"
    " AND 'subject:' || scope_id = ANY(%(ids)s)",
    "team_summaries": "DELETE FROM derived.summaries WHERE tenant_id = %(t)s AND scope = 'team'"
    " AND 'team:' || scope_id = ANY(%(ids)s)",
}


def _drop_copies_of_dropped_versions(conn: psycopg.Connection, tenant_id: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for store, delete in _DROP_RECORDS.items():
        ids = [r[0] for r in conn.execute("SELECT DISTINCT l.record_id" + _ORPHAN, {"t": tenant_id, "store": store})]
        counts[f"dropped_{store}"] = conn.execute(delete, {"t": tenant_id, "ids": ids}).rowcount if ids else 0
        if ids:
            conn.execute(
                "DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s AND record_id = ANY(%s)",
                (tenant_id, store, ids),
            )
    pairs = conn.execute(
        "SELECT DISTINCT l.source_memory_id, l.source_version" + _ORPHAN, {"t": tenant_id, "store": "keyword_index"}
    ).fetchall()
    counts["dropped_keyword_postings"] = conn.execute(
        "DELETE FROM derived.keyword_postings p USING unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
        " WHERE p.tenant_id = %s AND p.memory_id = w.memory_id AND p.version = w.version",
        ([m for m, _ in pairs], [v for _, v in pairs], tenant_id),
    ).rowcount
    conn.execute(
        "DELETE FROM derived.lineage l USING unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
        " WHERE l.tenant_id = %s AND l.store = 'keyword_index' AND l.source_memory_id = w.memory_id"
        " AND l.source_version = w.version",
        ([m for m, _ in pairs], [v for _, v in pairs], tenant_id),
    )
    return counts


def _forgotten_query(reason: str, *, delete: bool) -> Any:
    from psycopg import sql

    tables, condition = _FORGOTTEN[reason]
    if delete:
        using = sql.SQL(" USING " + tables if tables else "")
        template = sql.SQL("DELETE FROM memory.memory_versions v{} WHERE {}")
    else:
        using = sql.SQL(", " + tables if tables else "")
        template = sql.SQL("SELECT count(*) FROM memory.memory_versions v{} WHERE {}")
    return template.format(using, sql.SQL(condition))


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
    return BackupService(store, storage, staging=home / "backups" / ".staging", days=days)


def restores(store: MemoryStore, *, states: tuple[str, ...]) -> list[dict[str, Any]]:
    """Restores in `states`, oldest first (what the restore sensors act on)."""
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT restore_id, tenant_id, backup_id, state, completed_at FROM control.restores"
            " WHERE state = ANY(%s) ORDER BY created_at",
            (list(states),),
        ).fetchall()
    return [
        {"restore_id": r[0], "tenant_id": r[1], "backup_id": r[2], "state": r[3], "completed_at": r[4]} for r in rows
    ]


# Any constant: the same in every process that completes a restore.
_COMPLETION_LOCK = 7_150_433_212


def completed_restores(store: MemoryStore, *, after: int) -> list[dict[str, Any]]:
    """COMPLETE restores numbered above `after`, in completion order (the backfill sensor's cursor)."""
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT restore_id, tenant_id, completion_seq FROM control.restores"
            " WHERE state = 'COMPLETE' AND completion_seq > %s ORDER BY completion_seq",
            (after,),
        ).fetchall()
    return [{"restore_id": r[0], "tenant_id": r[1], "completion_seq": int(r[2])} for r in rows]


def restored_sequences(store: MemoryStore) -> dict[str, int]:
    """tenant -> the change sequence its latest COMPLETE restore left (a backfill rebuilds that one)."""
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT DISTINCT ON (tenant_id) tenant_id, (report->>'change_seq')::bigint FROM control.restores"
            " WHERE state = 'COMPLETE' AND completion_seq IS NOT NULL ORDER BY tenant_id, completion_seq DESC"
        ).fetchall()
    return {r[0]: int(r[1]) for r in rows if r[1] is not None}


def restore_report(store: MemoryStore, *, restore_id: str) -> dict[str, Any] | None:
    """The report a restore recorded (ids and counts), or None if it has not finished."""
    with store.transaction() as conn:
        row = conn.execute("SELECT state, report FROM control.restores WHERE restore_id = %s", (restore_id,)).fetchone()
    if row is None or row[0] not in ("COMPLETE", "BLOCKED"):
        return None
    return {**row[1], "state": row[0]}


class _VerificationFailed(Exception):
    """Forgotten rows left after the replay: the restore transaction must not commit."""


def _plain(value: Any) -> Any:
    return bytes(value) if isinstance(value, memoryview) else value


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
