"""Threads sharing one MemoryStore: single writes per second from 1 thread, from 4 threads sharing
one store (its connection pool), and from 4 threads with a store each (the baseline, measured in the
same run). Before the pool, a store served every call on one connection behind a lock (measured then:
534 writes/s from one thread, 740/s from 4 threads sharing a store, 1,135/s with a store each).

    .venv/bin/python benchmarks/store_threads.py [--seconds 10]

Prints writes/s for each and the ratio shared / own-store (target: at least 0.8).
"""

from __future__ import annotations

import argparse
import threading
import time

from benchmarks.homes import discard, temporary_home
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.runtime import open_store


def hammer(stores: list[MemoryStore], seconds: float, tenant: str) -> float:
    """Writes per second with one thread per entry of `stores` (entries may repeat: shared)."""
    counts = [0] * len(stores)
    stop = time.monotonic() + seconds

    def worker(i: int) -> None:
        while time.monotonic() < stop:
            stores[i].write(tenant_id=tenant, user_id=f"u{i}", text=f"thread {i} writes note {counts[i]}")
            counts[i] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(stores))]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    home = temporary_home("mp-bench-threads-")
    settings = Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})
    store = open_store(settings)
    own = [open_store(settings) for _ in range(4)]
    try:
        hammer([store], 1.0, "warmup")
        one = hammer([store], args.seconds, "one")
        shared = hammer([store] * 4, args.seconds, "shared")
        separate = hammer(own, args.seconds, "own")
        print(f"1 thread, 1 store:           {one:8.0f} writes/s")
        print(f"4 threads sharing 1 store:   {shared:8.0f} writes/s")
        print(f"4 threads, a store each:     {separate:8.0f} writes/s (baseline)")
        print(f"ratio shared / own stores:   {shared / separate:8.2f} (target >= 0.8)")
    finally:
        for s in [store, *own]:
            s.close()
        discard(home)


if __name__ == "__main__":
    main()
