"""Sustained forgetting: SUBJECT deletion requests arriving at a fixed rate for minutes on several
tenants, through the path production uses, while another tenant recalls.

    # the curve: several rates, one phase each (each drains before the next)
    .venv/bin/python -m benchmarks.forget_stream --home /tmp/fs --memories-per-subject 8 \\
        --rates 2,4,8,12 --phase-seconds 180 --erasure-every 300
    # the 10-minute run at one rate (add --workers 2 for a second forget worker)
    .venv/bin/python -m benchmarks.forget_stream --home /tmp/fs --memories-per-subject 8 \\
        --rate 12 --seconds 600 --erasure-every 300
    # a smoke run
    .venv/bin/python -m benchmarks.forget_stream --home /tmp/fs-smoke --sizes 5000,1000,500 \\
        --reader-size 2000 --rate 2 --seconds 60 --erasure-every 30

Real processes (multiprocessing, spawn) on one PostgreSQL and one Chroma server:

- a requester issues SUBJECT requests at `--rate` a second (Poisson arrivals by default, open loop:
  a slow request never delays the schedule) through `DeletionService.request`, what the Python API's
  `MemoryPlatform.forget` calls; each request's latency is its acceptance (the subject hidden). The
  tenants share the requests in proportion to their sizes; every request names a subject that still
  has memories.
- this process plays the Dagster daemon: `forget_requests_sensor` every `--sensor-every` seconds
  (15, its minimum interval), planning with the sensor's own `DeletionLedger.ledger` and
  `plan_forget_runs` (new requests once `--settle` old: 30 s, REQUEST_SETTLE; BLOCKED retries with
  backoff; a failed run relaunched), `physical_erasure_sensor` with `ErasureLedger.due_tenants`, and
  the QueuedRunCoordinator of assets/dagster/dagster.yaml: one run queue in submission order, one run
  per tenant at a time (forget and erasure alike: the `dagster/partition` limit), a queued run skipped
  while its tenant is busy.
- `--workers` forget worker processes (1 by default) execute the forget runs as the forget job's ops
  do, one after the other: `DeletionService.begin` (freeze, under the tenant's run lock), then
  `run_phase` for each store, verify and prove, then `release` (`--cascade run_batch` instead runs
  `run_batch`, the in-process path of `forget --wait` without Dagster), then what the prove op adds
  (data map before and after, its PNG, one certificate per COMPLETE job). Like run workers they lower
  their priority (MEMORY_PIPELINES_BACKGROUND_NICE). Production's run queue (max_concurrent_runs 4,
  one erasure slot aside) would run up to 3 forget runs of 3 tenants at once: `--workers 3`.
  `--batching loop` instead has each free worker take every REQUESTED job of the tenant with the
  oldest one (`pending()`, what a forget run with `job_ids: []` picks).
- an erasure worker process executes the erasure runs (`ErasureService.erase_tenant`, niced), in a
  run slot of its own (max_concurrent_runs is 4). Production batches a tenant's COMPLETE deletions
  for MEMORY_PIPELINES_ERASURE_BATCH_MINUTES (60); `--erasure-every S` compresses that window to S
  seconds (the sensor's rule, evaluated as if S seconds were the window) and the summary extrapolates
  from the measured erasure seconds per window to the production window and the 24 h deadline.
- a reader process recalls from a tenant no request touches (keyword and hybrid alternating, personal
  and team scopes, `use_cache=False`), paced at `--reader-rate`, alone for `--idle` seconds before the
  stream (and half that after it), the baseline of its p99 in the same run.

Not modelled: Dagster's own cost per run (a run worker process started per run, the code location
loaded in it, event-log writes of the metadata); here the workers are warm processes.

Setup goes through the store's API (`write_many`, each derived store's sync). Vectors of the tenants
that forget are synthetic (benchmarks/forget.py's SyntheticVectors; embedding 100,000 texts would
take minutes); their cascade's paraphrase probes, the reader's tenant and its queries use the real
model. Tenants are kept under --home and reused while they have subjects enough left. A tenant of N
memories has N/M subjects of M memories (`--memories-per-subject`, 100 at most): when the planned
requests would exhaust 100-memory subjects, M is lowered and the output says so.

Goal (issue 23): 12 subjects/s with COMPLETE p99 under 10 minutes, every job ERASED within its 24 h
deadline, another tenant's recall p99 within 2x its idle p99.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import queue
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from benchmarks.forget import SyntheticVectors, items_for, percentile, remaining, subject, timed, write_tenant
from benchmarks.forget_isolation import MODES, reader, settings_for, stats
from benchmarks.homes import temporary_home
from memory_pipelines.lib.forget import certificate
from memory_pipelines.lib.forget.deletion import DeletionLedger, DeletionService, LastRun, phases, plan_forget_runs
from memory_pipelines.lib.forget.erasure import ErasureLedger, ErasureService
from memory_pipelines.lib.infra.services import stop_services
from memory_pipelines.lib.infra.settings import Settings, lower_priority
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores.derived import default_embedder, open_derived, sync_embeddings, sync_keywords

MAX_PER_SUBJECT = 100
MARGIN = 1.15  # subjects built per expected request (Poisson counts vary), plus SPARE
SPARE = 20
SAMPLE_EVERY = 5.0  # seconds between backlog samples
PRINT_EVERY = 30.0
PRODUCTION_ERASURE_TICK = 60.0  # physical_erasure_sensor's minimum interval
GOAL_RATE = 12.0
GOAL_COMPLETE_P99 = 600.0
GROWING = 0.05  # a backlog slope above this share of the rate over a phase's last half: not sustained


# -- tenants ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    rate: float
    seconds: float


def layout(sizes: list[int], phases: list[Phase], per_subject: int | None) -> tuple[int, dict[int, int], int]:
    """Memories per subject (the same for every tenant), subjects each tenant needs, and the largest M
    that would do (what --memories-per-subject defaults to)."""
    total = sum(p.rate * p.seconds for p in phases)
    needed = {n: math.ceil(total * n / sum(sizes) * MARGIN) + SPARE for n in sizes}
    auto = min(MAX_PER_SUBJECT, *(n // needed[n] for n in sizes))
    chosen = per_subject or auto
    short = [n for n in sizes if n // max(chosen, 1) < needed[n]]
    if chosen < 1 or short:
        raise SystemExit(
            f"{total:,.0f} requests need {', '.join(f'{needed[n]:,} subjects of the {n:,} tenant' for n in sizes)};"
            f" with {chosen} memories a subject {', '.join(f'{n:,}' for n in short)} has too few"
            + (f" (at most {auto} memories a subject would do)" if auto >= 1 else "; use larger --sizes")
        )
    return chosen, needed, auto


def build_steps(
    settings: Settings, store: MemoryStore, tenant: str, n: int, per_subject: int, real: bool
) -> list[tuple[str, Callable[[], Any]]]:
    subjects = n // per_subject
    items = items_for(n, subjects)
    embedder = default_embedder(settings.embedding_model) if real else SyntheticVectors()
    derived = open_derived(settings, store, embedder=embedder)
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("write", lambda: write_tenant(store, tenant, subjects, items)),
        ("memory_embeddings", lambda: sync_embeddings(store, derived.vectors, tenant_id=tenant)),
        ("keyword_index", lambda: sync_keywords(store, tenant_id=tenant)),
    ]
    if not real:  # the reader's tenant needs only what recall reads
        steps += [
            ("subject_summaries", lambda: derived.summaries.sync(tenant_id=tenant, scope="subject")),
            ("team_summaries", lambda: derived.summaries.sync(tenant_id=tenant, scope="team")),
            ("analytics_memories", lambda: derived.analytics.rebuild(store=store, tenant_id=tenant)),
        ]
    return steps


def tenant_for(
    settings: Settings, store: MemoryStore, home: Path, name: str, n: int, per_subject: int, needed: int, real: bool
) -> tuple[str, dict[str, Any]]:
    """A tenant built earlier under HOME with `needed` subjects left, else a new one (an interrupted
    build resumes after its last finished step)."""
    for generation in range(100):
        tenant = name + (f"-g{generation}" if generation else "")
        marker = home / f"stream-{tenant}.json"
        progress = home / f"stream-building-{tenant}.json"
        if marker.exists():
            setup: dict[str, Any] = json.loads(marker.read_text())
            left = len(remaining(store, tenant))
            if left >= needed:
                print(f"  reusing {tenant}: {left:,} subjects left ({needed:,} needed)", flush=True)
                return tenant, setup
            print(f"  {tenant}: {left:,} subjects left, {needed:,} needed: another tenant", flush=True)
            continue
        done: dict[str, float] = json.loads(progress.read_text()) if progress.exists() else {}
        if store.tenant_exists(tenant_id=tenant) and "write" not in done:
            continue  # a build stopped inside its write: not resumable
        started = time.perf_counter()
        for step, run in build_steps(settings, store, tenant, n, per_subject, real):
            if step not in done:
                done[step] = timed(run)[0]
                progress.write_text(json.dumps(done))
                print(f"  {tenant}: {step} in {done[step]:.0f} s", flush=True)
        setup = {
            "n": n,
            "subjects": n // per_subject,
            "per_subject": per_subject,
            "vectors": "real" if real else "synthetic",
            "seconds": done,
        }
        marker.write_text(json.dumps(setup))
        progress.unlink(missing_ok=True)
        print(f"  built {tenant} in {time.perf_counter() - started:.0f} s", flush=True)
        return tenant, setup
    raise SystemExit(f"no room for another {n:,}-memory tenant under {home}; use a new --home")


# -- processes -------------------------------------------------------------------------------------


def requester(
    home: str,
    tenants: list[str],
    weights: list[float],
    subjects: dict[str, list[str]],
    rate: float,
    seconds: float,
    arrivals: str,
    seed: int,
    ready: Any,
    go: Any,
    out: Any,
) -> None:
    """Issue SUBJECT requests at `rate` for `seconds` (open loop); puts every request's record on `out`."""
    records: list[tuple[float, float, float, str, str | None, str | None]] = []
    t0 = time.time()
    switched = 0
    try:
        settings = settings_for(home)
        store = open_store(settings)
        service = DeletionService(open_derived(settings, store))
        service.ledger(tenant_id=tenants[0])  # a pooled connection and the imports, before the clock
        ready.set()
        go.wait()
        rng = random.Random(seed)
        left = {t: list(s) for t, s in subjects.items()}
        t0 = due = time.time()
        while True:
            due += rng.expovariate(rate) if arrivals == "poisson" else 1.0 / rate
            if due >= t0 + seconds:
                break
            time.sleep(max(0.0, due - time.time()))
            tenant = rng.choices(tenants, weights)[0]
            if not left[tenant]:
                others = [t for t in tenants if left[t]]
                if not others:
                    break
                tenant, switched = rng.choice(others), switched + 1
            user = left[tenant].pop()
            started = time.time()
            job_id = error = None
            try:
                job_id = service.request(tenant_id=tenant, subject=user, requested_by="forget-stream")["job_id"]
            except Exception as exc:  # counted and shown; the stream goes on
                error = f"{type(exc).__name__}: {exc}"
            records.append((due, started, time.time() - started, tenant, job_id, error))
        store.close()
    finally:
        out.put({"records": records, "t0": t0, "switched": switched})


def cascade(service: DeletionService, tenant: str, job_ids: list[str], how: str) -> dict[str, Any]:
    """A batch through the cascade: as the forget job's ops do (`begin` in freeze, `run_phase` in each
    later op, `release` when the run's steps end), or `run_batch` (the in-process path)."""
    if how == "run_batch":
        return service.run_batch(tenant_id=tenant, job_ids=job_ids)
    _, *later = phases()
    batch = service.begin(tenant_id=tenant, job_ids=job_ids)
    try:
        if batch.jobs:
            for phase in later:
                service.run_phase(batch, phase)
        return service.summary(batch)
    finally:
        service.release(batch)


def forget_worker(home: str, index: int, how: str, extras: bool, inbox: Any, outbox: Any, ready: Any) -> None:
    """A forget run worker: runs each assigned batch as the forget job does; reports what it did."""
    lower_priority(Settings.from_env())  # as the forget job's freeze step does
    settings = settings_for(home)
    store = open_store(settings)
    derived = open_derived(settings, store)
    service = DeletionService(derived)
    derived.vectors.embedder.embed(["warm up"])  # the model's session, loaded once per process
    derived.vectors.client()
    ready.set()
    while (task := inbox.get()) is not None:
        tenant, job_ids = task["tenant"], task["job_ids"]
        result: dict[str, Any] = {"run_id": task["run_id"], "worker": index, "started": time.time()}
        try:
            if job_ids is None:  # --batching loop: what a forget run with `job_ids: []` picks
                job_ids = service.pending(tenant_id=tenant, states=("REQUESTED",)).get(tenant, [])
            result["job_ids"] = job_ids
            before = certificate.data_map(store, tenant) if extras and job_ids else None
            report = cascade(service, tenant, job_ids, how) if job_ids else {"jobs": {}}
            result["states"] = dict(Counter(report["jobs"].values()))
            result["seconds"] = report.get("seconds", {})
            result["versions"] = report.get("stores", {}).get("primary", 0)
            cascade_end = time.time()
            if extras and report["jobs"]:  # what the prove op attaches: certificates and the data map
                after = certificate.data_map(store, tenant)
                image = certificate.data_map_png(before, after, title=f"Tenant {tenant}")
                certificate.data_map_markdown(before, after, image=image)
                for job_id, state in report["jobs"].items():
                    if state == "COMPLETE":
                        certificate.render_markdown(service.proof(job_id=job_id), service.status(job_id=job_id))
            result["extras"] = time.time() - cascade_end
        except Exception as exc:  # DeletionBlocked or worse: the run fails, the sensor plans again
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["ended"] = time.time()
        outbox.put(result)
    store.close()


def erasure_worker(home: str, inbox: Any, outbox: Any, ready: Any) -> None:
    """The erasure run worker: `erase_tenant` of each assigned tenant; reports its figures."""
    lower_priority(Settings.from_env())  # as the physical_erasure asset does
    settings = settings_for(home)
    store = open_store(settings)
    service = ErasureService(open_derived(settings, store), settings=settings)
    ready.set()
    while (task := inbox.get()) is not None:
        result: dict[str, Any] = {"run_id": task["run_id"], "started": time.time()}
        try:
            report = service.erase_tenant(tenant_id=task["tenant"])
            result["job_ids"] = report["jobs"]
            result["seconds"] = report.get("seconds", {})
            result["bytes"] = sum(report.get("bytesRewritten", {}).values())
            result["hits"] = report.get("byteScan", {}).get("hits", 0)
        except Exception as exc:  # ErasureIncomplete or worse: the sensor requests it again
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["ended"] = time.time()
        outbox.put(result)
    store.close()


# -- the daemon: sensors and the run queue ---------------------------------------------------------


@dataclass
class Run:
    run_id: int
    kind: str  # forget | erasure
    tenant: str
    job_ids: list[str] | None  # None: the worker takes the tenant's pending jobs (--batching loop)
    created: float
    reason: str = ""
    forced: bool = False
    status: str = "queued"  # queued, running, succeeded, failed
    started: float | None = None
    ended: float | None = None
    worker: int | None = None
    result: dict[str, Any] = field(default_factory=dict)


class Daemon:
    """forget_requests_sensor, physical_erasure_sensor and the QueuedRunCoordinator, over the same
    ledger reads and planning functions, dispatching runs to the worker processes."""

    def __init__(
        self,
        store: MemoryStore,
        settings: Settings,
        tenants: list[str],
        args: argparse.Namespace,
        inboxes: list[Any],
        erasure_inbox: Any,
        outbox: Any,
    ) -> None:
        self.ledger = DeletionLedger(store)
        self.erasures = ErasureLedger(store, settings=settings)
        self.settings = settings
        self.tenants = set(tenants)
        self.batching = args.batching
        self.sensor_every = args.sensor_every
        self.settle = timedelta(seconds=args.settle)
        production = settings.erasure_batch_minutes * 60.0
        self.window = args.erasure_every or production
        # The erasure sensor's rule evaluated with the compressed window: `now` moved on by what the
        # production window has more (the deadline margin, 6 h, is not reached either way).
        self.shift = timedelta(seconds=production - self.window)
        self.erasure_tick = min(PRODUCTION_ERASURE_TICK, max(5.0, self.window / 6))
        self.inboxes, self.erasure_inbox, self.outbox = inboxes, erasure_inbox, outbox
        self.runs: list[Run] = []
        self.queue: list[Run] = []
        self.busy: dict[str, Run] = {}
        self.idle_workers = list(range(len(inboxes)))
        self.erasure_idle = True
        self.cursor = 0
        self.run_keys: set[str] = set()
        self.next_sensor = self.next_erasure = self.next_poll = 0.0

    def step(self) -> None:
        now = time.time()
        self._collect()
        if self.batching == "sensor" and now >= self.next_sensor:
            self._forget_sensor()
            self.next_sensor = now + self.sensor_every
        if now >= self.next_erasure:
            self._erasure_sensor()
            self.next_erasure = now + self.erasure_tick
        self._dispatch(now)

    def warmup(self) -> float:
        """Seconds before a stream's first jobs can be COMPLETE: they settle, wait for a sensor tick, run."""
        return self.settle.total_seconds() + 2 * self.sensor_every if self.batching == "sensor" else 10.0

    def active(self, kind: str | None = None) -> list[Run]:
        return [r for r in self.runs if r.status in ("queued", "running") and (kind is None or r.kind == kind)]

    def force_erasures(self, job_ids: set[str]) -> None:
        """An erasure run now for every tenant with a pending erasure of these jobs (not on schedule)."""
        due = {j["tenant_id"] for j in self.erasures.pending() if j["job_id"] in job_ids}
        for tenant in sorted(due - {r.tenant for r in self.active("erasure")}):
            self._enqueue("erasure", tenant, None, "forced", forced=True)

    def _enqueue(self, kind: str, tenant: str, job_ids: list[str] | None, reason: str, forced: bool = False) -> Run:
        run = Run(len(self.runs), kind, tenant, job_ids, time.time(), reason, forced)
        self.runs.append(run)
        self.queue.append(run)
        return run

    def _collect(self) -> None:
        while True:
            try:
                result = self.outbox.get_nowait()
            except queue.Empty:
                return
            run = self.runs[result["run_id"]]
            run.result, run.started, run.ended = result, result["started"], result["ended"]
            if run.job_ids is None:
                run.job_ids = result.get("job_ids", [])
            run.status = "failed" if "error" in result else "succeeded"
            del self.busy[run.tenant]
            if run.kind == "forget":
                assert run.worker is not None
                self.idle_workers.append(run.worker)
            else:
                self.erasure_idle = True

    def _last_run(self, tenant: str) -> LastRun | None:
        """The tenant's latest forget run as `last_forget_run` reports it."""
        runs = [r for r in self.runs if r.kind == "forget" and r.tenant == tenant]
        if not runs:
            return None
        last = runs[-1]
        failures = 0
        for earlier in reversed(runs):
            if earlier.status != "failed":
                break
            failures += 1
        if last.status in ("queued", "running"):
            return LastRun(run_id=str(last.run_id), status="active", ended_at=None, failures=failures)
        ended = datetime.fromtimestamp(last.ended or time.time(), UTC)
        return LastRun(run_id=str(last.run_id), status=last.status, ended_at=ended, failures=failures)

    def _forget_sensor(self) -> None:
        rows = [row for row in self.ledger.ledger() if row["tenant_id"] in self.tenants]
        last_runs = {t: last for t in sorted(self.tenants) if (last := self._last_run(t)) is not None}
        claimed = {j for r in self.active("forget") for j in (r.job_ids or [])}
        planned, self.cursor = plan_forget_runs(
            rows, cursor=self.cursor, last_runs=last_runs, now=datetime.now(UTC), claimed=claimed, settle=self.settle
        )
        for run in planned:
            if run.run_key not in self.run_keys:  # Dagster drops a RunRequest whose run key was used
                self.run_keys.add(run.run_key)
                self._enqueue("forget", run.tenant_id, run.job_ids, run.reason)

    def _erasure_sensor(self) -> None:
        erasing = {r.tenant for r in self.active("erasure")}
        for tenant in self.erasures.due_tenants(now=datetime.now(UTC) + self.shift):
            if tenant in self.tenants and tenant not in erasing:
                self._enqueue("erasure", tenant, None, "due")

    def _dispatch(self, now: float) -> None:
        for run in list(self.queue):  # submission order; a run whose tenant is busy waits
            if run.tenant in self.busy:
                continue
            if run.kind == "forget":
                if not self.idle_workers:
                    continue
                run.worker = self.idle_workers.pop(0)
                inbox = self.inboxes[run.worker]
            else:
                if not self.erasure_idle:
                    continue
                self.erasure_idle, run.worker, inbox = False, -1, self.erasure_inbox
            self.queue.remove(run)
            self._start(run, inbox, now)
        if self.batching == "loop" and self.idle_workers and now >= self.next_poll:
            self.next_poll = now + 1.0
            for tenant in self.ledger.pending(states=("REQUESTED",)):  # tenant of the oldest job first
                if tenant in self.tenants and tenant not in self.busy and self.idle_workers:
                    run = self._enqueue("forget", tenant, None, "loop")
                    self.queue.remove(run)
                    run.worker = self.idle_workers.pop(0)
                    self._start(run, self.inboxes[run.worker], now)

    def _start(self, run: Run, inbox: Any, now: float) -> None:
        run.status, run.started = "running", now
        self.busy[run.tenant] = run
        inbox.put({"run_id": run.run_id, "tenant": run.tenant, "job_ids": run.job_ids})


# -- measuring -------------------------------------------------------------------------------------


def cpu_times() -> tuple[int, int, int] | None:
    """(busy, niced, total) jiffies of the machine since boot, from /proc/stat (Linux)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return sum(fields) - idle, fields[1], sum(fields)


class Monitor:
    """Backlog samples of this run's jobs, from the control plane, and the machine's CPU."""

    def __init__(self, conninfo: str, tenants: list[str], since: float) -> None:
        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.tenants = tenants
        self.since = datetime.fromtimestamp(since, UTC)
        self.samples: list[dict[str, Any]] = []
        self.cpu = cpu_times()

    def close(self) -> None:
        self.conn.close()

    def sample(self) -> dict[str, Any]:
        row = self.conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE state <> 'COMPLETE'), count(*) FILTER (WHERE state = 'BLOCKED'),"
            " count(*) FILTER (WHERE state = 'COMPLETE' AND erased_at IS NULL),"
            " count(*) FILTER (WHERE erased_at IS NOT NULL)"
            " FROM control.deletion_jobs WHERE tenant_id = ANY(%s) AND created_at >= %s",
            (self.tenants, self.since),
        ).fetchone()
        assert row is not None
        cpu, self.cpu = self.cpu, cpu_times()
        busy = niced = None
        if cpu and self.cpu and self.cpu[2] > cpu[2]:
            busy = (self.cpu[0] - cpu[0]) / (self.cpu[2] - cpu[2])
            niced = (self.cpu[1] - cpu[1]) / (self.cpu[2] - cpu[2])
        s = {
            "t": time.time(),
            "jobs": row[0],
            "backlog": row[1],
            "blocked": row[2],
            "unerased": row[3],
            "erased": row[4],
            "cpu": busy,
            "niced": niced,
        }
        self.samples.append(s)
        return s

    def complete_since(self, start: float) -> tuple[int, float, float]:
        """COMPLETE jobs accepted since `start`: how many, and their time to COMPLETE p50 and p99."""
        row = self.conn.execute(
            "SELECT count(*), percentile_disc(0.5) WITHIN GROUP (ORDER BY d), percentile_disc(0.99) WITHIN GROUP"
            " (ORDER BY d) FROM (SELECT extract(epoch FROM completed_at - created_at)::float8 AS d"
            " FROM control.deletion_jobs WHERE tenant_id = ANY(%s) AND created_at >= %s AND state = 'COMPLETE') j",
            (self.tenants, datetime.fromtimestamp(start, UTC)),
        ).fetchone()
        assert row is not None
        return int(row[0]), float(row[1] or math.nan), float(row[2] or math.nan)

    def jobs(self) -> list[dict[str, Any]]:
        rows = self.conn.execute(
            "SELECT job_id, tenant_id, state, extract(epoch FROM created_at)::float8,"
            " extract(epoch FROM completed_at)::float8, extract(epoch FROM erased_at)::float8,"
            " extract(epoch FROM erasure_deadline)::float8"
            " FROM control.deletion_jobs WHERE tenant_id = ANY(%s) AND created_at >= %s",
            (self.tenants, self.since),
        ).fetchall()
        keys = ("job_id", "tenant", "state", "created", "completed", "erased", "deadline")
        return [dict(zip(keys, row, strict=True)) for row in rows]


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x (0 with fewer than two points)."""
    if len(points) < 2:
        return 0.0
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def pct(values: list[float], q: float) -> float:
    return percentile(values, q) if values else math.nan


@dataclass
class PhaseRun:
    phase: Phase
    start: float = 0.0
    end: float = 0.0  # the requester's last due time
    drained: float | None = None  # when every job of the phase was COMPLETE (None: not within --drain-max)
    records: list[tuple[float, float, float, str, str | None, str | None]] = field(default_factory=list)
    offset: int = 0  # jobs of this run accepted before the phase
    switched: int = 0


# -- the run ---------------------------------------------------------------------------------------


class Pump:
    """The parent's loop: the daemon's step, a backlog sample every `every` seconds, a line every 30 s."""

    def __init__(self, daemon: Daemon, monitor: Monitor, t0: float) -> None:
        self.daemon, self.monitor, self.t0 = daemon, monitor, t0
        self.every = SAMPLE_EVERY
        self.next_sample = self.next_print = 0.0
        self.last: dict[str, Any] = monitor.sample()
        self.phase: PhaseRun | None = None

    def tick(self) -> dict[str, Any]:
        self.daemon.step()
        now = time.time()
        if now >= self.next_sample:
            self.last, self.next_sample = self.monitor.sample(), now + self.every
        if now >= self.next_print:
            self.next_print = now + PRINT_EVERY
            print(self.line(now), flush=True)
        time.sleep(0.1)
        return self.last

    def line(self, now: float) -> str:
        s, pr = self.last, self.phase
        n, p50, p99 = self.monitor.complete_since(pr.start if pr else self.t0)
        cpu = f"  cpu {s['cpu'] * 100:.0f}% (niced {s['niced'] * 100:.0f}%)" if s["cpu"] is not None else ""
        active = self.daemon.active()
        queued = sum(r.status == "queued" for r in active)
        head = f"{pr.phase.rate:g}/s: requests {s['jobs'] - pr.offset:,}" if pr else f"requests {s['jobs']:,}"
        return (
            f"[{now - self.t0:6.0f} s] {head}  backlog {s['backlog']:,} (blocked {s['blocked']})"
            f"  COMPLETE {n:,}: p50 {p50:.1f} s, p99 {p99:.1f} s  erasure pending {s['unerased']:,},"
            f" erased {s['erased']:,}  runs queued {queued}, running {len(active) - queued}{cpu}"
        )


def run_phase(
    ctx: Any,
    pump: Pump,
    store: MemoryStore,
    home: str,
    tenants: list[tuple[str, int]],
    pr: PhaseRun,
    args: argparse.Namespace,
    index: int,
) -> None:
    """One rate for its seconds, then until every job of the phase is COMPLETE (or --drain-max)."""
    subjects: dict[str, list[str]] = {}
    for tenant, _ in tenants:
        left = sorted(remaining(store, tenant))
        random.Random(args.seed + index).shuffle(left)
        subjects[tenant] = left
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(
        target=requester,
        args=(
            home,
            [t for t, _ in tenants],
            [float(n) for _, n in tenants],
            subjects,
            pr.phase.rate,
            pr.phase.seconds,
            args.arrivals,
            args.seed + index,
            ready,
            go,
            out,
        ),
    )
    proc.start()
    try:
        if not ready.wait(300):
            raise SystemExit("the requester did not start")
        pr.offset = pump.monitor.sample()["jobs"]
        pump.phase = pr
        pr.start = time.time()
        go.set()
        print(f"\n-- phase {index + 1}: {pr.phase.rate:g} requests/s for {pr.phase.seconds:g} s --", flush=True)
        result: dict[str, Any] | None = None
        while result is None:
            pump.tick()
            try:
                result = out.get_nowait()
            except queue.Empty:
                if not proc.is_alive() and out.empty():
                    raise SystemExit("the requester died") from None
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.terminate()
    pr.records, pr.switched = result["records"], result["switched"]
    pr.start, pr.end = result["t0"], result["t0"] + pr.phase.seconds
    print(f"   stream ended: {len(pr.records):,} requests; draining", flush=True)
    pump.every = 1.0
    deadline = time.time() + args.drain_max
    while time.time() < deadline:
        if pump.tick()["backlog"] == 0 and pump.last["t"] > pr.end:
            pr.drained = pump.last["t"]
            break
    pump.every = SAMPLE_EVERY
    print(pump.line(time.time()), flush=True)


def window(samples: list[tuple[float, float, str]], lo: float, hi: float, mode: str | None = None) -> list[float]:
    return [s for t, s, m in samples if lo <= t < hi and (mode is None or m == mode)]


def ms(values: list[float], q: float) -> float:
    return pct(values, q) * 1000


def phase_summary(
    pr: PhaseRun, jobs: dict[str, dict[str, Any]], samples: list[dict[str, Any]], d: Daemon
) -> dict[str, Any]:
    records = pr.records
    accepted = [r for r in records if r[4]]
    mine = [jobs[r[4]] for r in accepted if r[4] in jobs]
    done = [j["completed"] - j["created"] for j in mine if j["state"] == "COMPLETE"]
    stream = [s for s in samples if pr.start <= s["t"] <= pr.end]
    last_done = max((j["completed"] for j in mine if j["completed"]), default=None)
    runs = [
        r
        for r in d.runs
        if r.kind == "forget" and r.started is not None and pr.start <= r.started < (last_done or pr.end) + 1
    ]
    busy = sum((r.ended or time.time()) - (r.started or 0) for r in runs)
    span = max((last_done or pr.end) - pr.start, 1e-9)
    cpu = [s["cpu"] for s in stream if s["cpu"] is not None]
    niced = [s["niced"] for s in stream if s["niced"] is not None]
    durations = [(r.ended or 0) - (r.started or 0) for r in runs if r.ended]
    drain = None if pr.drained is None or last_done is None else max(0.0, last_done - pr.end)
    # The slope skips the stream's first jobs' way through (settle, sensor ticks, a run): the backlog
    # rises then whatever the rate. A phase too short for that is judged by its drain instead.
    warm = d.warmup()
    judged_from = max(pr.start + (pr.end - pr.start) / 2, pr.start + warm)
    judged = [(s["t"], s["backlog"]) for s in stream if s["t"] >= judged_from]
    if pr.end - judged_from >= 60 and len(judged) >= 6:
        grow, how = slope(judged), f"slope over the last {pr.end - judged_from:.0f} s"
        bounded = grow <= GROWING * pr.phase.rate
    else:
        limit = warm + 2 * max(durations, default=0.0)
        grow, how = math.nan, f"too short for a slope past the first {warm:g} s: drain within {limit:.0f} s"
        bounded = drain is not None and drain <= limit
    by_tenant: dict[str, list[float]] = {}
    for j in mine:
        if j["state"] == "COMPLETE":
            by_tenant.setdefault(j["tenant"], []).append(j["completed"] - j["created"])
    return {
        "rate": pr.phase.rate,
        "seconds": pr.phase.seconds,
        "requests": len(records),
        "achieved_rate": len(records) / pr.phase.seconds,
        "errors": sum(1 for r in records if r[5]),
        "error_sample": next((r[5] for r in records if r[5]), None),
        "late_max": max((r[1] - r[0] for r in records), default=0.0),
        "switched": pr.switched,
        "acceptance_ms": {q: ms([r[2] for r in accepted], p) for q, p in (("p50", 0.5), ("p99", 0.99), ("max", 1))},
        "complete_s": {q: pct(done, p) for q, p in (("p50", 0.5), ("p99", 0.99), ("max", 1))},
        "completed": len(done),
        "blocked": sum(1 for j in mine if j["state"] == "BLOCKED"),
        "open_at_end": sum(1 for j in mine if j["state"] != "COMPLETE"),
        "backlog_max": max((s["backlog"] for s in stream), default=0),
        "backlog_end": stream[-1]["backlog"] if stream else 0,
        "slope": grow,
        "bounded": bounded,
        "judged_by": how,
        "drain_s": drain,
        "throughput": len(done) / span,
        "runs": len(runs),
        "batch_mean": statistics.fmean(len(r.job_ids or []) for r in runs) if runs else 0.0,
        "batch_max": max((len(r.job_ids or []) for r in runs), default=0),
        "run_s": {"p50": pct(durations, 0.5), "max": pct(durations, 1)},
        "worker_busy": busy / (span * len(d.inboxes)),
        "cpu": statistics.fmean(cpu) if cpu else None,
        "niced": statistics.fmean(niced) if niced else None,
        "by_tenant": {t: (len(v), pct(v, 0.5), pct(v, 0.99)) for t, v in sorted(by_tenant.items())},
    }


def verdict(summary: dict[str, Any]) -> str:
    return "bounded" if summary["bounded"] else "GROWING"


def judgement(summary: dict[str, Any], short: bool = False) -> str:
    """The backlog's slope and its share of the rate, or how the phase was judged without one."""
    if math.isnan(summary["slope"]):
        return "by its drain" if short else summary["judged_by"]
    share = f"{summary['slope']:+.2f} jobs/s, {summary['slope'] / summary['rate'] * 100:+.1f}% of the rate"
    return share if short else f"{summary['judged_by']}: {share}"


def print_summary(
    phases: list[PhaseRun],
    d: Daemon,
    monitor: Monitor,
    reader_samples: list[tuple[float, float, str]],
    idle: tuple[float, float, float, float],
    tenants: list[tuple[str, int]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    jobs = {j["job_id"]: j for j in monitor.jobs()}
    summaries = [phase_summary(pr, jobs, monitor.samples, d) for pr in phases]
    print("\n== phases ==")
    for s in summaries:
        drain = "not within --drain-max" if s["drain_s"] is None else f"{s['drain_s']:.0f} s after the stream"
        cpu = f"; cpu {s['cpu'] * 100:.0f}% busy, {s['niced'] * 100:.0f}% niced work" if s["cpu"] is not None else ""
        a, c = s["acceptance_ms"], s["complete_s"]
        notes = [
            *([f"requester up to {s['late_max']:.1f} s late"] if s["late_max"] > 1 else []),
            *([f"{s['errors']} errors: {s['error_sample']}"] if s["errors"] else []),
            *([f"{s['switched']} moved to another tenant (subjects ran out)"] if s["switched"] else []),
        ]
        print(
            f"{s['rate']:g}/s for {s['seconds']:g} s: {s['requests']:,} requests ({s['achieved_rate']:.2f}/s"
            + "".join(f", {n}" for n in notes)
            + ")"
        )
        print(f"  acceptance           p50 {a['p50']:.1f} ms, p99 {a['p99']:.1f} ms, max {a['max']:.1f} ms")
        print(
            f"  time to COMPLETE     p50 {c['p50']:.1f} s, p99 {c['p99']:.1f} s, max {c['max']:.1f} s"
            f" ({s['completed']:,} COMPLETE, {s['blocked']} BLOCKED, {s['open_at_end']} not COMPLETE at the end)"
        )
        print(
            f"  backlog              max {s['backlog_max']:,}, {s['backlog_end']:,} when the stream ended;"
            f" {verdict(s)} ({judgement(s)}); drained {drain}"
        )
        print(
            f"  forget runs          {s['runs']} (jobs a run: mean {s['batch_mean']:.1f}, max {s['batch_max']});"
            f" run p50 {s['run_s']['p50']:.1f} s, max {s['run_s']['max']:.1f} s; workers busy"
            f" {s['worker_busy'] * 100:.0f}%; {s['throughput']:.2f} COMPLETE/s{cpu}"
        )
        for tenant, (n, p50, p99) in s["by_tenant"].items():
            print(f"    {tenant:22} {n:6,} COMPLETE  p50 {p50:7.1f} s  p99 {p99:7.1f} s")

    # Another tenant's recalls.
    idle_from, stream_from, after_from, after_to = idle
    last_end = max(pr.end for pr in phases)
    idle_all = window(reader_samples, idle_from, stream_from) + window(reader_samples, after_from, after_to)
    during = [v for pr in phases for v in window(reader_samples, pr.start, pr.end)]
    rows = {
        "idle (before + after)": idle_all,
        "  idle before": window(reader_samples, idle_from, stream_from),
        "  idle after": window(reader_samples, after_from, after_to),
        "during the stream(s)": during,
        **{f"  during {pr.phase.rate:g}/s": window(reader_samples, pr.start, pr.end) for pr in phases},
        "drains and erasures after": window(reader_samples, last_end, after_from),
    }
    for mode in MODES:
        rows[f"idle, {mode}"] = window(reader_samples, idle_from, stream_from, mode) + window(
            reader_samples, after_from, after_to, mode
        )
        rows[f"during, {mode}"] = [v for pr in phases for v in window(reader_samples, pr.start, pr.end, mode)]
    table = {name: stats(v) for name, v in rows.items()}
    idle_p99 = table["idle (before + after)"]["p99"]
    for s, pr in zip(summaries, phases, strict=True):
        s["reader_p99_ms"] = table[f"  during {pr.phase.rate:g}/s"]["p99"]
        s["reader_ratio"] = s["reader_p99_ms"] / idle_p99
    if len(summaries) > 1:
        print("\n== the curve ==")
        print(
            "| rate/s | requests | acceptance p99 | COMPLETE p50 / p99 | backlog max | backlog slope"
            " | runs, jobs a run | reader p99 / idle |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for s in summaries:
            print(
                f"| {s['rate']:g} | {s['requests']:,} | {s['acceptance_ms']['p99']:.0f} ms"
                f" | {s['complete_s']['p50']:.0f} / {s['complete_s']['p99']:.0f} s | {s['backlog_max']:,}"
                f" | {judgement(s, short=True)}: {verdict(s)}"
                f" | {s['runs']}, {s['batch_mean']:.0f} | {s['reader_ratio']:.2f}x |"
            )

    # Where the cascade's time goes.
    forgets = [r for r in d.runs if r.kind == "forget" and r.result]
    njobs = sum(len(r.job_ids or []) for r in forgets)
    by_phase: Counter[str] = Counter()
    for r in forgets:
        by_phase.update(r.result.get("seconds", {}))
    run_s = sum((r.ended or 0) - (r.started or 0) for r in forgets)
    extras = sum(r.result.get("extras", 0.0) for r in forgets)
    versions = sum(r.result.get("versions", 0) for r in forgets)
    failed = [r for r in forgets if "error" in r.result]
    print("\n== the cascade (every forget run) ==")
    if njobs:
        per_job = run_s / njobs
        print(
            f"{len(forgets)} runs, {njobs:,} jobs, {versions:,} versions; {per_job:.3f} worker-seconds a job"
            f" ({run_s:.0f} s in runs, of which {extras:.0f} s certificates and data maps): at the runs' mean"
            f" {njobs / len(forgets):.0f} jobs a run, {args.workers} worker(s) complete at most"
            f" {args.workers / per_job:.1f} jobs/s when never idle"
        )
        top = ", ".join(f"{k} {v / njobs * 1000:.0f} ms" for k, v in by_phase.most_common(8))
        print(f"per job, by phase: {top}")
    if failed:
        print(f"{len(failed)} failed runs, e.g. {failed[0].result['error']}")

    # Physical erasure.
    erasures = [r for r in d.runs if r.kind == "erasure" and r.result]
    print("\n== physical erasure ==")
    production = d.settings.erasure_batch_minutes * 60.0
    print(
        f"window {d.window:g} s"
        + (f" (compressed from the production {production / 60:g} min)" if d.window != production else " (production)")
        + f", sensor every {d.erasure_tick:g} s"
    )
    print("| tenant | run | jobs | seconds | rewrite / scan | MB rewritten | hits | waited in queue |")
    print("|---|---|---|---|---|---|---|---|")
    windows: list[dict[str, Any]] = []
    for r in erasures:
        res = r.result
        if "error" in res:
            print(f"| {r.tenant} | {'forced' if r.forced else 'scheduled'} | FAILED: {res['error']} | | | | | |")
            continue
        took = res["ended"] - res["started"]
        sec = res.get("seconds", {})
        fixed = sec.get("rewrite", 0.0) + sec.get("scan", 0.0)
        windows.append(
            {"tenant": r.tenant, "jobs": len(res["job_ids"]), "seconds": took, "fixed": fixed, "forced": r.forced}
        )
        print(
            f"| {r.tenant} | {'forced' if r.forced else 'scheduled'} | {len(res['job_ids']):,} | {took:.1f}"
            f" | {sec.get('rewrite', 0):.1f} / {sec.get('scan', 0):.1f} | {res.get('bytes', 0) / 1e6:,.1f}"
            f" | {res.get('hits', 0)} | {(r.started or 0) - r.created:.1f} s |"
        )
    forced_ids = {j for r in erasures if r.forced for j in r.result.get("job_ids", [])}
    mine = [jobs[r[4]] for pr in phases for r in pr.records if r[4] in jobs]
    lag = [j["erased"] - j["completed"] for j in mine if j["erased"] and j["job_id"] not in forced_ids]
    margin = [j["deadline"] - j["erased"] for j in mine if j["erased"] and j["deadline"]]
    unerased = [j for j in mine if j["state"] == "COMPLETE" and not j["erased"]]
    print(
        f"erasure lag (COMPLETE to ERASED) on schedule: {len(lag):,} jobs, p50 {pct(lag, 0.5):.0f} s,"
        f" p99 {pct(lag, 0.99):.0f} s, max {pct(lag, 1):.0f} s; {len(forced_ids & {j['job_id'] for j in mine}):,}"
        f" erased by the final forced pass; {len(unerased)} COMPLETE not erased;"
        f" least margin to the deadline {min(margin, default=math.nan) / 3600:.1f} h"
    )
    # Extrapolated to the production window, one erasure a tenant a window. Its cost: the tenant's
    # rewrite and scan (the most any of its windows took: they follow the tenant's files, not the
    # jobs), plus marking each job ERASED (what a window took beyond them, per job, over every window).
    longest = max(((r.ended or 0) - (r.started or 0) for r in forgets), default=0.0)
    total = sum(n for _, n in tenants)
    hours = d.settings.erasure_hours
    marked = sum(w["jobs"] for w in windows)
    per_job = sum(max(0.0, w["seconds"] - w["fixed"]) for w in windows) / marked if marked else 0.0
    extrapolated: dict[str, Any] = {}
    if windows:
        print(f"marking jobs ERASED: {per_job * 1000:.1f} ms a job (over {marked:,} jobs in {len(windows)} windows)")
    for rate in sorted({max(pr.phase.rate for pr in phases), GOAL_RATE}):
        costs: dict[str, float] = {}
        lines = []
        for tenant, n in tenants:
            fixed = [w["fixed"] for w in windows if w["tenant"] == tenant]
            if not fixed:
                lines.append(f"  {tenant}: no erasure measured")
                continue
            jobs_per_window = rate * n / total * production
            costs[tenant] = max(fixed) + per_job * jobs_per_window
            lines.append(
                f"  {tenant}: {jobs_per_window:,.0f} jobs a window: rewrite + scan {max(fixed):.1f} s (most of"
                f" {len(fixed)} window(s)) + marking {per_job * jobs_per_window:.1f} s = {costs[tenant]:.0f} s"
            )
        busy = sum(costs.values())
        # The last job of a window: it waits the window, a sensor tick, a forget run of its tenant, and
        # (one erasure slot, every tenant due at once) every tenant's erasure.
        worst = production + PRODUCTION_ERASURE_TICK + longest + busy
        ok = len(costs) == len(tenants) and worst < hours * 3600 and busy < production
        extrapolated[f"{rate:g}"] = {"costs": costs, "busy": busy / production, "worst_lag_h": worst / 3600, "ok": ok}
        print(
            f"at {rate:g}/s with the production window ({production / 60:g} min): erasures take {busy:.0f} s of each"
            f" {production:.0f} s ({busy / production * 100:.1f}% of one run slot); a job is ERASED at most"
            f" {worst / 3600:.2f} h after COMPLETE (window + sensor tick + longest forget run + every tenant's"
            f" erasure): within {hours} h {'PASS' if ok else 'FAIL'}"
        )
        for line in lines:
            print(line)

    print("\n== another tenant's recalls ==")
    print(f"{'window':30} {'recalls':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, st in table.items():
        print(f"{name:30} {st['n']:8,} {st['p50']:8.1f} {st['p99']:8.1f} {st['max']:8.1f}")
    ratio = table["during the stream(s)"]["p99"] / idle_p99
    print(f"p99 during / idle: {ratio:.2f}x (target <= 2x: {'PASS' if ratio <= 2 else 'FAIL'})")

    print("\n== against the goal ==")
    sustained = [
        s for s in summaries if s["bounded"] and s["complete_s"]["p99"] < GOAL_COMPLETE_P99 and not s["open_at_end"]
    ]
    best = max((s["rate"] for s in sustained), default=None)
    print(
        f"highest rate sustained in this run (backlog bounded, COMPLETE p99 under {GOAL_COMPLETE_P99 / 60:g} min, all"
        f" COMPLETE): {'none' if best is None else f'{best:g}/s'} (goal {GOAL_RATE:g}/s:"
        f" {'PASS' if best is not None and best >= GOAL_RATE else 'FAIL'})"
    )
    for s in summaries:
        print(
            f"  {s['rate']:g}/s: COMPLETE p99 {s['complete_s']['p99']:.0f} s, backlog {verdict(s)},"
            f" reader p99 {s['reader_ratio']:.2f}x idle"
        )
    return {
        "phases": summaries,
        "reader": table,
        "reader_ratio": ratio,
        "erasure_windows": windows,
        "erasure_lag_s": {"p50": pct(lag, 0.5), "p99": pct(lag, 0.99), "max": pct(lag, 1)},
        "erasure_extrapolated": extrapolated,
        "cascade_seconds_by_phase": dict(by_phase),
        "jobs": njobs,
        "run_seconds": run_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--home", type=Path, help="data folder; tenants are kept and reused (default: a temp dir)")
    parser.add_argument("--sizes", default="100000,10000,1000", help="memories of each tenant that forgets")
    parser.add_argument("--rate", type=float, help="requests a second (one phase of --seconds)")
    parser.add_argument("--seconds", type=float, default=600.0, help="the stream's length at --rate")
    parser.add_argument("--rates", help="several rates, comma separated: one phase of --phase-seconds each")
    parser.add_argument("--phase-seconds", type=float, default=180.0, help="each phase's length with --rates")
    parser.add_argument("--workers", type=int, default=1, help="forget run workers (forget runs at once)")
    parser.add_argument("--batching", choices=("sensor", "loop"), default="sensor", help="how jobs become runs")
    parser.add_argument(
        "--cascade",
        choices=("ops", "run_batch"),
        default="ops",
        help="a run's cascade: phase by phase as the forget job's ops (default), or run_batch (in-process path)",
    )
    parser.add_argument("--sensor-every", type=float, default=15.0, help="forget sensor interval (s)")
    parser.add_argument("--settle", type=float, default=30.0, help="age before the sensor runs a request (s)")
    parser.add_argument("--erasure-every", type=float, help="erasure batch window in seconds (default: production)")
    parser.add_argument("--reader-rate", type=float, default=5.0, help="recalls a second on the untouched tenant")
    parser.add_argument("--reader-size", type=int, default=10_000, help="memories of the reader's tenant")
    parser.add_argument("--idle", type=float, default=60.0, help="seconds of the reader alone before the stream")
    parser.add_argument("--memories-per-subject", type=int, help="M (default: the largest, up to 100, that lasts)")
    parser.add_argument("--arrivals", choices=("poisson", "uniform"), default="poisson")
    parser.add_argument("--drain-max", type=float, default=900.0, help="seconds to wait for a phase's backlog")
    parser.add_argument("--no-extras", action="store_true", help="skip the prove op's certificates and data maps")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--build-only", action="store_true", help="build the tenants under --home, then stop")
    parser.add_argument("--keep-services", action="store_true", help="leave HOME's PostgreSQL and Chroma running")
    args = parser.parse_args()
    if (args.rate is None) == (args.rates is None):
        raise SystemExit("give --rate (with --seconds) or --rates (with --phase-seconds)")
    if args.rate is not None:
        phases = [Phase(args.rate, args.seconds)]
    else:
        phases = [Phase(float(r), args.phase_seconds) for r in args.rates.split(",")]
    if any(p.rate <= 0 or p.seconds <= 0 for p in phases) or args.workers < 1:
        raise SystemExit("rates, seconds and --workers must be positive")
    sizes = sorted((int(s.replace("_", "")) for s in args.sizes.split(",")), reverse=True)
    per_subject, needed, auto = layout(sizes, phases, args.memories_per_subject)

    # A HOME whose services are kept stays for the next run (--home); any other temporary one goes.
    kept = Path(f"/tmp/mp-bench-forget-stream-{os.getpid()}")
    home = args.home or (kept if args.keep_services else temporary_home("mp-bench-forget-stream-"))
    home.mkdir(parents=True, exist_ok=True)
    settings = settings_for(str(home))
    store = open_store(settings)
    procs: list[Any] = []
    try:
        planned = sum(p.rate * p.seconds for p in phases)
        print(f"home {home}; {planned:,.0f} requests planned; {per_subject} memories a subject", flush=True)
        if per_subject < MAX_PER_SUBJECT:
            print(
                f"  (fewer than {MAX_PER_SUBJECT} memories a subject: {planned:,.0f} requests would exhaust the"
                f" {sizes[0]:,} tenant's {sizes[0] // MAX_PER_SUBJECT:,} subjects of {MAX_PER_SUBJECT};"
                f" at most {auto} would do)",
                flush=True,
            )
        tenants: list[tuple[str, int]] = []
        setups: dict[str, dict[str, Any]] = {}
        for n in sizes:
            tenant, setup = tenant_for(
                settings, store, home, f"fs-{n}-m{per_subject}", n, per_subject, needed[n], real=False
            )
            tenants.append((tenant, n))
            setups[tenant] = setup
        reader_tenant, _ = tenant_for(
            settings, store, home, f"fs-reader-{args.reader_size}", args.reader_size, MAX_PER_SUBJECT, 0, real=True
        )
        for tenant, n in tenants:
            print(f"  {tenant}: {n:,} memories, {setups[tenant]['subjects']:,} subjects x {per_subject}")
        print(
            f"  {reader_tenant}: {args.reader_size:,} memories, real vectors, recalled at {args.reader_rate:g}/s;"
            " the others' vectors are synthetic (benchmarks/forget.py's SyntheticVectors), their cascade real"
        )
        if args.build_only:
            return
        run(args, phases, settings, store, home, tenants, reader_tenant, procs)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(10)
        store.close()
        if not args.keep_services:
            stop_services(settings)


def run(
    args: argparse.Namespace,
    phases: list[Phase],
    settings: Settings,
    store: MemoryStore,
    home: Path,
    tenants: list[tuple[str, int]],
    reader_tenant: str,
    procs: list[Any],
) -> None:
    ctx = mp.get_context("spawn")
    h = str(home)
    outbox, erasure_inbox = ctx.Queue(), ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(args.workers)]
    readies = [ctx.Event() for _ in range(args.workers + 2)]
    r_stop, r_out = ctx.Event(), ctx.Queue()
    users = [subject(s) for s in range(args.reader_size // MAX_PER_SUBJECT)]
    procs.append(
        ctx.Process(
            target=reader,
            args=(h, reader_tenant, users, args.reader_rate, readies[0], r_stop, r_out),
            kwargs={"clock": time.time},
        )
    )
    procs.append(ctx.Process(target=erasure_worker, args=(h, erasure_inbox, outbox, readies[1])))
    for i, inbox in enumerate(inboxes):
        procs.append(
            ctx.Process(
                target=forget_worker, args=(h, i, args.cascade, not args.no_extras, inbox, outbox, readies[i + 2])
            )
        )
    for proc in procs:
        proc.start()
    for proc, ready in zip(procs, readies, strict=True):
        if not ready.wait(300):
            raise SystemExit(f"{proc.name} did not start")
    production = settings.erasure_batch_minutes
    print(
        f"\n{args.workers} forget worker(s), cascade {args.cascade}, batching {args.batching}"
        + (
            f" (sensor every {args.sensor_every:g} s, requests settle {args.settle:g} s)"
            if args.batching == "sensor"
            else ""
        )
        + f"; erasure window {args.erasure_every or production * 60:g} s (production {production} min);"
        f" certificates and data maps {'off' if args.no_extras else 'on'}; background niceness"
        f" {Settings.from_env().background_nice}",
        flush=True,
    )
    print(f"idle: the reader alone for {args.idle:g} s", flush=True)
    idle_from = time.time()
    time.sleep(args.idle)
    stream_from = time.time()
    monitor = Monitor(store.conninfo, [t for t, _ in tenants], stream_from)
    try:
        daemon = Daemon(store, settings, [t for t, _ in tenants], args, inboxes, erasure_inbox, outbox)
        pump = Pump(daemon, monitor, stream_from)
        runs = [PhaseRun(p) for p in phases]
        for index, pr in enumerate(runs):
            run_phase(ctx, pump, store, h, tenants, pr, args, index)
        pump.phase = None
        mine = {r[4] for pr in runs for r in pr.records if r[4]}
        if args.erasure_every:  # the schedule erases what completed within a window and a tick
            print("waiting for the scheduled erasures", flush=True)
            deadline = time.time() + args.erasure_every + 2 * daemon.erasure_tick + 120
            while time.time() < deadline and (pump.tick()["unerased"] or daemon.active("erasure")):
                pass
        if monitor.sample()["unerased"]:
            print("final forced erasure of what is left (not on schedule)", flush=True)
            daemon.force_erasures(mine)
        deadline = time.time() + args.drain_max
        while daemon.active("erasure") and time.time() < deadline:  # a failing erasure is requested again
            pump.tick()
        print(pump.line(time.time()), flush=True)
        print(f"idle after: the reader alone for {args.idle / 2:g} s", flush=True)
        after_from = time.time()
        time.sleep(args.idle / 2)
        after_to = time.time()
        r_stop.set()
        samples: list[tuple[float, float, str]] = r_out.get(timeout=120)
        for inbox in [*inboxes, erasure_inbox]:
            inbox.put(None)
        for proc in procs:
            proc.join(60)
        result = print_summary(
            runs, daemon, monitor, samples, (idle_from, stream_from, after_from, after_to), tenants, args
        )
        if args.json:
            args.json.write_text(json.dumps(result, indent=1, default=str))
    finally:
        monitor.close()


if __name__ == "__main__":
    main()
