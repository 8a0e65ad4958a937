"""Physical erasure: the rewrite that takes a COMPLETE deletion's bytes out of every file, proven.

A cascade (deletion.py) hides, deletes through each store's API, destroys keys and verifies;
nothing can read the data any more, but a store may keep the bytes in files until they are
rewritten (Chroma's HNSW segments and SQLite free pages, PostgreSQL's dead tuples and WAL). One
erasure run per tenant batches every such deletion: it rotates the tenant's key-encryption key (so
wrapped keys left in PostgreSQL's history open nothing), each registered adapter rewrites the
tenant's own files (never another tenant's), the WAL segments holding the old rows are removed
(lib/forget/wal.py), then a byte scan of those files and of pg_wal looks for the keyed fingerprints the
cascade took before deleting. Only a clean scan marks the jobs `physical: ERASED:<time>` and
claims `SHREDDED` for backups. A deletion must be erased within MEMORY_PIPELINES_ERASURE_HOURS of
completing (default 24); an overdue one fails the `erasures_on_time` check.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NoReturn

import psycopg

from memory_pipelines.lib.forget import datadir, deployment, guarantees, horizon, switches, wal
from memory_pipelines.lib.forget.ledger import mark_erased
from memory_pipelines.lib.infra import faults, home, validation
from memory_pipelines.lib.infra.errors import MemoryPipelinesError
from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories import ordering
from memory_pipelines.lib.memories.key_rotation import KeyRotation
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.stores import bytescan, registry
from memory_pipelines.lib.stores.adapter import Erasure
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "HORIZON_SECONDS",
    "ErasureIncomplete",
    "ErasureLedger",
    "ErasureService",
]


class ErasureIncomplete(MemoryPipelinesError):
    """The byte scan found fingerprints of erased data, or a snapshot older than the deletions outlived
    the wait before the rewrites: nothing is marked ERASED."""

    def __init__(self, hits: dict[str, int]) -> None:
        self.hits = hits
        files = ", ".join(f"{path} ({n})" for path, n in sorted(hits.items())[:5])
        super().__init__(
            "physical_erasure", f"{len(hits)} file(s) or snapshot(s) still hold erased data or are in use: {files}"
        )


# How long an erasure waits for snapshots older than its deletions to end before it refuses (and the
# sensor tries again): a rewrite under such a snapshot would keep the rows it erases.
HORIZON_SECONDS = 60.0


def _now() -> datetime:
    return datetime.now(UTC)


class ErasureLedger:
    """Deletions waiting for physical erasure (reads the control plane only)."""

    def __init__(self, store: MemoryStore, *, settings: Settings | None = None) -> None:
        self.store = store
        self.settings = settings or Settings.from_env()

    def pending(self, *, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """COMPLETE deletions not yet physically erased, oldest first (ids and times only)."""
        with self.store.transaction() as conn:
            rows = conn.execute(
                "SELECT job_id, tenant_id, scope, completed_at, erasure_deadline FROM control.deletion_jobs"
                " WHERE state = 'COMPLETE' AND erased_at IS NULL AND (%s::text IS NULL OR tenant_id = %s)"
                " ORDER BY completed_at, job_id",
                (tenant_id, tenant_id),
            ).fetchall()
        return [
            {"job_id": r[0], "tenant_id": r[1], "scope": r[2], "completed_at": r[3], "erasure_deadline": r[4]}
            for r in rows
        ]

    def due_tenants(self, *, now: datetime | None = None) -> list[str]:
        """Tenants whose erasure should run now: their oldest pending deletion has waited the batch
        window, or its deadline is less than a quarter of the erasure window away; none paused."""
        now = now or _now()
        batch = timedelta(minutes=self.settings.erasure_batch_minutes)
        margin = timedelta(hours=self.settings.erasure_hours) / 4
        due: dict[str, None] = {}
        for job in self.pending():
            deadline = job["erasure_deadline"] or job["completed_at"]
            if job["completed_at"] + batch <= now or deadline - margin <= now:
                due[job["tenant_id"]] = None
        with self.store.transaction() as conn:
            return [tenant_id for tenant_id in due if switches.active_pause(conn, tenant_id) is None]

    def overdue(self, *, now: datetime | None = None) -> list[dict[str, Any]]:
        """Pending erasures past their deadline."""
        now = now or _now()
        return [j for j in self.pending() if j["erasure_deadline"] is not None and j["erasure_deadline"] < now]


class ErasureService:
    """Runs a tenant's physical erasure over every registered store and proves it; `ledger` says
    which deletions wait for it."""

    def __init__(
        self, derived: DerivedStores, *, settings: Settings | None = None, horizon_seconds: float = HORIZON_SECONDS
    ) -> None:
        self.derived = derived
        self.store = derived.store
        self.ledger = ErasureLedger(derived.store, settings=settings or derived.settings)
        self.settings = self.ledger.settings
        self.horizon_seconds = horizon_seconds

    def pending(self, *, tenant_id: str | None = None) -> list[dict[str, Any]]:
        """COMPLETE deletions not yet physically erased, oldest first (`ErasureLedger.pending`)."""
        return self.ledger.pending(tenant_id=tenant_id)

    def due_tenants(self, *, now: datetime | None = None) -> list[str]:
        """Tenants whose erasure should run now (`ErasureLedger.due_tenants`)."""
        return self.ledger.due_tenants(now=now)

    def overdue(self, *, now: datetime | None = None) -> list[dict[str, Any]]:
        """Pending erasures past their deadline (`ErasureLedger.overdue`)."""
        return self.ledger.overdue(now=now)

    def erase_tenant(self, *, tenant_id: str, progress: Progress = no_progress) -> dict[str, Any]:
        """Rewrite the tenant's files in every registered store, scan them, and mark the jobs ERASED;
        `progress` hears of each store rewritten ("erasure rewrite") and each file scanned ("erasure scan").

        Runs under the tenant's forget run lock, so no cascade of the tenant interleaves. Raises
        ErasureIncomplete (nothing marked) when any file still holds a fingerprint.
        """
        validation.check_id("tenant", tenant_id)
        started = time.perf_counter()
        lock_key = ordering.run_lock(tenant_id)
        with psycopg.connect(self.store.conninfo, autocommit=True) as lock_conn:
            lock_conn.execute("SELECT pg_advisory_lock(hashtextextended(%s, 2))", (lock_key,))
            try:
                with self.store.transaction() as conn:
                    switches.require_running(conn, tenant_id)  # under the run lock, as a cascade checks it
                return self._erase(tenant_id, started, progress)
            finally:
                lock_conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 2))", (lock_key,))

    def _erase(self, tenant_id: str, started: float, progress: Progress) -> dict[str, Any]:
        jobs = self.ledger.pending(tenant_id=tenant_id)
        if not jobs:
            return {"tenant_id": tenant_id, "jobs": [], "erased": 0}
        job_ids = [job["job_id"] for job in jobs]
        swept = home.sweep(self.settings)  # a killed process's scratch may hold what was forgotten
        keys = self.rotate_keys(tenant_id)  # before the rewrites, which drop its dead old-KEK wraps
        faults.point("erasure.keys_rotated")
        rotated = time.perf_counter()
        waited = self.wait_for_older_snapshots(tenant_id, job_ids)
        erasures: dict[str, Erasure] = {}
        for index, spec in enumerate(registry.stores()):
            erasures[spec.name] = registry.adapter(spec.name).erase(self.derived, tenant_id)
            faults.point(f"erasure.rewrote.{spec.name}")
            progress(index + 1, len(registry.stores()), "erasure rewrite")
        # After them: no statistic of a sealed column is left in pg_statistic, which is rewritten;
        # then every WAL segment that holds the erased rows (or the rewrites' own logging) is
        # unlinked, and every file of the data directory is scanned with the other stores' files.
        compacted = time.perf_counter()
        statistics = datadir.clear_statistics(self.store.conninfo, tenant_id)
        purged = wal.purge(self.store.conninfo)
        faults.point("erasure.wal_purged")
        data = datadir.data_files(self.store.conninfo, tenant_id)
        rewritten = time.perf_counter()
        # Every file under HOME, not only those the stores name: a copy nobody listed is scanned too
        # (less other tenants' live data that may equal this tenant's: the stores name it).
        foreign = tuple(d for e in erasures.values() for d in e.foreign)
        files: set[Path] = (
            {f for e in erasures.values() for f in e.files}
            | set(data.files)
            | set(wal.files(purged.directory))
            | home.files(self.settings, skip=foreign)
        )
        with self.store.transaction() as conn:
            base = bytescan.base_from_key(self.store.keys.control_key(conn))
        live = {bytescan.fingerprint(w, base) for e in erasures.values() for w in e.live}
        fingerprints, result = self.scan(
            job_ids=job_ids,
            files=files,
            exclude=live,
            progress=lambda done, total: progress(done, total, "erasure scan"),
        )
        # A scratch copy still being made or read (a backup of the tenant running meanwhile) may hold
        # what was forgotten, and no scan can say what it will hold: no ERASED until it is gone.
        busy = home.live_artifacts(self.settings, owner=tenant_id)
        report: dict[str, Any] = {
            "tenant_id": tenant_id,
            "jobs": job_ids,
            "bytesRewritten": {name: e.bytes_rewritten for name, e in erasures.items() if e.bytes_rewritten},
            "byteScan": {
                "fingerprints": len(fingerprints),
                "files": result.files,
                "bytes": result.bytes,
                "hits": sum(result.hits.values()),
                "sharedWithLiveData": len(live & set(fingerprints)),
                "notScanned": _not_scanned(erasures, purged, data),
                "leftoversRemoved": len(swept),
                "artifactsInUse": len(busy),
                "scanned": result.areas(_root(files)),
                "dataDirectory": data.report(),
            },
            "keys": keys,
            "horizon": waited.report(),
            "deployment": deployment.of(self.settings, postgres_files_ours=data.directory is not None),
            "statistics": statistics,
            "wal": purged.report(),
            "seconds": {
                "rewrite": round(rewritten - started, 3),  # of which:
                "keys": round(rotated - started, 3),
                "wal": round(rewritten - compacted, 3),
                "scan": round(time.perf_counter() - rewritten, 3),
            },
        }
        unerased = _unerased(result, erasures, busy)
        if unerased:
            self._refuse(tenant_id, report, unerased)
        # Keys are gone for good once the KEK is rotated, or when the tenant's keys and vault file are.
        report["keysGone"] = bool(keys.get("rotated")) or not keys.get("vaultFile", True)
        report["scannedStores"] = {name: e.scanned for name, e in erasures.items()}
        return self._mark_all_erased(tenant_id, report)

    def wait_for_older_snapshots(self, tenant_id: str, job_ids: list[str]) -> horizon.Horizon:
        """Wait until no snapshot can see what these jobs deleted (a rewrite would keep it,
        lib/forget/horizon.py); refuse, rewriting nothing, when one outlives `horizon_seconds`."""
        waited = horizon.wait_past(self.store.conninfo, timeout=self.horizon_seconds)
        if waited.holders:
            held = {holder.label(): 1 for holder in waited.holders}
            self._refuse(tenant_id, {"jobs": job_ids, "horizon": waited.report()}, held)
        return waited

    def _refuse(self, tenant_id: str, report: dict[str, Any], hits: dict[str, int]) -> NoReturn:
        """Audit the failed erasure of each job of `report` and raise: nothing is marked."""
        detail: dict[str, Any] = {key: report[key] for key in ("byteScan", "horizon") if key in report}
        with self.store.transaction() as conn:
            for job_id in report["jobs"]:
                self._audit(conn, job_id, tenant_id, "erasure_failed", detail)
        raise ErasureIncomplete(hits)

    def _mark_all_erased(self, tenant_id: str, report: dict[str, Any]) -> dict[str, Any]:
        erased = _now()
        with self.store.transaction() as conn:
            for job_id in report["jobs"]:
                self._mark_erased(conn, job_id, tenant_id, erased, report)
            conn.execute("DELETE FROM control.erasure_fingerprints WHERE job_id = ANY(%s)", (report["jobs"],))
        report["erased"] = len(report["jobs"])
        report["erasedAt"] = erased.isoformat()
        return report

    def rotate_keys(self, tenant_id: str) -> dict[str, Any]:
        """Rotate the tenant's KEK: every wrapped key of the tenant is rewrapped under a new KEK in
        one transaction, then the vault file is overwritten in place with the new KEK alone. From
        then on, a wrapped key left in WAL, a dead tuple or a replica opens nothing. Counts only."""
        keys = self.store.keys
        rotations = KeyRotation(keys)
        with self.store.transaction() as conn:
            rotation = rotations.begin(conn, tenant_id)
        faults.point("kek.committed")
        if rotation is None:  # no live tenant key: nothing written yet, or the tenant is destroyed
            return {"rotated": False, "vaultFile": keys.vault.exists(tenant_id)}
        rotations.finish(rotation)
        return {
            "rotated": True,
            "rewrapped": rotation.rewrapped,
            "rekeyed": rotation.rekeyed,
            "retiredDestroyed": rotation.retired_destroyed,
            "keksLeft": len(keys.vault.kek_ids(tenant_id)),
        }

    def scan(
        self,
        *,
        job_ids: list[str],
        files: set[Path],
        exclude: set[int] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> tuple[list[int], bytescan.ScanResult]:
        """Byte-scan `files` for the fingerprints the cascade took of these jobs' deleted data
        (less `exclude`: fingerprints of data still live, which a scan cannot tell apart)."""
        with self.store.transaction() as conn:
            fingerprints = [
                int(r[0])
                for r in conn.execute(
                    "SELECT DISTINCT fingerprint FROM control.erasure_fingerprints"
                    " WHERE job_id = ANY(%s) AND fingerprint <> 0",
                    (job_ids,),
                )
            ]
            base = bytescan.base_from_key(self.store.keys.control_key(conn))
        _checkpoint(self.store.conninfo)  # pages of the rewritten files reach the disk we scan
        wanted = [fp for fp in fingerprints if fp not in (exclude or set())]
        return fingerprints, bytescan.scan(files, wanted, base, progress=progress)

    def _mark_erased(
        self, conn: psycopg.Connection, job_id: str, tenant_id: str, erased: datetime, report: dict[str, Any]
    ) -> None:
        row = conn.execute(
            "SELECT targets, proof FROM control.deletion_jobs WHERE job_id = %s FOR UPDATE", (job_id,)
        ).fetchone()
        assert row is not None
        targets, proof = dict(row[0] or {}), dict(row[1] or {})
        targets["physical"] = f"ERASED:{erased.isoformat()}"
        if str(targets.get("backups", "")).startswith("PENDING_SHRED:"):
            # No readable copy of the destroyed key is left in the key store's files now.
            targets["backups"] = "SHREDDED:" + str(targets["backups"]).partition(":")[2]
        proof["targets"] = targets
        proof["guarantees"] = guarantees.at_erasure(
            proof.get("guarantees"),
            str((proof.get("scope") or {}).get("type", "")),
            erased_at=erased.isoformat(),
            keys_gone=bool(report["keysGone"]),
            scanned=report["scannedStores"],
        )
        proof["erasure"] = {
            "erasedAt": erased.isoformat(),
            "bytesRewritten": report["bytesRewritten"],
            "byteScan": report["byteScan"],
            "keys": report["keys"],
            "deployment": report["deployment"],
            "statistics": report["statistics"],
            "wal": report["wal"],
        }
        mark_erased(conn, job_id, targets=targets, proof=proof, erased=erased)
        self._audit(conn, job_id, tenant_id, "erased", {"byteScan": report["byteScan"]})
        # Queued with the state change, as COMPLETE's is: sent only where the operator asked for it.
        conn.execute(
            "INSERT INTO control.outbox (job_id, tenant_id, kind, payload) VALUES (%s, %s, 'deletion.erased', %s)",
            (job_id, tenant_id, json.dumps({"jobId": job_id, "scopeHash": proof.get("scopeHash")})),
        )

    @staticmethod
    def _audit(conn: psycopg.Connection, job_id: str, tenant_id: str, event: str, detail: dict[str, Any]) -> None:
        conn.execute(
            "INSERT INTO control.audit (job_id, tenant_id, event, state, detail) VALUES (%s, %s, %s, 'COMPLETE', %s)",
            (job_id, tenant_id, event, json.dumps(detail)),
        )


def _unerased(result: bytescan.ScanResult, erasures: dict[str, Erasure], busy: list[Path]) -> dict[str, int]:
    """What stops the jobs being marked ERASED: files with hits, records a store still holds, artifacts
    of the tenant in use."""
    return {
        **{_relative(path): n for path, n in result.hits.items()},
        **{f"{name} (records)": e.leftovers for name, e in erasures.items() if e.leftovers},
        **{f"{_relative(str(path))} (in use)": 1 for path in busy},
    }


def _not_scanned(erasures: dict[str, Erasure], purged: wal.WalPurge, data: datadir.DataFiles) -> list[str]:
    """What the byte scan could not read: stores whose files are elsewhere, a remote pg_wal and data directory."""
    return sorted(
        [name for name, e in erasures.items() if not e.scanned]
        + ([] if purged.directory is not None else [wal.NOT_SCANNED])
        + ([] if data.directory is not None else [datadir.NOT_SCANNED])
    )


def _checkpoint(conninfo: str) -> None:
    try:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute("CHECKPOINT")
    except psycopg.Error:
        pass  # not a superuser on an external server: its files are not scanned here anyway


def _root(files: set[Path]) -> Path:
    """The directory holding every scanned file (HOME, for the embedded services)."""
    if not files:
        return Path("/")
    return Path(os.path.commonpath([str(f.parent) for f in files]))


def _relative(path: str) -> str:
    """A file named without the machine's directories above the store (for errors and audit)."""
    parts = Path(path).parts
    return str(Path(*parts[-3:])) if len(parts) > 3 else path
