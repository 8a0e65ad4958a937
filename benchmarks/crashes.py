"""Random kills of every lifecycle operation, each followed by the next command and the checks of a
crash (the random mode of tests/support/crashes.py; the named points run in the test suite).

    .venv/bin/python -m benchmarks.crashes                      # 200 kills
    .venv/bin/python -m benchmarks.crashes --kills 40 --seed 3

One tenant on a temporary HOME (its own PostgreSQL and Chroma server). First every operation runs
once whole, in a child process of its own, for its duration (the baseline). Then, per kill: an
operation drawn at random runs in a child, which SIGKILLs at a delay drawn uniformly within that
duration once the child is ready (its imports and services behind it); an operation that ended first
is not counted as a kill. The operations: single writes (each acknowledged on stdout as it commits),
`write_many`, a subject's forget and one memory's forget (acknowledged once accepted, then run),
`sync` (what `materialize` runs), the tenant's physical erasure, its KEK rotation, a backup, and the
retention sweep of the day before (some memories are `eu_user`, erased by every sweep).

After each kill, as the next command would: services ensured (which sweeps HOME's leftovers), every
deletion job of the tenant run to COMPLETE, the killed operation run again where it is one to
finish (sync, erasure, rotation, retention). Then checked, each a violation when it fails:
- every acknowledged write not forgotten is listed with its exact text;
- no forgotten memory is listed, nor stored in any Chroma collection (through Chroma's API);
- no artifact is left under HOME (lock files, scratch, partial uploads, staging collections);
- nothing hangs: every step of the recovery within --hang-seconds.
Every --scan-every kills and at the end, every file under HOME is read for the plaintext of every
forgotten memory.

Figures: kills per operation, violations, leftovers, hangs, and the recovery's median seconds after a
kill against after the same operation run whole (the ratio; measured in the same run).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from benchmarks.homes import discard, temporary_home
from memory_pipelines import MemoryPlatform
from memory_pipelines.lib.forget.canary import file_bytes
from memory_pipelines.lib.infra.services import ensure_services
from memory_pipelines.lib.infra.settings import Settings
from tests.support.crashes import artifacts_under

USERS = ["alice", "bob", "carol", "dave", "erin"]
# Every text a child writes ends with one of these (what the plaintext scan looks for first).
PHRASES = (b" about the orchard", b" on the river path")
PRELUDE = """
import json, sys
from memory_pipelines import MemoryPlatform
from memory_pipelines.lib.forget.erasure import ErasureService
mp = MemoryPlatform.from_env()
def ack(**said):
    print(json.dumps(said), flush=True)
ack(ready=True)
"""
# Each operation's child code; {t} the tenant, {n} a nonce, {subject} and {memory} what to forget.
OPERATIONS = {
    "write": """
        for i in range(24):
            user = {users!r}[i % 5]
            text = f"{n} {{user}} note {{i}} about the orchard"
            category = "eu_user" if user == "erin" else "general"
            written = mp.write(tenant_id={t!r}, user_id=user, text=text, category=category)
            ack(memory=written["memory_id"], user=user, text=text, category=category)
        """,
    "write_many": """
        items = [dict(user_id={users!r}[i % 4], text=f"{n} bulk {{i}} on the river path", category="general")
                 for i in range(400)]
        for item, written in zip(items, mp.write_many(tenant_id={t!r}, items=items)):
            ack(memory=written["memory_id"], user=item["user_id"], text=item["text"], category="general")
        """,
    "forget_subject": """
        handle = mp.forget(tenant_id={t!r}, subject={subject!r})
        ack(forget=handle.job_id)
        handle.wait(timeout=300)
        """,
    "forget_memory": """
        handle = mp.forget(tenant_id={t!r}, memory_id={memory!r}, basis="gdpr-art17")
        ack(forget=handle.job_id)
        handle.wait(timeout=300)
        """,
    "sync": "mp.sync(tenant_id={t!r})",
    "erase": "ErasureService(mp.derived).erase_tenant(tenant_id={t!r})",
    "rotate": "ErasureService(mp.derived).rotate_keys({t!r})",
    "backup": "mp.backup(tenant_id={t!r})",
    "retention": "mp.sweep_retention(day={day!r}, tenant_id={t!r})",
}
# Run again by the next command after a kill: the operations that must finish what they began.
FINISHED_BY_RERUN = {"sync", "erase", "rotate", "retention"}


class Model:
    """What the children acknowledged, and what is forgotten of it."""

    def __init__(self) -> None:
        self.acked: dict[str, dict[str, str]] = {}
        self.forgotten: set[str] = set()
        self.jobs_seen: set[str] = set()

    def take(self, line: str) -> None:
        said = json.loads(line)
        if "memory" in said:
            self.acked[said["memory"]] = {k: said[k] for k in ("user", "text", "category")}

    def forget(self, job: dict[str, Any]) -> None:
        """A job the tenant's ledger holds: what it forgets is what was acknowledged before it."""
        scope = job["scope"]
        if scope["type"] == "SUBJECT":
            self.forgotten |= {m for m, w in self.acked.items() if w["user"] == scope["subject"]}
        elif scope["type"] == "MEMORY":
            self.forgotten.add(scope["memory_id"])

    def live(self) -> dict[str, dict[str, str]]:
        return {m: w for m, w in self.acked.items() if m not in self.forgotten}


class Child:
    """One operation in a process of its own, on HOME."""

    def __init__(self, home: Path, code: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
            env={**os.environ, "MEMORY_PIPELINES_HOME": str(home)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if json.loads(first or "{}").get("ready") is not True:
            _, err = self.proc.communicate()
            raise SystemExit(f"a child did not start: {err[-2000:]}")
        self.started = time.monotonic()

    def end(self, after: float | None) -> tuple[bool, list[str], str]:
        """Killed `after` seconds from ready (None: let it finish); whether it was, its stdout lines."""
        killed = False
        if after is not None:
            try:
                self.proc.wait(timeout=max(0.0, after - (time.monotonic() - self.started)))
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                killed = True
        out, err = self.proc.communicate()
        if not killed and self.proc.returncode != 0:
            raise SystemExit(f"an operation failed unkilled (exit {self.proc.returncode}): {err[-3000:]}")
        return killed, out.splitlines(), err


class Bench:
    def __init__(self, settings: Settings, tenant: str, rng: random.Random, hang_seconds: float) -> None:
        self.settings = settings
        self.tenant = tenant
        self.rng = rng
        self.hang_seconds = hang_seconds
        self.model = Model()
        self.mp = MemoryPlatform.from_env()
        self.watchdog = ThreadPoolExecutor(max_workers=1)
        self.violations: list[str] = []
        self.hangs = 0
        self.leftovers = 0

    def code(self, op: str) -> str:
        live = sorted(self.model.live())
        memory = self.rng.choice(live) if live else "m_" + "0" * 32
        day = (datetime.now(UTC).date() - timedelta(days=1)).isoformat()
        fill = {"t": self.tenant, "n": os.urandom(4).hex(), "users": USERS, "day": day}
        return OPERATIONS[op].format(**fill, subject=self.rng.choice(USERS[:4]), memory=memory)

    def run(self, op: str, after: float | None) -> tuple[bool, float]:
        child = Child(self.settings.home, self.code(op))
        killed, lines, _ = child.end(after)
        for line in lines:
            self.model.take(line)
        return killed, time.monotonic() - child.started

    def bounded(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return self.watchdog.submit(call).result(timeout=self.hang_seconds)
        except FutureTimeout:
            self.hangs += 1
            raise SystemExit(f"HANG: {what} took over {self.hang_seconds} s") from None

    def recover(self, op: str, killed: bool) -> float:
        """The next command, then the checks; returns the recovery's seconds."""
        started = time.monotonic()
        self.bounded("services", lambda: ensure_services(self.settings))
        if killed and op in FINISHED_BY_RERUN:
            self.bounded(f"{op} again", lambda: self.run(op, None))
        for job in self.bounded("jobs", lambda: self.mp.deletion_jobs(tenant_id=self.tenant)):
            if job["job_id"] not in self.model.jobs_seen:
                self.model.jobs_seen.add(job["job_id"])
                self.model.forget(job)
            if job["state"] != "COMPLETE":
                handle = self.mp.deletion(job_id=job["job_id"])
                try:
                    self.bounded("forget", functools.partial(handle.wait, timeout=300))
                except Exception as exc:  # any failure of the next command is a violation
                    self.violations.append(f"after {op}: job {job['job_id']} did not complete: {exc}")
        took = time.monotonic() - started
        self.check(op)
        return took

    def check(self, op: str) -> None:
        listed: dict[str, str] = {}
        for user in USERS:
            for memory in self.mp.list(tenant_id=self.tenant, user_id=user):
                listed[memory["memory_id"]] = memory["text"]
        for memory_id, written in self.model.live().items():
            if listed.get(memory_id) != written["text"]:
                self.violations.append(f"after {op}: acknowledged write {memory_id} is not read back whole")
        if back := sorted(self.model.forgotten & listed.keys()):
            self.violations.append(f"after {op}: forgotten memories listed: {back[:3]}")
        client = self.mp.derived.vectors.client()
        forgotten = sorted(f"{m}:1" for m in self.model.forgotten)
        for col in client.list_collections():
            if col.name.endswith("-rebuild"):
                self.leftovers += 1
                self.violations.append(f"after {op}: staging collection {col.name} left")
            for start in range(0, len(forgotten), 500):
                if got := client.get_collection(col.name).get(ids=forgotten[start : start + 500], include=[])["ids"]:
                    self.violations.append(f"after {op}: {len(got)} forgotten vectors in {col.name}")
        if left := artifacts_under(self.settings.home):
            self.leftovers += len(left)
            self.violations.append(f"after {op}: artifacts left: {[str(p) for p in left[:3]]}")

    def scan(self) -> None:
        """Every file under HOME, for the plaintext of every forgotten memory: each text ends with one
        of PHRASES, found first, then the forgotten texts of each length ending there."""
        by_length: dict[int, set[bytes]] = defaultdict(set)
        for memory_id in self.model.forgotten:
            text = self.model.acked[memory_id]["text"].encode()
            by_length[len(text)].add(text)
        for path, data in file_bytes(self.settings.home):
            for phrase in PHRASES:
                at = data.find(phrase)
                while at >= 0:
                    end = at + len(phrase)
                    if any(data[end - n : end] in texts for n, texts in by_length.items()):
                        self.violations.append(f"forgotten text in {path} at {at}")
                    at = data.find(phrase, end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--seed", type=int, default=33)
    parser.add_argument("--hang-seconds", type=float, default=300.0)
    parser.add_argument("--scan-every", type=int, default=25)
    parser.add_argument("--home", type=Path, help="HOME to use (default: a temporary one, stopped afterwards)")
    args = parser.parse_args()
    home = args.home or temporary_home("mp-bench-crashes-")
    os.environ["MEMORY_PIPELINES_HOME"] = str(home)
    settings = Settings.from_env()
    ensure_services(settings)
    rng = random.Random(args.seed)
    tenant = f"crash-{time.strftime('%H%M%S')}"
    bench = Bench(settings, tenant, rng, args.hang_seconds)
    began = time.monotonic()
    try:
        baseline: dict[str, float] = {}
        whole: list[float] = []
        for op in ["write", "write_many", "sync", *[o for o in OPERATIONS if o not in ("write", "write_many", "sync")]]:
            _, baseline[op] = bench.run(op, None)
            whole.append(bench.recover(op, killed=False))
        print("baseline seconds: " + ", ".join(f"{op} {s:.1f}" for op, s in baseline.items()), flush=True)
        kills: Counter[str] = Counter()
        finished: Counter[str] = Counter()
        after_kill: list[float] = []
        by_op: dict[str, list[float]] = defaultdict(list)
        while sum(kills.values()) < args.kills:
            op = rng.choice(list(OPERATIONS))
            if op == "write_many" and len(bench.model.acked) > 6000:
                op = "forget_subject"  # keeps the tenant's size bounded
            killed, _ = bench.run(op, rng.uniform(0, baseline[op]))
            (kills if killed else finished)[op] += 1
            took = bench.recover(op, killed)
            if killed:
                after_kill.append(took)
                by_op[op].append(took)
            n = sum(kills.values())
            if killed and n % args.scan_every == 0:
                bench.scan()
            if killed and n % 10 == 0:
                print(f"{n} kills, {len(bench.violations)} violations, {time.monotonic() - began:.0f} s", flush=True)
        bench.scan()
    finally:
        bench.mp.close()
        bench.watchdog.shutdown(wait=False)
        if args.home is None:
            discard(home)
    print(f"kills: {sum(kills.values())} ({', '.join(f'{op} {n}' for op, n in sorted(kills.items()))})")
    print(f"finished before their kill (not counted): {sum(finished.values())}")
    print(f"memories acknowledged: {len(bench.model.acked)}; forgotten: {len(bench.model.forgotten)}")
    print(f"violations: {len(bench.violations)}; leftovers: {bench.leftovers}; hangs: {bench.hangs}")
    for violation in bench.violations[:20]:
        print(f"  {violation}")
    ratio = statistics.median(after_kill) / statistics.median(whole)
    print(
        f"recovery median: {statistics.median(after_kill):.2f} s after a kill, "
        f"{statistics.median(whole):.2f} s after a whole run (x{ratio:.2f}); "
        + ", ".join(f"{op} {statistics.median(s):.2f}" for op, s in sorted(by_op.items()))
    )
    print(f"wall: {time.monotonic() - began:.0f} s")
    sys.exit(1 if bench.violations or bench.hangs else 0)


if __name__ == "__main__":
    main()
