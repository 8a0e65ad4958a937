"""Forget benchmark: one subject's full cascade, and a batch of 100 subjects in one run, against the
naive deletion of the seed article (DELETE rows, Chroma delete by where, cache delete; no
verification) on an identical copy of the tenant, measured in the same run.

    .venv/bin/python -m benchmarks.forget                        # 100,000 memories, 1,000 subjects
    .venv/bin/python -m benchmarks.forget --n 20000 --subjects 200
    .venv/bin/python -m benchmarks.forget --home DIR             # keep the tenants; rerun measures again

Targets: one subject's cascade with verification within 2x the naive baseline; the batch of 100
within 10x one subject.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.ingest import corpus
from memory_pipelines.lib.deletion import DeletionService
from memory_pipelines.lib.derived import DerivedStores, default_embedder, open_derived, sync_embeddings
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.services import stop_services
from memory_pipelines.lib.settings import Settings
from memory_pipelines.lib.store import MemoryStore
from memory_pipelines.lib.vectors import metadata_of


def build(store: MemoryStore, tenant: str, items: list[dict[str, Any]]) -> list[str]:
    """A shared-pool tenant with these memories (team members added first); returns their ids."""
    store.create_tenant(tenant_id=tenant, sharing_mode="shared_pool")
    for item in items:
        if "team_id" in item:
            store.add_team_member(tenant_id=tenant, team_id=item["team_id"], user_id=item["user_id"])
    ids: list[str] = []
    for start in range(0, len(items), 5000):
        ids += [r.memory_id for r in store.write_many(tenant_id=tenant, items=items[start : start + 5000])]
    return ids


def copy_vectors(derived: DerivedStores, source: str, target: str, id_map: dict[str, str]) -> None:
    """Give the naive copy the same vectors without embedding everything twice."""
    got = derived.vectors.collection(source).get(include=["embeddings"])
    current = {cv.memory_id: cv for cv in derived.store.current_versions(tenant_id=target)}
    col = derived.vectors.collection(target)
    for start in range(0, len(got["ids"]), 2000):
        ids = got["ids"][start : start + 2000]
        cvs = [current[id_map[i.split(":")[0]]] for i in ids]
        col.add(
            ids=[cv.record_id for cv in cvs],
            embeddings=got["embeddings"][start : start + 2000],
            metadatas=[metadata_of(cv) for cv in cvs],
        )


def naive_forget(derived: DerivedStores, tenant: str, user: str) -> float:
    """The seed's gdpr_delete: rows, vectors by where, cache; no lineage, no verification, no keys."""
    started = time.perf_counter()
    store = derived.store
    with store.transaction() as conn:
        conn.execute(
            "DELETE FROM memory.memory_versions v USING memory.memories m WHERE m.tenant_id = v.tenant_id"
            " AND m.memory_id = v.memory_id AND m.tenant_id = %s AND m.user_id = %s",
            (tenant, user),
        )
        conn.execute("DELETE FROM memory.memories WHERE tenant_id = %s AND user_id = %s", (tenant, user))
    derived.vectors.collection(tenant).delete(where={"user_id": user})
    with store.transaction() as conn:
        conn.execute("DELETE FROM derived.recall_cache WHERE tenant_id = %s", (tenant,))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--subjects", type=int, default=1_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--home", type=Path)
    args = parser.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="mp-bench-forget-"))
    settings = Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})
    store = open_store(settings)
    derived = open_derived(settings, store, embedder=default_embedder())
    items = corpus(args.n, args.subjects)
    for n, item in enumerate(items):  # team memories by a member of that team
        if "team_id" in item:
            item["user_id"] = f"user{(n // 10 % 10) * 7 % args.subjects:04d}"

    setup = time.perf_counter()
    with store.transaction() as conn:
        built = conn.execute("SELECT count(*) FROM memory.tenants WHERE tenant_id = 'bench-naive'").fetchone()
    if built and built[0] and args.home is not None:
        print(f"reusing the tenants built earlier under {home}")
    else:
        full_ids = build(store, "bench-full", items)
        derived.sync_all(tenant_id="bench-full")
        naive_ids = build(store, "bench-naive", items)
        copy_vectors(derived, "bench-full", "bench-naive", dict(zip(full_ids, naive_ids, strict=True)))
        sync_embeddings(store, derived.vectors, tenant_id="bench-naive")
        took = time.perf_counter() - setup
        print(f"setup: {args.n:,} memories from {args.subjects} subjects, twice, in {took:.1f} s")
    # Subjects not forgotten yet in both copies, so a kept --home can be measured again.
    # A typical subject first (the median memory count; a few subjects author every team memory).
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT user_id, count(*) FROM memory.memories WHERE tenant_id = 'bench-full' AND user_id IN"
            " (SELECT user_id FROM memory.memories WHERE tenant_id = 'bench-naive') GROUP BY user_id ORDER BY 1"
        ).fetchall()
    median = sorted(n for _, n in rows)[len(rows) // 2] if rows else 0
    available = sorted((r[0] for r in rows), key=lambda u: dict(rows)[u] != median)
    if len(available) < 1 + args.batch:
        raise SystemExit(f"only {len(available)} subjects left to forget under {home}; use a new --home")

    service = DeletionService(derived)
    one = available[0]
    naive_seconds = naive_forget(derived, "bench-naive", one)
    job = service.request(tenant_id="bench-full", subject=one)
    started = time.perf_counter()
    report = service.run_batch(tenant_id="bench-full", job_ids=[job["job_id"]])
    one_seconds = time.perf_counter() - started
    print(
        f"one subject ({report['stores']['primary']} versions): full cascade {one_seconds:.2f} s,"
        f" naive {naive_seconds:.2f} s, ratio {one_seconds / naive_seconds:.1f}x (target <= 2x:"
        f" {'met' if one_seconds <= 2 * naive_seconds else 'MISSED'})"
    )
    print("  per step (s):", report["seconds"])

    batch_users = available[1 : 1 + args.batch]
    jobs = [service.request(tenant_id="bench-full", subject=u)["job_id"] for u in batch_users]
    started = time.perf_counter()
    report = service.run_batch(tenant_id="bench-full", job_ids=jobs)
    batch_seconds = time.perf_counter() - started
    print(
        f"batch of {args.batch} subjects ({report['stores']['primary']} versions) in one run: {batch_seconds:.2f} s,"
        f" {batch_seconds / one_seconds:.1f}x one subject (target <= 10x:"
        f" {'met' if batch_seconds <= 10 * one_seconds else 'MISSED'})"
    )
    print("  per step (s):", report["seconds"])
    states = {service.status(job_id=j)["state"] for j in jobs}
    print("batch states:", states)
    store.close()
    if args.home is None:
        stop_services(settings)


if __name__ == "__main__":
    main()
