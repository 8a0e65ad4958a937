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
only then reopens reads (lib/restore_replay.py). A restore id names one restore of one tenant.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
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

from memory_pipelines.lib.backups import restore_replay
from memory_pipelines.lib.backups.storage import BackupStorage, LocalBackupStorage, S3BackupStorage
from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import ConflictError, MemoryPipelinesError, NotFoundError, ValidationError
from memory_pipelines.lib.infra.owner_only import private_dir
from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories import consent, crypto, ordering
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.stores import bytescan

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
# Loaded through temporary tables, in load order: nothing the journals forgot reaches the real ones.
_STAGED = ["teams", "team_members", "memories", "memory_versions", "summary_modes"]

Hook = Callable[[str], None]

# Generated ids are r_ and 16 hex digits; a caller may choose its own of this form.
RESTORE_ID_RE = re.compile(r"r_[a-z0-9][a-z0-9_-]{0,61}")


def check_restore_id(value: object) -> str:
    """`value` if it has the form of a restore id, else a ValidationError naming `restore_id`."""
    if not isinstance(value, str) or not RESTORE_ID_RE.fullmatch(value):
        raise ValidationError(
            "restore_id",
            f"malformed restore id {str(value)[:80]!r}: expected r_ and up to 62 of a-z, 0-9, _ and -"
            " (or none, for a new id)",
        )
    return value


def _restore_id_clash(row: tuple[Any, ...] | None, tenant_id: str, backup_id: str, restore_id: str) -> str | None:
    """Why `restore_id` cannot name this restore (None when it can: it is new, or it is this very
    restore's request or a retry of it after BLOCKED). Another tenant is never named."""
    if row is None:
        return None
    owner, backup, state = row
    if owner != tenant_id:
        return f"restore_id {restore_id} is taken by another restore; leave it empty for a new id"
    if backup == backup_id and state in ("REQUESTED", "BLOCKED"):
        return None
    return (
        f"restore_id {restore_id} is taken by a {state} restore of {tenant_id!r} from {backup};"
        " leave it empty for a new id"
    )


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
        private_dir(self.staging)
        path = Path(tempfile.mkdtemp(prefix="scratch-", dir=self.staging))  # mkdtemp: 0700
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    # -- backup --------------------------------------------------------------------------------

    def backup(self, *, tenant_id: str, progress: Progress = no_progress) -> dict[str, Any]:
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
        return {**_public(manifest), "seconds": round(time.perf_counter() - started, 3)}

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

    def _take(self, tenant_id: str, backup_id: str, created: datetime, progress: Progress) -> dict[str, Any]:
        """Snapshot, seal and upload; returns the manifest."""
        with self._scratch() as scratch:
            snapshot = scratch / "snapshot"
            snapshot.mkdir()
            with self.store.transaction() as conn:
                # One snapshot for every table: a write between two dumps cannot split a memory
                # from its versions.
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                self.store._tenant_mode(conn, tenant_id)
                # The consent entries this snapshot saw; a restore replays every other one.
                seen = consent.snapshot(conn)
                snapshot_at = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
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
            with self.store.transaction() as conn:
                conn.execute(
                    "UPDATE control.backups SET snapshot_at = %s WHERE backup_id = %s", (snapshot_at, backup_id)
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
                "snapshot_at": snapshot_at.isoformat(),
                "consent_snapshot": seen,
            }
            del object_key
            manifest_file = scratch / "manifest.json"
            manifest_file.write_text(json.dumps(manifest, indent=2))
            self.storage.put_file(str(manifest["object"]), sealed)
            self.storage.put_file(f"{tenant_id}/{backup_id}.manifest.json", manifest_file)
        return manifest

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
                **_public(manifest),
                "location": location,
                "expired": expired is not None,
                "state": state,
                "snapshot_at": None if taken is None else taken.isoformat(),
            }
            for manifest, location, expired, state, taken in rows
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
        return dict(row[1])

    # -- restore -------------------------------------------------------------------------------

    def request_restore(self, *, tenant_id: str, backup_id: str, restore_id: str | None = None) -> dict[str, Any]:
        """Record a restore for the restore sensor to run; the backup and the restore id are checked now.
        A `restore_id` already naming another restore is refused (ConflictError), never reused."""
        if restore_id is not None:
            check_restore_id(restore_id)
        self._backup_row(tenant_id, backup_id)
        restore_id = restore_id or "r_" + secrets.token_hex(8)
        with self.store.transaction() as conn:
            inserted = conn.execute(
                "INSERT INTO control.restores (restore_id, tenant_id, backup_id, state) VALUES (%s, %s, %s,"
                " 'REQUESTED') ON CONFLICT (restore_id) DO NOTHING RETURNING restore_id",
                (restore_id, tenant_id, backup_id),
            ).fetchone()
            if inserted is None:
                row = conn.execute(
                    "SELECT tenant_id, backup_id, state FROM control.restores WHERE restore_id = %s", (restore_id,)
                ).fetchone()
                clash = _restore_id_clash(row, tenant_id, backup_id, restore_id)
                if clash is not None or (row is not None and row[2] != "REQUESTED"):
                    raise ConflictError("restore_id", clash or f"restore_id {restore_id} is taken")
        return {"restore_id": restore_id, "tenant_id": tenant_id, "backup_id": backup_id, "state": "REQUESTED"}

    def check_restore_id(self, *, tenant_id: str, backup_id: str, restore_id: str) -> str:
        """`restore_id` if it may name a restore of `backup_id` into `tenant_id` now: well formed, and
        new or this restore's own request. Raises ValidationError or ConflictError naming `restore_id`."""
        check_restore_id(restore_id)
        with self.store.transaction() as conn:
            row = conn.execute(
                "SELECT tenant_id, backup_id, state FROM control.restores WHERE restore_id = %s", (restore_id,)
            ).fetchone()
        clash = _restore_id_clash(row, tenant_id, backup_id, restore_id)
        if clash is not None:
            raise ConflictError("restore_id", clash)
        return restore_id

    def restore(
        self,
        *,
        tenant_id: str,
        backup_id: str,
        restore_id: str | None = None,
        lock_timeout: float = 60.0,
        progress: Progress = no_progress,
    ) -> dict[str, Any]:
        """Load a backup into the tenant behind the restore gate, replay the journals, verify, reopen;
        `progress` hears of each chunk of rows loaded ("restore rows") and each replay step ("restore replay").

        The backup's rows are staged in temporary tables, the deletion journal removes there what it
        forgot and the consent journal reapplies changes made since the backup; only what survives
        reaches the tenant's tables, where the rules run again (expected to remove nothing) and are
        verified. All of it is one transaction: a restore that fails verification (or fails at all)
        rolls back to the tenant's rows as they were, is reported BLOCKED, and keeps the gate closed
        until a later restore succeeds or `reopen` is called. Never interleaves with a forget run of
        the tenant (same advisory lock); waits up to `lock_timeout` seconds. A `restore_id` naming
        another restore is refused (ConflictError) before anything is touched.
        """
        manifest = self._backup_row(tenant_id, backup_id)
        if restore_id is not None:
            self.check_restore_id(tenant_id=tenant_id, backup_id=backup_id, restore_id=restore_id)
        with self._tenant_lock(tenant_id, lock_timeout), self._scratch() as scratch:
            self._require_restorable(tenant_id)
            tables = self._fetch_and_open(manifest, scratch)
            restore_id = restore_id or "r_" + secrets.token_hex(8)
            with self.store.transaction() as conn:
                # Closing the gate waits for every write in flight (they hold the lock shared) and is
                # seen by every later one: a restore never meets a write that began before it closed.
                ordering.lock_tenant_exclusive(conn, tenant_id)
                self._claim(conn, tenant_id, backup_id, restore_id)
                conn.execute("UPDATE memory.tenants SET restoring_since = now() WHERE tenant_id = %s", (tenant_id,))
            report: dict[str, Any] = {"restore_id": restore_id, "tenant_id": tenant_id, "backup_id": backup_id}
            owed: restore_replay.Owed = {}
            try:
                with self.store.transaction() as conn:
                    self._load_and_replay(conn, tenant_id, manifest, tables, report, owed, progress)
                    report["verification"] = restore_replay.verify(conn, tenant_id)
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
            finally:
                # Committed or rolled back, rows the safety net deleted left dead tuples: erase them.
                if owed:
                    self._owe_erasure(tenant_id, restore_id, owed, report)
        return report

    def _load_and_replay(
        self,
        conn: psycopg.Connection,
        tenant_id: str,
        manifest: dict[str, Any],
        tables: dict[str, pa.Table],
        report: dict[str, Any],
        owed: restore_replay.Owed,
        progress: Progress,
    ) -> None:
        """Stage, filter by both journals, publish the survivors, then the safety net; fills `report`."""
        # The gate lock again, held to commit: every journal writer takes it, so the journal the
        # staged rows were filtered by is the one the published rows meet (lib/restore_replay.py).
        ordering.lock_tenant_exclusive(conn, tenant_id)
        clock = [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return round(clock[-1] - clock[-2], 3)

        seconds: dict[str, float] = {}
        report["loaded"] = self._load(conn, tenant_id, tables, progress)
        seconds["stage"] = lap()
        self._hook("loaded")
        clock[-1] = time.perf_counter()  # a test's hook is no step of the restore
        removed, report["consent"] = restore_replay.filter_staged(
            conn, tenant_id, since=manifest.get("consent_snapshot")
        )
        seconds["filter"] = lap()
        self._hook("filtered")
        clock[-1] = time.perf_counter()
        restore_replay.publish(conn, tenant_id, [(name, *TABLES[name]) for name in _STAGED])
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
        self._hook("replayed")

    def _claim(self, conn: psycopg.Connection, tenant_id: str, backup_id: str, restore_id: str) -> None:
        """Make `restore_id` this restore's (RUNNING), in the transaction that closes the gate; a
        restore id naming another restore is refused, never taken over."""
        inserted = conn.execute(
            "INSERT INTO control.restores (restore_id, tenant_id, backup_id, state) VALUES (%s, %s, %s,"
            " 'RUNNING') ON CONFLICT (restore_id) DO NOTHING RETURNING restore_id",
            (restore_id, tenant_id, backup_id),
        ).fetchone()
        if inserted is not None:
            return
        row = conn.execute(
            "SELECT tenant_id, backup_id, state FROM control.restores WHERE restore_id = %s FOR UPDATE",
            (restore_id,),
        ).fetchone()
        clash = _restore_id_clash(row, tenant_id, backup_id, restore_id)
        if clash is not None:
            raise ConflictError("restore_id", clash)
        conn.execute("UPDATE control.restores SET state = 'RUNNING' WHERE restore_id = %s", (restore_id,))

    def _owe_erasure(self, tenant_id: str, restore_id: str, owed: restore_replay.Owed, report: dict[str, Any]) -> None:
        erasure_hours = Settings.from_env().erasure_hours
        with self.store.transaction() as conn:
            report["erasure_owed"] = restore_replay.owe_erasure(
                conn, tenant_id, restore_id, owed, erasure_hours=erasure_hours
            )
            conn.execute(
                "UPDATE control.restores SET report = report || %s WHERE restore_id = %s",
                (json.dumps({"erasure_owed": report["erasure_owed"]}), restore_id),
            )

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
        """Empty the tenant's replaced tables and stage the backup's rows in temporary tables (the
        journals filter them there); subjects go straight in, lineage is never loaded."""
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
                done = restore_replay.stage(conn, tenant_id, name, TABLES[name][1], data, progress, done, total)
        return loaded


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
