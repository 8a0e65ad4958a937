"""Erasure that cannot fail by chance: many physical erasures of random forgets, counting hits.

    .venv/bin/python -m benchmarks.erasure_loop                         # 50 erasures, 600 memories
    .venv/bin/python -m benchmarks.erasure_loop --erasures 100 --memories 2000
    .venv/bin/python -m benchmarks.erasure_loop --without-fix           # the old erasure, for comparison

One tenant of --memories memories (real all-MiniLM-L6-v2 vectors, every derived store synced) on
one PostgreSQL and one long-running Chroma server under a temporary HOME, as in production. Each
round forgets at random either one subject or one to three single memories, runs the cascade to
COMPLETE, then the tenant's physical erasure (`ErasureService.erase_tenant`: the collection rebuilt
in the same server, the tenant's partitions rewritten, the byte scan of keyed fingerprints), and
writes as many new memories as were forgotten (synced), so the tenant keeps its size.

Counted per erasure:
- spurious hits: the erasure's own byte scan found a fingerprint after the rewrite
  (ErasureIncomplete), with the files it named;
- raw hits: independently of the fingerprints, every 16-byte window at every offset of each
  forgotten vector's float32 bytes (read from Chroma before the forget), searched in the tenant's
  Chroma files after the erasure;
- elsewhere: the same windows in the files of a new tenant's collection created right after the
  erasure (a first sync on the same server), which no erasure of this tenant scans.

--without-fix skips clearing the rebuilt index's unused capacity (the erasure before the fix).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.homes import discard, temporary_home
from benchmarks.ingest import corpus
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.erasure import ErasureIncomplete, ErasureService
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores import bytescan
from memory_pipelines.lib.stores.chroma import index as vectors
from memory_pipelines.lib.stores.derived import DerivedStores, open_derived, sync_embeddings

TEAMS = 5


def raw_windows(stored: Sequence[Any]) -> list[bytes]:
    """Every 16-byte window, at every offset, of each vector's float32 bytes."""
    out: list[bytes] = []
    for vector in stored:
        data = np.asarray(vector, dtype="<f4").tobytes()
        out += [data[i : i + bytescan.WINDOW] for i in range(len(data) - bytescan.WINDOW + 1)]
    return out


def raw_hits(files: Sequence[Path], windows: list[bytes], base: int) -> dict[str, int]:
    """Files holding any of `windows` (file name -> distinct windows found)."""
    if not windows:
        return {}
    result = bytescan.scan(files, bytescan.fingerprints(windows, base), base)
    return {Path(path).name: n for path, n in result.hits.items()}


def items(rng: random.Random, start: int, count: int, subjects: list[str]) -> list[dict[str, Any]]:
    """`count` memories with unique texts (their vectors exist nowhere else), a tenth team memories."""
    texts = corpus(start + count, 1, seed=rng.randrange(1 << 30))[start:]
    out = []
    for i, item in enumerate(texts):
        user = rng.choice(subjects)
        entry: dict[str, Any] = {"user_id": user, "text": f"{item['text']} [{start + i}]"}
        if i % 10 == 0:
            entry["team_id"] = f"team{int(user.removeprefix('user')) % TEAMS}"
        out.append(entry)
    return out


def write(store: MemoryStore, tenant: str, batch: list[dict[str, Any]]) -> None:
    for item in batch:
        if "team_id" in item:
            store.add_team_member(tenant_id=tenant, team_id=item["team_id"], user_id=item["user_id"])
    store.write_many(tenant_id=tenant, items=batch)


def pick(rng: random.Random, store: MemoryStore, tenant: str) -> tuple[dict[str, Any], list[str]]:
    """A random scope (one subject, or one to three single memories) and its current record ids."""
    current = store.current_versions(tenant_id=tenant)
    by_user: dict[str, list[str]] = {}
    for cv in current:
        by_user.setdefault(cv.user_id, []).append(cv.record_id)
    if rng.random() < 0.5:
        user = rng.choice(sorted(by_user))
        return {"subject": user}, by_user[user]
    chosen = rng.sample(current, k=min(len(current), rng.randint(1, 3)))
    return {"memory_ids": [cv.memory_id for cv in chosen]}, [cv.record_id for cv in chosen]


def neighbour_files(derived: DerivedStores, round_no: int, run: str) -> tuple[str, list[Path]]:
    """A new tenant's first sync on the same server: its collection's files are created now."""
    store = derived.store
    tenant = f"bench-neighbour-{run}-{round_no}"
    store.write_many(
        tenant_id=tenant,
        items=[{"user_id": "nina", "text": f"Neighbour note {n} of round {round_no} in {run}"} for n in range(5)],
    )
    sync_embeddings(store, derived.vectors, tenant_id=tenant)
    return tenant, [f for f in derived.vectors.files(tenant) if f.name != "chroma.sqlite3"]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--erasures", type=int, default=50, help="erasures to run (one forget each)")
    parser.add_argument("--memories", type=int, default=600, help="memories of the tenant (kept by top-ups)")
    parser.add_argument("--subjects", type=int, default=40, help="subjects among whom the memories are spread")
    parser.add_argument("--seed", type=int, default=19)
    parser.add_argument("--home", type=Path, help="HOME to use (default: a temporary one, stopped afterwards)")
    parser.add_argument("--without-fix", action="store_true", help="skip clearing unused index capacity (old code)")
    parser.add_argument("--no-neighbours", action="store_true", help="skip the new-tenant collection check")
    args = parser.parse_args()
    if args.without_fix:
        vectors.clear_unused_capacity = lambda segment: 0
    rng = random.Random(args.seed)
    home = args.home or temporary_home("mp-bench-erasure-")
    settings = Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})
    store = open_store(settings)
    derived = open_derived(settings, store)
    service = DeletionService(derived)
    erasure = ErasureService(derived, settings=settings)
    run = time.strftime("%H%M%S")
    tenant = f"bench-erasure-{run}"
    subjects = [f"user{n:03d}" for n in range(args.subjects)]
    next_subject = args.subjects
    base = int.from_bytes(os.urandom(8), "little") | 1  # raw scans: a key of this run only
    print(
        f"home {home}; tenant {tenant}: {args.memories} memories of {args.subjects} subjects; "
        f"{args.erasures} erasures; {'WITHOUT the fix (old erasure)' if args.without_fix else 'with the fix'}"
    )
    totals: Counter[str] = Counter()
    hit_files: Counter[str] = Counter()
    seconds: dict[str, list[float]] = {"erasure": [], "rewrite": [], "scan": [], "round": []}
    written = 0
    try:
        started = time.perf_counter()
        store.create_tenant(tenant_id=tenant, sharing_mode="shared_pool")
        write(store, tenant, items(rng, 0, args.memories, subjects))
        written = args.memories
        derived.sync_all(tenant_id=tenant)
        print(f"setup: {time.perf_counter() - started:.1f} s (written and every derived store synced)")
        pending_raw: list[bytes] = []  # windows of forgets whose erasure has not succeeded yet
        for round_no in range(1, args.erasures + 1):
            round_started = time.perf_counter()
            scope, records = pick(rng, store, tenant)
            stored = derived.vectors.vectors_of(tenant, records)
            if "subject" in scope:
                jobs = [service.request(tenant_id=tenant, subject=scope["subject"])["job_id"]]
            else:
                jobs = [service.request(tenant_id=tenant, memory_id=m)["job_id"] for m in scope["memory_ids"]]
            report = service.run_batch(tenant_id=tenant, job_ids=jobs)
            if set(report["jobs"].values()) != {"COMPLETE"}:
                raise SystemExit(f"round {round_no}: the cascade ended {report['jobs']}")
            pending_raw += raw_windows(list(stored.values()))
            outcome = "clean"
            erase_started = time.perf_counter()
            try:
                erased = erasure.erase_tenant(tenant_id=tenant)
                seconds["rewrite"].append(erased["seconds"]["rewrite"])
                seconds["scan"].append(erased["seconds"]["scan"])
            except ErasureIncomplete as exc:
                outcome = "SPURIOUS HIT: " + ", ".join(f"{path} ({n})" for path, n in sorted(exc.hits.items()))
                totals["spurious"] += 1
                hit_files.update(Path(path).name for path in exc.hits)
            seconds["erasure"].append(time.perf_counter() - erase_started)
            totals["erasures"] += 1
            totals["vectors"] += len(stored)
            chroma_files = [f for f in derived.vectors.files(tenant) if f.name != "chroma.sqlite3"]
            raw = raw_hits(chroma_files, pending_raw, base)
            if raw:
                totals["raw"] += 1
            if outcome == "clean":
                pending_raw = []  # erased and proven: later rounds look for their own forgets
            elsewhere: dict[str, int] = {}
            if not args.no_neighbours:
                _, files = neighbour_files(derived, round_no, run)
                elsewhere = raw_hits(files, raw_windows(list(stored.values())), base)
                totals["elsewhere"] += bool(elsewhere)
            if "subject" in scope:
                # A new subject takes the forgotten one's place (ids are never reused).
                subjects.remove(scope["subject"])
                subjects.append(f"user{next_subject:03d}")
                next_subject += 1
            forgotten = len(records)
            write(store, tenant, items(rng, written, forgotten, subjects))
            written += forgotten
            derived.sync_all(tenant_id=tenant)
            seconds["round"].append(time.perf_counter() - round_started)
            what = f"subject ({len(records)} memories)" if "subject" in scope else f"{len(records)} memories"
            print(
                f"{round_no:3d}  forget {what:24s} {len(stored):3d} vectors  erasure {seconds['erasure'][-1]:5.2f} s"
                f"  {outcome}; raw {raw or 0}; elsewhere {elsewhere or 0}",
                flush=True,
            )
    finally:
        store.close()
        if args.home is None:
            discard(home)
    erasures = totals["erasures"]
    print(f"\nerasures: {erasures} ({totals['vectors']} vectors forgotten in all)")
    print(
        f"spurious hits (the erasure's fingerprint scan after the rewrite): {totals['spurious']} of {erasures}"
        + (f" in {dict(hit_files)}" if hit_files else "")
    )
    print(f"raw hits (forgotten float32 bytes in the tenant's Chroma files after the erasure): {totals['raw']}")
    if not args.no_neighbours:
        print(f"elsewhere (forgotten bytes in a new tenant's collection files): {totals['elsewhere']}")
    for name in ("erasure", "rewrite", "scan", "round"):
        values = seconds[name]
        if values:
            print(
                f"{name:8s} p50 {statistics.median(values):6.2f} s  p95 {percentile(values, 0.95):6.2f} s"
                f"  total {sum(values):7.1f} s"
            )


if __name__ == "__main__":
    main()
