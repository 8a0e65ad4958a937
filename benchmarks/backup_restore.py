"""Backup, restore and retention benchmark, with raw AES-GCM on the same bytes as the baseline.

    .venv/bin/python -m benchmarks.backup_restore                    # 100,000 memories; sweep of 1,000,000 rows
    .venv/bin/python -m benchmarks.backup_restore --n 20000 --rows 100000

Figures: backup and restore of an N-memory tenant; our chunked stream encryption against one raw
AES-GCM call over the same archive bytes (target: at least 0.5 of raw); journal replay rate during
the restore; a retention sweep removing 10% of a tenant of --rows memories through the cascade.
"""

from __future__ import annotations

import argparse
import io
import time
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from benchmarks.forget import build
from benchmarks.homes import discard, temporary_home
from benchmarks.ingest import corpus
from memory_pipelines.lib.backups.service import BackupService
from memory_pipelines.lib.backups.storage import LocalBackupStorage
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.ledger import DeletionLedger
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.retention import rules as retention
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores.derived import open_derived
from memory_pipelines.lib.stores.embedding import HashingEmbedder

SWEEP_DAY = date(2026, 6, 15)


def timed_build(store: MemoryStore, tenant: str, items: list[dict[str, Any]]) -> float:
    started = time.perf_counter()
    build(store, tenant, items)
    return time.perf_counter() - started


def encryption_ratio(archive: bytes) -> dict[str, float]:
    """Our stream encryption vs one AES-GCM call over the same bytes (both in memory, best of 3)."""
    key = crypto.new_key()
    aad = crypto.aad("benchmark")
    raw = stream = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        AESGCM(key).encrypt(b"\x00" * 12, archive, aad)
        raw = min(raw, time.perf_counter() - started)
        sink = io.BytesIO()
        started = time.perf_counter()
        crypto.encrypt_stream(key, io.BytesIO(archive), sink, aad)
        stream = min(stream, time.perf_counter() - started)
    mb = len(archive) / 1e6
    return {"mb": mb, "raw_mb_s": mb / raw, "stream_mb_s": mb / stream, "ratio": raw / stream}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000, help="memories in the backed-up tenant")
    parser.add_argument("--rows", type=int, default=1_000_000, help="memories in the retention tenant")
    parser.add_argument("--home", type=Path)
    args = parser.parse_args()
    home = args.home or temporary_home("mp-bench-backup-")
    settings = Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})
    store = open_store(settings)
    # No embeddings here: backups, restores and sweeps never embed, and derived stores are empty.
    derived = open_derived(settings, store, embedder=HashingEmbedder())
    backups = BackupService(
        store,
        LocalBackupStorage(home / "backups"),
        staging=home / "backups" / ".staging",
        job_records=DeletionLedger(store),
    )
    service = DeletionService(derived)

    tenant = "bench-backup"
    took = timed_build(store, tenant, corpus(args.n, 1000))
    print(f"setup: {args.n:,} memories from 1,000 subjects in {took:.1f} s")
    started = time.perf_counter()
    manifest = backups.backup(tenant_id=tenant)
    backup_s = time.perf_counter() - started
    versions = manifest["rows"]["memory_versions"]
    print(
        f"backup: {versions:,} versions, {manifest['bytes'] / 1e6:.1f} MB sealed, {backup_s:.2f} s"
        f" ({versions / backup_s:,.0f} rows/s)"
    )
    with backups.context.scratch(tenant) as scratch:  # the very archive bytes the backup encrypted
        sealed = backups.listing.backup_row(tenant, manifest["backup_id"])
        archive = backups.loading.fetch_archive(sealed, scratch).read_bytes()
    figures = encryption_ratio(archive)
    print(
        f"encryption of the {figures['mb']:.1f} MB archive: stream {figures['stream_mb_s']:,.0f} MB/s vs raw AES-GCM"
        f" {figures['raw_mb_s']:,.0f} MB/s, ratio {figures['ratio']:.2f} (target >= 0.5:"
        f" {'met' if figures['ratio'] >= 0.5 else 'MISSED'})"
    )

    # Journal entries for the restore to replay: 50 subjects forgotten, 10% of memories tombstoned.
    forgotten = [f"user{i:04d}" for i in range(100, 150)]
    jobs = [service.request(tenant_id=tenant, subject=u)["job_id"] for u in forgotten]
    with store.transaction() as conn:
        some = [r[0] for r in conn.execute("SELECT memory_id FROM memory.memories WHERE tenant_id = %s", (tenant,))]
    retention_job = service.request_retention(
        tenant_id=tenant,
        day=SWEEP_DAY,
        memory_ids=some[::10],
        categories={"general": len(some[::10])},
        policy_version="benchmark",
    )
    assert retention_job is not None
    started = time.perf_counter()
    service.run_batch(tenant_id=tenant, job_ids=[*jobs, retention_job["job_id"]])
    print(f"forget 50 subjects + tombstone {len(some[::10]):,} memories: {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    report = backups.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    restore_s = time.perf_counter() - started
    entries = sum(report["replayed"]["journal_entries"].values())
    print(
        f"restore: {report['state']}, {report['loaded']['memory_versions']:,} versions loaded in"
        f" {report['load_seconds']:.2f} s, {entries:,} journal entries replayed in {report['replay_seconds']:.2f} s"
        f" ({entries / max(report['replay_seconds'], 1e-9):,.0f} entries/s), total {restore_s:.2f} s"
    )
    print("  rows removed by the replay:", report["replayed"]["rows_removed"])
    print("  verification (must be zeros):", report["verification"])

    sweep_tenant = "bench-retention"
    took = timed_build(store, sweep_tenant, corpus(args.rows, 1000, seed=11))
    with store.transaction() as conn:
        # 10% of the tenant reaches the end of its 2-year `general` retention on SWEEP_DAY.
        expired_at = datetime(SWEEP_DAY.year, SWEEP_DAY.month, SWEEP_DAY.day, 12, tzinfo=UTC) - timedelta(days=730)
        conn.execute("UPDATE memory.memory_versions SET category = 'general' WHERE tenant_id = %s", (sweep_tenant,))
        conn.execute(
            "UPDATE memory.memories SET created_at = %s WHERE tenant_id = %s AND abs(hashtext(memory_id)) %% 10 = 0",
            (expired_at, sweep_tenant),
        )
    print(f"setup: {args.rows:,} memories for the sweep in {took:.1f} s")
    started = time.perf_counter()
    result = retention.sweep(service, day=SWEEP_DAY, tenant_id=sweep_tenant)
    sweep_s = time.perf_counter() - started
    removed = result["removed"]
    print(
        f"retention sweep: {removed:,} of {args.rows:,} memories ({removed / args.rows:.0%}) removed, verified and"
        f" proven in {sweep_s:.1f} s ({removed / sweep_s:,.0f} memories/s); state"
        f" {result['jobs'][sweep_tenant]['state']}"
    )
    store.close()
    if args.home is None:
        discard(home)


if __name__ == "__main__":
    main()
