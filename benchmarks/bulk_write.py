"""Bulk write benchmark: `write_many` items/s by batch size, and how long a deletion of the same tenant
waits to be accepted while a big write runs.

    .venv/bin/python benchmarks/bulk_write.py                 # 1,000 / 100,000 / 1,000,000 items
    .venv/bin/python benchmarks/bulk_write.py --sizes 1000 20000 --during 20000

Each size is one `write_many` call on a fresh tenant of one HOME (encrypted, deduplicated, as the
API does it). Then another process writes `--during` items to a tenant while this one requests a
SUBJECT deletion of one of that tenant's earlier subjects every `--every` seconds; acceptance (the
request returning: the subject hidden from every read) is timed, and the same requests against an
idle tenant in the same run are the baseline. Targets (issue 21): items/s at the largest size
within 1.5x of the smallest, and acceptance p99 during the write under 50 ms.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.homes import discard, temporary_home
from benchmarks.ingest import corpus
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores.derived import open_derived
from memory_pipelines.lib.stores.embedding import HashingEmbedder

SUBJECTS = 100


def _items(n: int, seed: int = 7) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k != "team_id"} for item in corpus(n, SUBJECTS, seed=seed)]


def _write(home: str, tenant: str, n: int, out: Any) -> None:
    """In another process: one write_many of n items; reports when it ran."""
    store = open_store(Settings.from_env({"MEMORY_PIPELINES_HOME": home}))
    items = _items(n, seed=11)
    out.put(("started", time.time()))
    store.write_many(tenant_id=tenant, items=items)
    out.put(("finished", time.time()))
    store.close()


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _accept(service: DeletionService, tenant: str, subject: str) -> float:
    start = time.perf_counter()
    service.request(tenant_id=tenant, subject=subject)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 100_000, 1_000_000])
    parser.add_argument("--during", type=int, default=100_000, help="items written while deletions arrive")
    parser.add_argument("--every", type=float, default=0.05, help="seconds between deletion requests")
    parser.add_argument("--home", type=Path, help="data folder (default: a new temporary folder)")
    args = parser.parse_args()
    home = args.home or temporary_home("mp-bench-bulk-")
    settings = Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})
    store = open_store(settings)
    print(f"home {home}")

    print(f"{'items':>10} {'seconds':>9} {'items/s':>10}")
    rates = {}
    for n in args.sizes:
        items = _items(n)
        tenant = f"bulk-{n}"
        start = time.perf_counter()
        store.write_many(tenant_id=tenant, items=items)
        seconds = time.perf_counter() - start
        rates[n] = n / seconds
        print(f"{n:>10,} {seconds:9.2f} {rates[n]:10,.0f}", flush=True)
    small, large = min(args.sizes), max(args.sizes)
    ratio = rates[small] / rates[large]
    verdict = "met" if ratio <= 1.5 else "MISSED"
    print(f"per-item cost at {large:,} / at {small:,}: {ratio:.2f}x (target <= 1.5x: {verdict})")

    # Subjects to forget, one memory each, on the busy tenant and on an idle one.
    service = DeletionService(open_derived(settings, store, embedder=HashingEmbedder()))
    busy, idle = "bulk-busy", "bulk-idle"
    budget = int(600 / args.every)  # more than the write can last
    for tenant in (busy, idle):
        store.write_many(
            tenant_id=tenant, items=[{"user_id": f"gone{i:05d}", "text": f"note {i}"} for i in range(budget)]
        )
    baseline = [_accept(service, idle, f"gone{i:05d}") for i in range(50)]

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    writer = ctx.Process(target=_write, args=(str(home), busy, args.during, out))
    writer.start()
    kind, started = out.get(timeout=600)
    assert kind == "started"
    during: list[float] = []
    finished = None
    while finished is None and len(during) < budget:
        during.append(_accept(service, busy, f"gone{len(during):05d}"))
        time.sleep(args.every)
        if not out.empty():
            finished = out.get()[1]
    writer.join()
    finished = finished or out.get()[1]
    print(
        f"deletion acceptance during a {args.during:,}-item write_many ({finished - started:.1f} s, "
        f"{len(during)} requests): p50 {statistics.median(during):.1f} ms, p99 {_percentile(during, 0.99):.1f} ms,"
        f" max {max(during):.1f} ms"
    )
    print(
        f"deletion acceptance on an idle tenant ({len(baseline)} requests): p50 {statistics.median(baseline):.1f}"
        f" ms, p99 {_percentile(baseline, 0.99):.1f} ms"
    )
    p99 = _percentile(during, 0.99)
    print(f"acceptance p99 during the write: {p99:.1f} ms (target < 50 ms: {'met' if p99 < 50 else 'MISSED'})")
    store.close()
    if args.home is None:
        discard(home)


if __name__ == "__main__":
    main()
