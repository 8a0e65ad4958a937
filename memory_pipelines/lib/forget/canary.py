"""End-to-end canary drill: write unique canary memories in an isolated tenant, push them through
every derived store, forget them, and check that nothing of them is left anywhere."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypedDict

import psycopg

from memory_pipelines.lib.backups.service import BackupService
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import CanaryDrill, CanaryRestore
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "CANARY_PREFIX",
    "RESERVED_TENANT_IDS",
    "RESERVED_TENANT_PREFIXES",
    "files_containing",
    "is_reserved_tenant",
    "retired_tenants",
    "run_canary_drill",
]

# -- tenants that are never `tenants` partitions ------------------------------------------------
# The canary drill's tenants (`canary-...`) and the evaluation's (`eval`, `eval-...`) are the
# platform's own (lib/infra/validation.py): no customer door accepts them; sensors, schedules and the CLI
# treat them as outside the tenant partitions.
CANARY_PREFIX = "canary-"
RESERVED_TENANT_IDS = validation.RESERVED_TENANT_IDS
RESERVED_TENANT_PREFIXES = validation.RESERVED_TENANT_PREFIXES
is_reserved_tenant = validation.is_reserved_tenant


def retired_tenants(store: MemoryStore, candidates: list[str]) -> set[str]:
    """Those of `candidates` that must not stay partitions: reserved ids, tenants gone from the
    store, and offboarded tenants (deleted, with their TENANT deletion COMPLETE). A tenant whose
    deletion is still running keeps its partition: its forget run reports to it."""
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT c.tenant_id FROM unnest(%s::text[]) AS c(tenant_id) WHERE NOT EXISTS ("
            " SELECT 1 FROM memory.tenants x WHERE x.tenant_id = c.tenant_id AND (x.deleted_at IS NULL"
            "  OR NOT EXISTS (SELECT 1 FROM control.deletion_jobs j WHERE j.tenant_id = x.tenant_id"
            "   AND j.scope = 'TENANT' AND j.state = 'COMPLETE')))",
            (list(candidates),),
        ).fetchall()
    return {r[0] for r in rows} | {t for t in candidates if is_reserved_tenant(t)}


def file_bytes(root: Path) -> Iterator[tuple[Path, bytes]]:
    """Every regular file under `root` (no symlink followed) with its raw bytes; unreadable ones skipped."""
    for path in root.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        try:
            yield path, path.read_bytes()
        except OSError:
            continue


def files_containing(root: Path, needles: list[bytes]) -> dict[bytes, list[str]]:
    """needle -> files under `root` holding it, read as raw bytes (heap, WAL, SQLite, Parquet, logs)."""
    hits: dict[bytes, list[str]] = {needle: [] for needle in needles}
    for path, data in file_bytes(root):
        for needle in needles:
            if needle in data:
                hits[needle].append(str(path.relative_to(root)))
    return hits


class _Restored(TypedDict, total=False):
    """The drill's `after_restore`, when it restored the canary tenant."""

    after_restore: CanaryRestore


def run_canary_drill(derived: DerivedStores, *, home: Path | None, backups: BackupService | None = None) -> CanaryDrill:
    """Run the drill; `passed` is true only when every count of leftovers is zero.

    With `backups`, the canary tenant is backed up before the forget and restored from that backup
    after it (then its derived stores rebuilt): the canaries must still be nowhere.
    """
    started = time.perf_counter()
    store = derived.store
    stamp = datetime.now(UTC).strftime("%Y%m%d%H%M%S")
    tenant = f"{CANARY_PREFIX}{stamp}-{uuid.uuid4().hex[:6]}"
    secrets = [f"canary{uuid.uuid4().hex}" for _ in range(3)]
    written = _write_canaries(store, tenant, secrets)
    materialized = derived.sync_all(tenant_id=tenant)
    recalled_before = derived.recaller.recall(
        tenant_id=tenant, user_id="canary-witness", team_id="drill", query="team vault phrase", k=5
    )
    backup = backups.backup(tenant_id=tenant) if backups is not None else None
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="canary-subject", basis="user-request")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    # The drill waits for the physical erasure too: the rewrite, and its byte scan for the
    # fingerprints of everything the cascade deleted.
    erasure = _erase(derived, tenant)
    status = service.status(job_id=job["job_id"])
    leftovers = _leftovers(derived, tenant, written, secrets, home)
    leftovers["erasure_scan_hits"] = int(erasure.get("byteScan", {}).get("hits", 0)) + int(
        not str(status.get("targets", {}).get("physical", "")).startswith("ERASED:")
    )
    result: _Restored = {}
    if backups is not None and backup is not None:
        report = backups.restore(tenant_id=tenant, backup_id=backup["backup_id"])
        derived.sync_all(tenant_id=tenant)  # the backfill the restore sensor launches
        after = _leftovers(derived, tenant, written, secrets, home)
        result["after_restore"] = {"state": report["state"], "leftovers": after}
        leftovers = {name: count + after.get(name, 0) for name, count in leftovers.items()}
        if report["state"] != "COMPLETE":
            leftovers["restore_not_complete"] = 1
    witness = store.list_visible(tenant_id=tenant, user_id="canary-witness")
    removed = _remove_tenant(service, tenant)
    return {
        "tenant": tenant,
        "job_id": job["job_id"],
        "state": status["state"],
        "canaries": len(written),
        "recalled_before_forget": len(recalled_before),
        "materialized": {
            name: counts.get("records", counts.get("rows", counts.get("summaries", 0)))
            for name, counts in materialized.items()
        },
        "leftovers": leftovers,
        "physical_erasure": {
            "state": str(status.get("targets", {}).get("physical", "")).partition(":")[0],
            "bytes_rewritten": sum(erasure.get("bytesRewritten", {}).values()),
            "files_scanned": erasure.get("byteScan", {}).get("files", 0),
            "fingerprints": erasure.get("byteScan", {}).get("fingerprints", 0),
        },
        **result,
        "witness_memories_kept": len(witness),
        "tenant_removed": removed,
        "passed": status["state"] == "COMPLETE"
        and not any(leftovers.values())
        and len(witness) == 1
        and removed == "COMPLETE",
        "seconds": round(time.perf_counter() - started, 3),
    }


def _write_canaries(store: MemoryStore, tenant: str, secrets: list[str]) -> list[Any]:
    """Make the drill's tenant: the subject's three canaries (personal, with a query, and a team
    memory) and the witness's memory that must stay. Returns the canaries as written."""
    with validation.platform_owned():
        store.create_tenant(tenant_id=tenant, sharing_mode="shared_pool")
    store.add_team_member(tenant_id=tenant, team_id="drill", user_id="canary-subject")
    store.add_team_member(tenant_id=tenant, team_id="drill", user_id="canary-witness")
    written = [
        store.write(
            tenant_id=tenant,
            user_id="canary-subject",
            text=f"My locker code is {secrets[0]}",
            original_query=f"what is {secrets[0]}?",
        ),
        store.write(
            tenant_id=tenant, user_id="canary-subject", text=f"Travel plan reference {secrets[1]}", category="general"
        ),
        store.write(
            tenant_id=tenant, user_id="canary-subject", text=f"Team vault phrase {secrets[2]}", team_id="drill"
        ),
    ]
    store.write(tenant_id=tenant, user_id="canary-witness", text="The witness stays: it likes crosswords")
    return written


def _remove_tenant(service: DeletionService, tenant: str) -> str:
    """Offboard the drill's tenant (a TENANT deletion run to the end): nothing of it stays behind,
    not even as a partition. Returns the deletion's final state."""
    job = service.request(tenant_id=tenant, all_tenant=True, confirm=tenant, basis="offboarding")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    _erase(service.derived, tenant)
    return str(service.status(job_id=job["job_id"])["state"])


def _erase(derived: DerivedStores, tenant: str) -> dict[str, Any]:
    """The tenant's physical erasure, run now (a failed byte scan is reported, not raised)."""
    from memory_pipelines.lib.forget.erasure import ErasureIncomplete, ErasureService

    try:
        return ErasureService(derived).erase_tenant(tenant_id=tenant)
    except ErasureIncomplete as exc:
        return {"byteScan": {"hits": sum(exc.hits.values())}}


def _leftovers(
    derived: DerivedStores, tenant: str, written: list[Any], secrets: list[str], home: Path | None
) -> dict[str, int]:
    store = derived.store
    leftovers: dict[str, int] = {}
    probes = [f"My locker code is {secrets[0]}", f"travel plan {secrets[1]}", f"vault phrase {secrets[2]}"]
    leftovers["recall"] = sum(
        1
        for probe in probes
        for hit in derived.recaller.recall(
            tenant_id=tenant, user_id="canary-witness", team_id="drill", query=probe, k=10
        )
        if any(secret in hit["text"] for secret in secrets)
    )
    with store.transaction() as conn:
        leftovers["lineage"] = conn.execute(
            "SELECT count(*) FROM derived.lineage WHERE tenant_id = %s AND source_memory_id = ANY(%s)",
            (tenant, [w.memory_id for w in written]),
        ).fetchone()[0]  # type: ignore[index]
        leftovers["primary"] = conn.execute(
            "SELECT count(*) FROM memory.memories WHERE tenant_id = %s AND memory_id = ANY(%s)",
            (tenant, [w.memory_id for w in written]),
        ).fetchone()[0]  # type: ignore[index]
    leftovers["vectors"] = len({f"{w.memory_id}:{w.version}" for w in written} & derived.vectors.ids(tenant))
    if home is not None:
        try:
            with psycopg.connect(store.conninfo, autocommit=True) as conn:
                conn.execute("CHECKPOINT")  # heap pages reach the data files under HOME
        except psycopg.Error:
            pass  # an external server: its files are not under HOME anyway
        found = files_containing(home, [s.encode() for s in secrets])
        leftovers["files_under_home"] = len(set().union(*found.values()))
    return leftovers
