"""Forgetting at scale: one subject's cascade against the seed's naive delete, its growth with the
tenant, a batch of 100 subjects in one run, the physical erasure after them, and how fast a request
hides its subject.

    .venv/bin/python -m benchmarks.forget                                  # 10,000 and 100,000 memories
    .venv/bin/python -m benchmarks.forget --sizes 10000,100000,1000000 --home /tmp/forget-scale
    .venv/bin/python -m benchmarks.forget --sizes 1000000 --home /tmp/forget-scale   # rerun on kept tenants

Every subject has 100 memory versions, so a tenant of N memories has N/100 subjects; a tenth of each
subject's memories are team memories of its team (10 teams, shared pool). For each size, in one run:

- the seed's naive delete (DELETE rows, Chroma delete by where, cache delete; no lineage, no
  verification, no keys, no erasure) of a subject on an identical copy of the tenant, kept under its
  own HOME (own PostgreSQL and Chroma: the two copies share no cache and no file), and the same
  subject through the full cascade to COMPLETE (`request` + `run_batch`); `--repeats` subjects,
  alternating, the median reported;
- a batch of 100 other subjects in one `run_batch`; each of its `request`s is timed: acceptance is
  what hides the subject from every read (checked on the first), so its latency is hide-at-once;
- the physical erasure of the tenant after those deletions (`ErasureService.erase_tenant`: VACUUM
  FULL of the tenant's own partitions, Chroma collection rebuild and SQLite vacuum, byte scan).

Round trips are counted in this process for the naive delete and each one-subject cascade
(`benchmarks/roundtrips.py`): PostgreSQL statements, the BEGIN/COMMIT/SAVEPOINT of transactions
(`tx`), new connections, and requests to the Chroma server; printed per step of the cascade (the
request, freeze, each store, verify, prove) and in the summary table. `--one-only` measures the
naive delete and one subject alone (no batch, no erasure), so a kept tenant lasts many runs.

Setup goes through the store's API (`write_many`, each derived store's own sync). Vectors are
synthetic for the setup only (dense, deterministic per text, stored under the real model's name), so
building does not embed a million texts; the cascade runs with the real all-MiniLM-L6-v2 embedder.
`--chroma-max M` indexes only the first M/100 subjects in Chroma (the forgotten ones among them)
when a full index is too slow to build; PostgreSQL and every other store keep the whole tenant.

Targets: one subject within 2x naive at 100,000; one subject at 100,000 within 1.5x of 10,000; a
batch of 100 within 5x one subject; hide p50 under 50 ms at 1,000,000. The erasure is reported.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.homes import discard, temporary_home
from benchmarks.ingest import corpus
from benchmarks.roundtrips import RoundTrips
from memory_pipelines.lib.forget.deletion import DeletionBlocked, DeletionService
from memory_pipelines.lib.forget.erasure import ErasureIncomplete, ErasureService
from memory_pipelines.lib.infra.services import stop_services
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores.derived import (
    DerivedStores,
    default_embedder,
    open_derived,
    sync_embeddings,
    sync_keywords,
)
from memory_pipelines.lib.stores.embedding import MODEL_NAME

VERSIONS = 100  # memory versions of every subject
TEAMS = 10
WRITE_BATCH = 10_000  # items per write_many transaction


class SyntheticVectors:
    """Setup-only stand-in for the embedder: dense unit vectors, the same for the same text.

    Stored under the real model's name, so the cascade (which uses the real embedder) sees an
    ordinary index. A memory's vector is its template's direction plus noise of its own, so the
    index has clusters like real sentence embeddings (uniform random vectors are HNSW's worst case),
    and every vector's stored bytes are its own, as the byte scan of the erasure needs.
    """

    name = MODEL_NAME
    dimension = 384

    def __init__(self) -> None:
        self._templates: dict[str, np.ndarray] = {}

    @staticmethod
    def _seeded(key: str) -> np.ndarray:
        seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        return np.random.default_rng(seed).standard_normal(SyntheticVectors.dimension, dtype=np.float32)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.empty((len(texts), self.dimension), dtype=np.float32)
        for row, text in enumerate(texts):
            template = text.rpartition(" (note ")[0]
            base = self._templates.get(template)
            if base is None:
                base = self._templates.setdefault(template, self._seeded(template))
            vector = base + 0.35 * self._seeded(text)
            out[row] = vector / np.linalg.norm(vector)
        return out


@dataclass
class Copies:
    """The full tenant (cascade) and its copy under the naive home."""

    full: DerivedStores
    naive: DerivedStores
    full_setup: DerivedStores  # same stores, synthetic vectors (setup only)
    naive_setup: DerivedStores


def subject(n: int) -> str:
    return f"user{n:05d}"


def items_for(n: int, subjects: int) -> list[dict[str, Any]]:
    """`n` memories, VERSIONS per subject; each subject's team memories go to its own team."""
    items = corpus(n, subjects)
    for i, item in enumerate(items):
        s = i % subjects
        item["user_id"] = subject(s)
        if "team_id" in item:
            item["team_id"] = f"team{s % TEAMS}"
    return items


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def write_tenant(store: MemoryStore, tenant: str, subjects: int, items: list[dict[str, Any]]) -> None:
    """A shared-pool tenant whose every subject is a member of its team, with these memories."""
    store.create_tenant(tenant_id=tenant, sharing_mode="shared_pool")
    for s in range(subjects):
        store.add_team_member(tenant_id=tenant, team_id=f"team{s % TEAMS}", user_id=subject(s))
    write_items(store, tenant, items)


def write_items(store: MemoryStore, tenant: str, items: list[dict[str, Any]]) -> None:
    for start in range(0, len(items), WRITE_BATCH):
        store.write_many(tenant_id=tenant, items=items[start : start + WRITE_BATCH])


def build(store: MemoryStore, tenant: str, items: list[dict[str, Any]]) -> list[str]:
    """A shared-pool tenant with these memories (team members added first); returns their ids.

    Kept for the other benchmarks (backup_restore, recall), which build their tenants with it."""
    store.create_tenant(tenant_id=tenant, sharing_mode="shared_pool")
    for item in items:
        if "team_id" in item:
            store.add_team_member(tenant_id=tenant, team_id=item["team_id"], user_id=item["user_id"])
    ids: list[str] = []
    for start in range(0, len(items), 5000):
        ids += [r.memory_id for r in store.write_many(tenant_id=tenant, items=items[start : start + 5000])]
    return ids


def build_copies(copies: Copies, tenant: str, n: int, chroma_max: int, progress: Path) -> dict[str, float]:
    """Both copies of an n-memory tenant; returns seconds per setup phase. Each finished phase is
    recorded in `progress`, so a build that was interrupted resumes after its last one (the derived
    stores' syncs are idempotent)."""
    subjects = n // VERSIONS
    indexed = min(subjects, max(chroma_max // VERSIONS, 1)) if chroma_max else subjects
    seconds: dict[str, float] = json.loads(progress.read_text()) if progress.exists() else {}

    def done(phase: str, took: float) -> None:
        seconds[phase] = took
        progress.write_text(json.dumps(seconds))

    items = items_for(n, subjects)
    # Subjects with vectors first: their memories are written and indexed before the others exist.
    first = [item for i, item in enumerate(items) if i % subjects < indexed]
    rest = [item for i, item in enumerate(items) if i % subjects >= indexed]
    for name, derived, setup in (
        ("full", copies.full, copies.full_setup),
        ("naive", copies.naive, copies.naive_setup),
    ):
        if f"{name}: write" in seconds:
            continue
        write, chroma = populate(derived.store, setup, tenant, subjects, first, rest)
        done(f"{name}: chroma", chroma)
        done(f"{name}: write", write)
        print(f"  {tenant} {name} copy: written in {write:.0f} s, {len(first):,} vectors in {chroma:.0f} s", flush=True)
    full = copies.full
    for phase, build in (
        ("full: keyword_index", lambda: sync_keywords(full.store, tenant_id=tenant)),
        ("full: subject summaries", lambda: full.summaries.sync(tenant_id=tenant, scope="subject")),
        ("full: team summaries", lambda: full.summaries.sync(tenant_id=tenant, scope="team")),
        ("full: analytics", lambda: full.analytics.rebuild(store=full.store, tenant_id=tenant)),
    ):
        if phase not in seconds:
            done(phase, timed(build)[0])
            print(f"  {tenant} {phase} built in {seconds[phase]:.0f} s", flush=True)
    with copies.naive.store.transaction() as conn:
        # The seed kept no lineage: the naive copy has vectors and rows only.
        conn.execute("DELETE FROM derived.lineage WHERE tenant_id = %s", (tenant,))
    seconds["chroma vectors per copy"] = indexed * VERSIONS
    return seconds


def populate(
    store: MemoryStore,
    setup: DerivedStores,
    tenant: str,
    subjects: int,
    first: list[dict[str, Any]],
    rest: list[dict[str, Any]],
) -> tuple[float, float]:
    """Write `first`, index it in Chroma, write the rest; returns the write and the Chroma seconds."""
    write = timed(lambda: write_tenant(store, tenant, subjects, first))[0]
    chroma = timed(lambda: sync_embeddings(store, setup.vectors, tenant_id=tenant))[0]
    if rest:
        write += timed(lambda: write_items(store, tenant, rest))[0]
    return write, chroma


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


def remaining(store: MemoryStore, tenant: str) -> set[str]:
    """Subjects of the tenant that still have memories and no open deletion (one that blocked hides them)."""
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT DISTINCT m.user_id FROM memory.memories m JOIN memory.subjects s"
            " ON s.tenant_id = m.tenant_id AND s.user_id = m.user_id"
            " WHERE m.tenant_id = %s AND s.forgotten_at IS NULL",
            (tenant,),
        ).fetchall()
    return {r[0] for r in rows}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def warm_up(copies: Copies, service: DeletionService) -> None:
    """Imports, connection pools and server caches of both homes, on a small tenant of this run's own."""
    tenant = f"bench-warmup-{time.strftime('%Y%m%d%H%M%S')}"
    for derived, setup in ((copies.full, copies.full_setup), (copies.naive, copies.naive_setup)):
        write_tenant(derived.store, tenant, 2, items_for(2 * VERSIONS, 2))
        sync_embeddings(derived.store, setup.vectors, tenant_id=tenant)
    copies.full.sync_all(tenant_id=tenant)
    naive_forget(copies.naive, tenant, subject(0))
    job = service.request(tenant_id=tenant, subject=subject(0))
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])


def candidates(copies: Copies, tenant: str, setup: dict[str, float]) -> list[str]:
    """Subjects still in both copies with their vectors in Chroma (a kept --home measures fresh ones)."""
    indexed = {subject(s) for s in range(int(setup["chroma vectors per copy"]) // VERSIONS)}
    return sorted(remaining(copies.full.store, tenant) & remaining(copies.naive.store, tenant) & indexed)


def tenant_for(copies: Copies, home: Path, n: int, args: argparse.Namespace) -> tuple[str, dict[str, float]]:
    """An n-memory tenant with enough subjects left to measure: one built earlier under --home, or a new one."""
    needed = args.repeats + (0 if args.one_only else min(args.batch, n // VERSIONS // 2))
    for generation in range(100):
        capped = f"-c{args.chroma_max}" if 0 < args.chroma_max < n else ""  # a Chroma-capped tenant is another one
        tenant = f"bench-{n}{capped}" + (f"-{generation}" if generation else "")
        marker = home / f"built-{tenant}.json"
        if marker.exists():
            setup: dict[str, float] = json.loads(marker.read_text())
            if len(candidates(copies, tenant, setup)) >= needed:
                print(f"\nreusing {tenant}, built earlier under {home}")
                return tenant, setup
            continue
        progress = home / f"building-{tenant}.json"
        exists = copies.full.store.tenant_exists(tenant_id=tenant) or copies.naive.store.tenant_exists(tenant_id=tenant)
        if exists and not progress.exists():
            continue  # a setup that stopped inside a phase: not resumable
        if exists:
            print(f"\nresuming the setup of {tenant} after {', '.join(json.loads(progress.read_text()))}")
        setup = build_copies(copies, tenant, n, args.chroma_max, progress)
        # Phases done before a resume count with their own times; `total` is their sum.
        setup["total"] = sum(v for k, v in setup.items() if k != "chroma vectors per copy" and v == v)  # not NaN
        marker.write_text(json.dumps(setup))
        progress.unlink()
        return tenant, setup
    raise SystemExit(f"no room for another {n:,}-memory tenant under {home}; use a new --home")


def measure(
    copies: Copies,
    service: DeletionService,
    erasure: ErasureService,
    tenant: str,
    n: int,
    setup: dict[str, float],
    args: argparse.Namespace,
) -> dict[str, Any]:
    subjects = n // VERSIONS
    store = copies.full.store
    order = candidates(copies, tenant, setup)
    batch_size = min(args.batch, subjects // 2)
    result: dict[str, Any] = {
        "n": n,
        "tenant": tenant,
        "subjects": subjects,
        "batch": batch_size,
        "retry_size": args.retry_size,
        "chroma": int(setup["chroma vectors per copy"]),
    }

    naive: list[float] = []
    cascade: list[float] = []
    steps: list[dict[str, float]] = []
    naive_trips: list[dict[str, Any]] = []
    cascade_trips: list[dict[str, Any]] = []
    trips = RoundTrips()
    # Round trips of each run, by step: the request (acceptance), then the cascade's own phases.
    phases: dict[str, Callable[..., str]] = {
        "begin": lambda **_: "freeze",
        "delete_stores": lambda batch, names, **_: names[0] if len(names) == 1 else "copies",
        "_delete_one": lambda batch, name, prepared: name,  # a copy's own thread
        "verify": lambda batch: "verify",
        "complete": lambda batch: "prove",
        "release": lambda batch: "release",
    }
    for user in order[: args.repeats]:
        with trips.counting():
            trips.reset()
            naive.append(naive_forget(copies.naive, tenant, user))
            naive_trips.append(trips.snapshot())
            trips.reset()
            with trips.label_methods(service.cascade, phases):
                started = time.perf_counter()
                with trips.label("request"):
                    job = service.request(tenant_id=tenant, subject=user)
                report = service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
                cascade.append(time.perf_counter() - started)
            cascade_trips.append(trips.snapshot())
        steps.append(report["seconds"])
        if set(report["jobs"].values()) != {"COMPLETE"}:
            raise SystemExit(f"the cascade of {user} ended {report['jobs']}")
    result["naive"] = statistics.median(naive)
    result["one"] = statistics.median(cascade)
    result["naive_all"], result["one_all"] = naive, cascade
    median_run = cascade.index(result["one"]) if args.repeats % 2 else 0
    result["one_steps"] = steps[median_run]
    result["naive_trips"] = naive_trips[naive.index(result["naive"]) if args.repeats % 2 else 0]
    result["one_trips"] = cascade_trips[median_run]
    result["one_trips_all"] = [t["total"] for t in cascade_trips]
    result["one_versions"] = report["stores"]["primary"]

    if args.one_only:
        return result
    users = order[args.repeats : args.repeats + batch_size]
    hide: list[float] = []
    jobs: list[str] = []
    for i, user in enumerate(users):
        started = time.perf_counter()
        jobs.append(service.request(tenant_id=tenant, subject=user)["job_id"])
        hide.append(time.perf_counter() - started)
        if i == 0 and store.list_visible(tenant_id=tenant, user_id=user):
            raise SystemExit(f"{user} is still visible after the request was accepted")
    result["hide_p50"], result["hide_p95"] = percentile(hide, 0.5), percentile(hide, 0.95)
    started = time.perf_counter()
    try:
        report = service.run_batch(tenant_id=tenant, job_ids=jobs)
    except DeletionBlocked as exc:
        # Reported, not fatal: the jobs are then retried in smaller runs (what `deletion retry`
        # does), so the erasure below still covers the whole batch.
        result["batch_error"] = str(exc)
        report = {"jobs": {}, "seconds": {}, "stores": {"primary": len(users) * VERSIONS}}
    result["batch_run"] = time.perf_counter() - started
    if "batch_error" in result:
        started = time.perf_counter()
        for part in range(0, len(jobs), args.retry_size):
            retried = service.run_batch(tenant_id=tenant, job_ids=jobs[part : part + args.retry_size])
            if set(retried["jobs"].values()) - {"COMPLETE"}:
                raise SystemExit(f"the retry ended {set(retried['jobs'].values())}")
        result["batch_retry"] = time.perf_counter() - started
    if "batch_error" not in result and set(report["jobs"].values()) != {"COMPLETE"}:
        raise SystemExit(f"the batch ended {set(report['jobs'].values())}")
    result["batch_steps"] = report["seconds"]
    result["batch_versions"] = report["stores"]["primary"]

    started = time.perf_counter()
    try:
        erased = erasure.erase_tenant(tenant_id=tenant)
    except ErasureIncomplete as exc:
        result["erasure_error"] = f"{exc} ({exc.hits})"
        return result
    except Exception as exc:  # a store that fails the rewrite: reported with the figures measured so far
        result["erasure_error"] = f"after {time.perf_counter() - started:.1f} s: {type(exc).__name__}: {exc}"
        return result
    seconds = time.perf_counter() - started
    result["erasure"] = seconds
    result["erasure_report"] = erased
    return result


def mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def steps_line(steps: dict[str, float]) -> str:
    top = sorted(steps.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {value:.2f}" for name, value in top if value >= 0.01) or "all < 0.01"


def trips_total(t: dict[str, int]) -> str:
    """PostgreSQL statements (+ BEGIN/COMMIT/SAVEPOINT, + new connections) and Chroma requests."""
    return f"PG {t['pg']} (+{t['tx']} tx, +{t['connect']} conn), Chroma {t['chroma']}"


def pg_trips(t: dict[str, int]) -> str:
    return f"{t['pg']}+{t['tx']}"


def trips_steps(steps: dict[str, dict[str, int]]) -> str:
    return ", ".join(
        f"{name or 'other'} {t['pg']}+{t['tx']}tx" + (f"+{t['connect']}c" if t["connect"] else "") + f"/{t['chroma']}"
        for name, t in steps.items()
    )


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def print_size(r: dict[str, Any], setup: dict[str, float]) -> None:
    n = r["n"]
    print(f"\n== {n:,} memories ({r['tenant']}): {r['subjects']:,} subjects x {VERSIONS} versions ==")
    vectors = int(setup["chroma vectors per copy"])
    print("setup (s): " + ", ".join(f"{k} {v:.1f}" for k, v in setup.items() if k != "chroma vectors per copy"))
    if vectors < n:
        print(f"Chroma holds {vectors:,} of the {n:,} memories (--chroma-max); PostgreSQL holds them all")
    ratio = r["one"] / r["naive"]
    rows = [
        ("naive delete (seed), median", f"{r['naive']:.3f} s", "  ".join(f"{v:.3f}" for v in r["naive_all"])),
        (
            f"one subject to COMPLETE ({r['one_versions']} versions)",
            f"{r['one']:.3f} s",
            f"{ratio:.2f}x naive; runs " + "  ".join(f"{v:.3f}" for v in r["one_all"]),
        ),
        ("  its steps (s)", "", steps_line(r["one_steps"])),
        ("round trips of the naive delete", trips_total(r["naive_trips"]["total"]), ""),
        (
            "round trips of one subject",
            trips_total(r["one_trips"]["total"]),
            "runs " + "; ".join(trips_total(t) for t in r["one_trips_all"]),
        ),
        ("  by step (PG+tx/Chroma)", "", trips_steps(r["one_trips"]["steps"])),
    ]
    if "batch_run" not in r:  # --one-only
        rows.append(("batch and erasure", "skipped", "(--one-only)"))
        width = max(len(row[0]) for row in rows)
        for label, figure, note in rows:
            print(f"{label:{width}}  {figure:>12}  {note}")
        return
    rows += [
        (
            f"batch of {r['batch']} subjects, one run_batch ({r['batch_versions']:,} versions)",
            f"{r['batch_run']:.3f} s",
            f"BLOCKED after that time: {r['batch_error']}"
            if "batch_error" in r
            else f"{r['batch_run'] / r['one']:.2f}x one subject",
        ),
        ("  its steps (s)", "", steps_line(r["batch_steps"]) if r["batch_steps"] else "(none: the run raised)"),
        *(
            [("  then retried to COMPLETE", f"{r['batch_retry']:.3f} s", f"in runs of {r['retry_size']} jobs")]
            if "batch_retry" in r
            else []
        ),
        (
            f"hide at once: request() x {r['batch']}",
            f"p50 {r['hide_p50'] * 1000:.1f} ms",
            f"p95 {r['hide_p95'] * 1000:.1f} ms",
        ),
    ]
    if "erasure" in r:
        e = r["erasure_report"]
        rewritten = e["bytesRewritten"]
        rows.append(
            (
                f"physical erasure ({len(e['jobs'])} jobs)",
                f"{r['erasure']:.1f} s",
                f"rewrite {e['seconds']['rewrite']:.1f} s + scan {e['seconds']['scan']:.1f} s",
            )
        )
        rows.append(
            (
                "  bytes rewritten",
                mb(sum(rewritten.values())),
                ", ".join(f"{k} {mb(v)}" for k, v in sorted(rewritten.items(), key=lambda kv: -kv[1])),
            )
        )
        scan = e["byteScan"]
        rows.append(
            (
                "  byte scan",
                f"{scan['hits']} hits",
                f"{scan['files']} files, {mb(scan['bytes'])}, {scan['fingerprints']:,} fingerprints"
                + (f", not scanned: {scan['notScanned']}" if scan["notScanned"] else ""),
            )
        )
    else:
        rows.append(("physical erasure", "FAILED", r.get("erasure_error", "")))
    width = max(len(row[0]) for row in rows)
    for label, figure, note in rows:
        print(f"{label:{width}}  {figure:>12}  {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000", help="memories per tenant, comma separated")
    parser.add_argument("--batch", type=int, default=100, help="subjects in the batch (at most half the tenant's)")
    parser.add_argument("--repeats", type=int, default=3, help="subjects measured one at a time (median)")
    parser.add_argument("--chroma-max", type=int, default=0, help="vectors indexed per tenant (0: all)")
    parser.add_argument("--retry-size", type=int, default=50, help="jobs per run when retrying a blocked batch")
    parser.add_argument("--home", type=Path, help="keep the tenants here and reuse them (default: a temp dir)")
    parser.add_argument("--build-only", action="store_true", help="build the tenants under --home, measure later")
    parser.add_argument(
        "--one-only",
        action="store_true",
        help="measure only the naive delete and one subject's cascade (no batch, no erasure): uses --repeats subjects",
    )
    args = parser.parse_args()
    if args.build_only and args.home is None:
        raise SystemExit("--build-only needs --home")
    sizes = sorted(int(s.replace("_", "")) for s in args.sizes.split(","))
    if any(n < 2 * VERSIONS * (args.repeats + 1) for n in sizes):
        raise SystemExit(f"each size needs at least {2 * VERSIONS * (args.repeats + 1)} memories")
    home = args.home or temporary_home("mp-bench-forget-")
    home.mkdir(parents=True, exist_ok=True)
    settings = {name: Settings.from_env({"MEMORY_PIPELINES_HOME": str(home / name)}) for name in ("full", "naive")}
    stores = {name: open_store(s) for name, s in settings.items()}
    copies = Copies(
        full=open_derived(settings["full"], stores["full"], embedder=default_embedder()),
        naive=open_derived(settings["naive"], stores["naive"], embedder=default_embedder()),
        full_setup=open_derived(settings["full"], stores["full"], embedder=SyntheticVectors()),
        naive_setup=open_derived(settings["naive"], stores["naive"], embedder=SyntheticVectors()),
    )
    service = DeletionService(copies.full)
    erasure = ErasureService(copies.full, settings=settings["full"])
    print(f"home {home}; sizes {', '.join(f'{n:,}' for n in sizes)}; {VERSIONS} versions a subject")
    if not args.build_only:
        warm_up(copies, service)

    results: list[dict[str, Any]] = []
    try:
        for n in sizes:
            tenant, setup = tenant_for(copies, home, n, args)
            if args.build_only:
                continue
            result = measure(copies, service, erasure, tenant, n, setup, args)
            print_size(result, setup)
            results.append(result)
    finally:
        for store in stores.values():
            store.close()
        if args.home is None:
            for s in settings.values():
                stop_services(s)
            discard(home)
    if results:
        summarize(results)


def summarize(results: list[dict[str, Any]]) -> None:
    by_n = {r["n"]: r for r in results}
    print(
        "\n| size | naive | one subject | ratio | round trips naive / one (PG statements + tx, Chroma requests)"
        " | batch of 100 | erasure | bytes rewritten | hide p50 / p95 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        e = r.get("erasure_report")
        if "batch_run" not in r:
            batch = "-"
        elif "batch_error" in r:
            batch = f"BLOCKED after {r['batch_run']:.1f} s (retried in {r['batch_retry']:.1f} s)"
        else:
            batch = f"{r['batch_run']:.2f} s" + ("" if r["batch"] == 100 else f" ({r['batch']} subjects)")
            batch += f" ({r['batch_run'] / r['one']:.1f}x)"
        erased = f"{r['erasure']:.1f} s" if e else ("failed" if "erasure_error" in r else "-")
        rewritten = mb(sum(e["bytesRewritten"].values())) if e else "-"
        hide = f"{r['hide_p50'] * 1000:.0f} / {r['hide_p95'] * 1000:.0f} ms" if "hide_p50" in r else "-"
        size = f"{r['n']:,}" + (f" (Chroma {r['chroma']:,})" if r["chroma"] < r["n"] else "")
        naive_trips, one_trips = r["naive_trips"]["total"], r["one_trips"]["total"]
        print(
            f"| {size} | {r['naive']:.2f} s | {r['one']:.2f} s | {r['one'] / r['naive']:.1f}x"
            f" | {pg_trips(naive_trips)} + {naive_trips['chroma']} / {pg_trips(one_trips)} + {one_trips['chroma']}"
            f" | {batch} | {erased} | {rewritten} | {hide} |"
        )
    print("\ntargets:")
    if 100_000 in by_n:
        r = by_n[100_000]
        ratio = r["one"] / r["naive"]
        print(f"  one subject within 2x naive at 100,000: {ratio:.2f}x  {verdict(ratio <= 2)}")
    if 10_000 in by_n and 100_000 in by_n:
        growth = by_n[100_000]["one"] / by_n[10_000]["one"]
        print(f"  one subject at 100,000 within 1.5x of 10,000: {growth:.2f}x  {verdict(growth <= 1.5)}")
    if 10_000 in by_n and 1_000_000 in by_n:
        print(f"  (one subject at 1,000,000 / 10,000: {by_n[1_000_000]['one'] / by_n[10_000]['one']:.2f}x)")
    for r in results:
        if "batch_run" not in r:
            continue
        if "batch_error" in r:
            print(f"  batch of {r['batch']} at {r['n']:,}: FAIL, the run blocked: {r['batch_error']}")
        elif r["batch"] == 100:
            ratio = r["batch_run"] / r["one"]
            print(f"  batch of 100 within 5x one subject at {r['n']:,}: {ratio:.2f}x  {verdict(ratio <= 5)}")
    if 1_000_000 in by_n and "hide_p50" in by_n[1_000_000]:
        p50 = by_n[1_000_000]["hide_p50"] * 1000
        print(f"  hide p50 under 50 ms at 1,000,000: {p50:.1f} ms  {verdict(p50 < 50)}")
    for r in results:
        if "erasure_error" in r:
            print(f"  physical erasure at {r['n']:,}: FAILED: {r['erasure_error']}")


if __name__ == "__main__":
    main()
