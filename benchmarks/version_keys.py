"""Version keys (issue 32) against the release before them, both measured in one run, alternately.

    .venv/bin/python -m benchmarks.version_keys                               # 100,000 erased
    .venv/bin/python -m benchmarks.version_keys --erasure-sizes 100000,1000000 --baseline e54b03f

Two worker processes, each on a HOME of its own and started once: the baseline commit (from a git
worktree made in a temporary directory, removed after) and this tree. Each builds a tenant of 10,000
memories of 100 subjects, indexed by every derived store (hashing embedder, so the stores' own work is
timed, not a model). Then, for `--rounds` rounds, each measurement runs on one worker and then on the
other (the order alternates by round), so both see the machine in the same state; a figure is the
median over rounds, and after/before the median of the rounds' ratios:
- write: 100 single writes (p50 and p99, ms);
- write_many: 10,000 new memories in one call, in a tenant of their own (items/s);
- materialize: every derived store of that tenant synced (s);
- recall: 50 keyword and 50 hybrid queries of one user (p50, ms);
- forget: one subject of 100 memories, request to COMPLETE (s).
Then, once per worker, for each of --erasure-sizes: a tenant of that many versions (bulk writes, no
derived store) with one subject and one memory forgotten, and its physical erasure: the KEK rotation
(s), the whole erasure (s), and the bytes its scan read. Last, on this tree, the layouts weighed at the
largest size: a KEK rotation when every version key is wrapped by the KEK itself against one over group
keys of a few sizes, and the rekey of one group after a forget.
Targets: reads and writes within 10% of before; a rotation at 1,000,000 versions within 60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TENANT_SIZE = 10_000
BULK = TENANT_SIZE
PER_SUBJECT = 100
TOPICS = ("kayaking", "sourdough", "penicillin", "Lisbon", "chess", "tax returns", "violin", "marathons")


def _items(n: int, first: int = 0) -> list[dict[str, Any]]:
    """`n` memories, the first one the tenant's `first`-th: PER_SUBJECT memories a subject."""
    rng = random.Random(first)
    return [
        {
            "user_id": f"user{(first + i) // PER_SUBJECT:05d}",
            "text": f"note {first + i}: {rng.choice(TOPICS)} on {rng.randint(1, 28)} {rng.choice(TOPICS)}"
            f" {secrets.token_hex(4)}",
        }
        for i in range(n)
    ]


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


class Worker:
    """One side, in its own process: the services of its HOME, a store and the derived stores."""

    def __init__(self, home: Path) -> None:
        from memory_pipelines.lib.forget.deletion import DeletionService
        from memory_pipelines.lib.infra.services import ensure_services
        from memory_pipelines.lib.infra.settings import Settings
        from memory_pipelines.lib.runtime import open_store
        from memory_pipelines.lib.stores.derived import open_derived
        from memory_pipelines.lib.stores.embedding import HashingEmbedder

        self.settings = Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})
        endpoints = ensure_services(self.settings)
        self.store = open_store(self.settings, endpoints)
        self.derived = open_derived(self.settings, self.store, embedder=HashingEmbedder(), endpoints=endpoints)
        self.forgets = DeletionService(self.derived)
        self.tenant = "bench-" + secrets.token_hex(4)
        self.store.write_many(tenant_id=self.tenant, items=_items(TENANT_SIZE))
        self.derived.sync_all(tenant_id=self.tenant)
        self.rounds = 0

    def run(self, what: str, arg: int) -> dict[str, Any]:
        return dict(getattr(self, what)(arg))

    def write(self, n: int) -> dict[str, Any]:
        times = []
        for i in range(n):
            began = time.perf_counter()
            self.store.write(
                tenant_id=self.tenant, user_id=f"user{i % 100:05d}", text=f"single write {i} {secrets.token_hex(6)}"
            )
            times.append(time.perf_counter() - began)
        return {"write_p50_ms": _ms(times, 0.5), "write_p99_ms": _ms(times, 0.99)}

    def write_many(self, n: int) -> dict[str, Any]:
        self.rounds += 1
        tenant = f"bulk{self.rounds}-" + secrets.token_hex(3)
        began = time.perf_counter()
        self.store.write_many(tenant_id=tenant, items=_items(n))
        took = time.perf_counter() - began
        began = time.perf_counter()
        self.derived.sync_all(tenant_id=tenant)
        return {"write_many_items_per_s": round(n / took), "materialize_s": round(time.perf_counter() - began, 3)}

    def recall(self, n: int) -> dict[str, Any]:
        out = {}
        for mode in ("keyword", "hybrid"):
            times = []
            for i in range(n):
                began = time.perf_counter()
                self.derived.recaller.recall(
                    tenant_id=self.tenant,
                    user_id="user00007",
                    query=f"{TOPICS[i % len(TOPICS)]} {i}",
                    mode=mode,
                    use_cache=False,
                )
                times.append(time.perf_counter() - began)
            out[f"recall_{mode}_p50_ms"] = _ms(times, 0.5)
        return out

    def forget(self, subject: int) -> dict[str, Any]:
        began = time.perf_counter()
        job = self.forgets.request(tenant_id=self.tenant, subject=f"user{subject:05d}")
        self.forgets.run_batch(tenant_id=self.tenant, job_ids=[job["job_id"]])
        assert self.forgets.status(job_id=job["job_id"])["state"] == "COMPLETE"
        return {"forget_subject_s": round(time.perf_counter() - began, 3)}

    def erasure(self, n: int) -> dict[str, Any]:
        from memory_pipelines.lib.forget.erasure import ErasureService

        big = f"erase{n}-" + secrets.token_hex(4)
        for start in range(0, n, 100_000):
            self.store.write_many(tenant_id=big, items=_items(min(100_000, n - start), start))
        memory = self.store.write(tenant_id=big, user_id="user00003", text="the memory forgotten alone")
        jobs = [
            self.forgets.request(tenant_id=big, subject="user00001")["job_id"],
            self.forgets.request(tenant_id=big, memory_id=memory.memory_id)["job_id"],
        ]
        self.forgets.run_batch(tenant_id=big, job_ids=jobs)
        began = time.perf_counter()
        report = ErasureService(self.derived).erase_tenant(tenant_id=big)
        return {
            f"erasure_{n}_s": round(time.perf_counter() - began, 2),
            f"rotation_{n}_s": report["seconds"]["keys"],
            f"erasure_{n}_scanned_mb": round(report["byteScan"]["bytes"] / 1e6),
        }

    def close(self) -> None:
        from memory_pipelines.lib.infra.services import stop_services

        self.store.close()
        stop_services(self.settings)


def serve(home: Path) -> None:
    """A worker's loop: a JSON line [what, arg] in, a JSON line of figures out; an empty line ends it."""
    worker = Worker(home)
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            if not line.strip():
                break
            what, arg = json.loads(line)
            print(json.dumps(worker.run(what, arg)), flush=True)
    finally:
        worker.close()


class Side:
    def __init__(self, tree: Path, home: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", str(home)],
            env=env,
            cwd=tree,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert json.loads(self.ask_raw()) == {"ready": True}

    def ask_raw(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("a worker ended")
        return line

    def ask(self, what: str, arg: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps([what, arg]) + "\n")
        self.proc.stdin.flush()
        return dict(json.loads(self.ask_raw()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.write("\n")
            self.proc.stdin.close()
        self.proc.wait(300)


def design(n: int, group_sizes: list[int]) -> dict[str, Any]:
    """The two layouts at `n` versions, on this tree's crypto and a scratch PostgreSQL table each: a KEK
    rotation rewrapping every version key (every version key under the KEK) or n / G group keys, and
    a group's rekey (G - 1 survivors rewrapped under a new group key)."""
    import psycopg

    from benchmarks.homes import discard, temporary_home
    from memory_pipelines.lib.infra.services import ensure_services
    from memory_pipelines.lib.infra.settings import Settings
    from memory_pipelines.lib.memories import crypto

    home = temporary_home("mp-design-")
    settings = Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})
    conninfo = ensure_services(settings).store_conninfo
    old, new = crypto.new_key(), crypto.new_key()
    out: dict[str, Any] = {}

    def rotate(rows: int) -> float:
        """Create `rows` wrapped keys, then time reading, rewrapping and writing them back."""
        with psycopg.connect(conninfo) as conn:
            conn.execute("DROP TABLE IF EXISTS design_keys")
            conn.execute("CREATE TABLE design_keys (key_id text PRIMARY KEY, wrapped bytea NOT NULL)")
            with conn.cursor() as cur, cur.copy("COPY design_keys FROM STDIN") as copy:
                for i in range(rows):
                    copy.write_row((f"k{i}", crypto.seal(old, crypto.new_key(), crypto.aad("k", i))))
            conn.commit()
            began = time.perf_counter()
            ids, blobs = [], []
            for key_id, wrapped in conn.execute("SELECT key_id, wrapped FROM design_keys"):
                aad = crypto.aad("k", int(key_id[1:]))
                ids.append(key_id)
                blobs.append(crypto.seal(new, crypto.open_sealed(old, bytes(wrapped), aad), aad))
            for start in range(0, len(ids), 50_000):
                conn.execute(
                    "UPDATE design_keys d SET wrapped = u.w FROM unnest(%s::text[], %s::bytea[]) AS u(k, w)"
                    " WHERE d.key_id = u.k",
                    (ids[start : start + 50_000], blobs[start : start + 50_000]),
                )
            conn.commit()
            return time.perf_counter() - began

    try:
        out["rotation_every_key_s"] = round(rotate(n), 2)
        for g in group_sizes:
            out[f"rotation_groups_of_{g}_s"] = round(rotate(max(1, n // g)), 3)
            out[f"rekey_one_group_of_{g}_ms"] = round(1000 * rotate(g - 1), 2)
    finally:
        discard(home)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="e54b03f", help="the commit before version keys")
    parser.add_argument("--erasure-sizes", default="100000", help="versions of the erased tenants, comma-separated")
    parser.add_argument("--rounds", type=int, default=12, help="alternate rounds of the small measurements")
    parser.add_argument("--groups", default="64,256,1024", help="group sizes for the design comparison")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(Path(args.serve))
        return
    # Here, not at the top: the baseline's workers run this file on a tree without benchmarks/homes.py.
    from benchmarks.homes import discard, temporary_home

    sizes = [int(n) for n in args.erasure_sizes.split(",") if n]
    work = temporary_home("mp-version-keys-")
    baseline = work / "baseline"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(baseline), args.baseline], cwd=ROOT, check=True, capture_output=True
    )
    rounds: list[dict[str, dict[str, float]]] = []
    once: dict[str, dict[str, Any]] = {"before": {}, "after": {}}
    sides: dict[str, Side] = {}
    try:
        sides = {"before": Side(baseline, work / "before"), "after": Side(ROOT, work / "after")}
        for r in range(args.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            figures: dict[str, dict[str, float]] = {"before": {}, "after": {}}
            for what, arg in (("write", 100), ("write_many", BULK), ("recall", 50), ("forget", 10 + r)):
                for name in order:
                    figures[name].update(sides[name].ask(what, arg))
            rounds.append(figures)
            print(f"round {r + 1}: {json.dumps(figures)}", flush=True)
        for n in sizes:
            for name in ("before", "after"):
                once[name].update(sides[name].ask("erasure", n))
                print(f"{name} erasure {n}: {json.dumps(once[name])}", flush=True)
    finally:
        for side in sides.values():
            side.close()
        subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=ROOT, check=False)
        discard(work)
    print(f"\n{'figure':<28}{'before':>12}{'after':>12}{'after/before':>14}   (median of {len(rounds)} rounds)")
    for key in rounds[0]["after"]:
        before = statistics.median(r["before"][key] for r in rounds)
        after = statistics.median(r["after"][key] for r in rounds)
        ratio = statistics.median(r["after"][key] / r["before"][key] for r in rounds)
        print(f"{key:<28}{before:>12.3f}{after:>12.3f}{ratio:>14.2f}")
    for key in once["after"]:
        b, a = once["before"][key], once["after"][key]
        print(f"{key:<28}{b:>12}{a:>12}{(a / b if b else float('nan')):>14.2f}")
    largest = max(sizes or [100_000])
    print(f"\nlayouts at {largest:,} versions (this tree's crypto, one PostgreSQL table each):")
    for key, value in design(largest, [int(g) for g in args.groups.split(",")]).items():
        print(f"  {key:<34}{value}")


if __name__ == "__main__":
    main()
