"""The deletion cascade: a batch of one tenant's jobs run phase by phase, each step recorded in the
ledger (`ledger.py`) so a retry resumes where the last run stopped.

The phase order is written once, in `phases()`: freeze (take the tenant's run lock, fix targets,
counts, probes and fingerprints), one step per registered store in the registry's cascade order
(copies first, the primary and the keys last), verify, prove. `DeletionCascade.run_batch` (the CLI
and API's in-process path) iterates it, and the forget graph (defs/forget/deletions.py) has one op
per phase. It is read from the registry at each call, since stores may register at runtime.

What a run costs is mostly waiting: on PostgreSQL commits (each flushes the WAL), on Chroma's
server, on round trips. So the cascade is set-based and overlapped, and no check is dropped:
- set-based: every statement covers all the batch's jobs and targets (`= ANY`, `unnest`), the
  lineage of every target is read once for all stores (`lineage_map`), a ledger write is one
  statement for all jobs and stores, and the freeze commits three times whatever the batch's size;
- overlapped: in `run_batch`, the copies' steps (every store ranked before the primary) run at
  once, each in its own thread and transactions, and are recorded DONE together; verification asks
  every store at once, the exact-id counts of the stores that give one as SQL (`count_sql`) in
  one statement; the freeze reads the probes while it finds the stores' records. The threads come
  from one pool kept for the process (`_submit`). The primary and then the keys still go one by
  one, after every copy, so an interrupted run can always read what it has to find when it resumes.
- Lock order, in every thread: the tenant's run lock (taken at `begin`), then PostgreSQL row
  locks, then a Chroma collection lock; a thread never holds a collection lock while it waits for
  PostgreSQL, and the threads of a step never wait on each other's rows (only the main thread
  writes the jobs' rows, after they are done).
"""

from __future__ import annotations

import contextvars
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import psycopg
from psycopg import sql

from memory_pipelines.lib.forget import gate, switches, targets
from memory_pipelines.lib.forget.ledger import REBUILT_PREFIX, DeletionBlocked, DeletionLedger, rebuilt_counts
from memory_pipelines.lib.forget.targets import Probes
from memory_pipelines.lib.infra import faults, validation
from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories import ordering
from memory_pipelines.lib.results import DeletionJob
from memory_pipelines.lib.stores import lineage, registry
from memory_pipelines.lib.stores.adapter import Context, Lineage, Source, edges_left_sql, lineage_map
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "FREEZE",
    "PROVE",
    "STORE",
    "VERIFY",
    "Batch",
    "DeletionCascade",
    "Hook",
    "Phase",
    "phases",
]

Hook = Callable[[str, list[str]], None]
T = TypeVar("T")

# Threads of one overlapped step (the copies' deletions, verification's questions to the stores).
MAX_THREADS = 8

# Phase kinds: `freeze` begins a batch, every later phase runs on it.
FREEZE = "freeze"
STORE = "store"
VERIFY = "verify"
PROVE = "prove"


@dataclass(frozen=True)
class Phase:
    """One step of the cascade: its name (the forget graph's op), its kind and, for a store step, the store."""

    name: str
    kind: str
    store: str | None = None


def phases() -> tuple[Phase, ...]:
    """The cascade's phase order: freeze, `delete_<store>` per registered store in cascade order,
    verify, prove. Read from the registry now: never cache it (stores register at runtime)."""
    return (
        Phase(FREEZE, FREEZE),
        *(Phase(f"delete_{spec.name}", STORE, spec.name) for spec in registry.stores()),
        Phase(VERIFY, VERIFY),
        Phase(PROVE, PROVE),
    )


@dataclass
class Batch:
    """One run of a tenant's deletion jobs between `begin` and `release`; lives in one process only.

    It holds the tenant's run lock (an advisory lock on `lock_conn`) and the paraphrase probes, which
    are plaintext: never persist a batch, log it or hand it to anything that serialises it.
    """

    tenant_id: str
    jobs: list[DeletionJob]
    lock_conn: psycopg.Connection | None = None
    lock_key: str = ""
    fixed: dict[str, set[Source]] = field(default_factory=dict)
    targets: dict[str, set[Source]] = field(default_factory=dict)
    found: dict[str, dict[str, int]] = field(default_factory=dict)
    probes: Probes = field(default_factory=lambda: Probes(texts=[], vectors=[]), repr=False)
    deleted: dict[str, set[str]] = field(default_factory=dict)  # store -> records this run deleted
    verification: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # The lineage of every target as the freeze read it (None: not read in this process). The store
    # steps reuse it: after acceptance and the drain nothing adds an edge to a hidden target (every
    # derived write checks its sources under the gate lock), so it is still complete; an edge removed
    # meanwhile only means a record whose deletion finds nothing.
    lineage: Lineage | None = None
    # store -> the adapter version this batch runs (read at the freeze: a pin applies from the next batch).
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def job_ids(self) -> list[str]:
        """Ids of the jobs this batch runs (COMPLETE ones were left out at `begin`)."""
        return [job["job_id"] for job in self.jobs]


def _error_code(store: str, exc: BaseException) -> str:
    if isinstance(exc, DeletionBlocked):
        return exc.code
    if isinstance(exc, psycopg.OperationalError) or type(exc).__name__ == "ServiceError":
        return f"{store.upper()}_UNAVAILABLE"
    return f"{store.upper()}_{type(exc).__name__.upper()}"


class DeletionCascade:
    """Runs deletion jobs of one tenant as a batch through every registered store's adapter, then
    verifies and proves them. `hooks` let fault-injection tests act between steps."""

    def __init__(
        self,
        derived: DerivedStores,
        *,
        ledger: DeletionLedger | None = None,
        hooks: dict[str, Hook] | None = None,
        drain_timeout: float = 30.0,
        erasure_hours: int | None = None,
    ) -> None:
        self.derived = derived
        self.store = derived.store
        self.ledger = DeletionLedger(derived.store) if ledger is None else ledger
        # Read when the cascade is made (never at import): MEMORY_PIPELINES_ERASURE_HOURS.
        self.erasure_hours = Settings.from_env().erasure_hours if erasure_hours is None else erasure_hours
        self.hooks = hooks or {}
        self.gate = gate.Gate(derived.store)
        self.drain_timeout = drain_timeout

    def _hook(self, step: str, jobs: list[DeletionJob]) -> None:
        if step in self.hooks:
            self.hooks[step](step, [job["job_id"] for job in jobs])

    def run_batch(self, *, tenant_id: str, job_ids: list[str]) -> dict[str, Any]:
        """Run deletion jobs of one tenant together: each store is visited once for the whole batch.

        One runner per tenant at a time (a session advisory lock): a sensor-launched run and a
        `forget --wait` never interleave; the second finds the jobs COMPLETE and returns. The
        phases are those of `phases()`: freeze is `begin`, each later one `run_phase`; then `release`.
        """
        first, *later = phases()
        assert first.kind == FREEZE
        batch = self.begin(tenant_id=tenant_id, job_ids=job_ids)
        try:
            if batch.jobs:
                faults.point("forget.frozen")
                groups = _groups(later)
                for n, group in enumerate(groups):
                    if group[0].kind != STORE:
                        self.run_phase(batch, group[0])
                    else:
                        # The store step before verify records VERIFYING with its DONE (one commit less).
                        verifying = n + 1 < len(groups) and groups[n + 1][0].kind == VERIFY
                        stores = [phase.store for phase in group if phase.store is not None]
                        self.delete_stores(batch, stores, next_state="VERIFYING" if verifying else None)
                    faults.point(f"forget.{group[0].name}")
            return self.summary(batch)
        finally:
            self.release(batch)

    def run_phase(self, batch: Batch, phase: Phase) -> Any:
        """Run one phase after freeze on the batch: a store's deletion (its count), `verify` (the
        verification) or `prove` (the proofs). Freeze itself is `begin`: it makes the batch."""
        if phase.kind == STORE and phase.store is not None:
            return self.delete_store(batch, phase.store)
        if phase.kind == VERIFY:
            return self.verify(batch)
        if phase.kind == PROVE:
            if batch.jobs and batch.verification is None:
                # A batch begun again at prove (a step in its own process) was verified elsewhere, and
                # a verification is never stored: it is verified again before it may complete.
                self.verify(batch)
            return self.complete(batch)
        raise ValidationError("phase", f"{phase.name!r} does not run on a batch (freeze is `begin`)")

    def begin(self, *, tenant_id: str, job_ids: list[str]) -> Batch:
        """Take the tenant's run lock, freeze the jobs, wait for permits to drain, fix targets and probes.

        The returned batch holds the lock on its own connection until `release`; it holds the
        paraphrase probes (plaintext) in memory only. No jobs left to run: a batch with none.
        """
        validation.check_id("tenant", tenant_id)
        for job_id in job_ids:
            validation.check_id("job_id", job_id)
        lock_key = ordering.run_lock(tenant_id)
        try:
            lock_conn = psycopg.connect(self.store.conninfo, autocommit=True)
        except psycopg.OperationalError as exc:
            raise DeletionBlocked("postgres", "POSTGRES_UNAVAILABLE", str(exc)) from exc
        batch = Batch(tenant_id=tenant_id, jobs=[], lock_conn=lock_conn, lock_key=lock_key)
        try:
            # Seed 2 is the tenant run lock (seed 0: per-subject write locks, seed 1: the gate).
            lock_conn.execute("SELECT pg_advisory_lock(hashtextextended(%s, 2))", (lock_key,))
            self._freeze(batch, job_ids)
        except BaseException:
            self.release(batch)
            raise
        return batch

    def _freeze(self, batch: Batch, job_ids: list[str]) -> None:
        """Freeze the batch's open jobs, wait for their permits to drain, fix what the run works on.

        Three commits whatever the batch's size: the jobs FROZEN (with their attempt counted); the
        targets and what each store holds of them (`found`); the fingerprints, with the jobs DELETING.
        The paraphrase probes are read in another thread while the second transaction runs."""
        tenant_id = batch.tenant_id
        with self.store.transaction() as conn:
            jobs = self.ledger.job_rows(conn, job_ids)
            # Read under the run lock: a pause committed before this start holds every later one.
            paused = switches.active_pause(conn, tenant_id)
            batch.versions = switches.versions_to_run(conn)
        for job in jobs:
            if job["tenant_id"] != tenant_id:
                raise ValidationError("job_id", f"job {job['job_id']} belongs to another tenant")
        jobs = [job for job in jobs if job["state"] != "COMPLETE"]
        if paused is not None:
            # A job already past its freeze (a run that stopped midway) finishes; the rest wait.
            waiting = [job for job in jobs if job["state"] in switches.WAITING_WHILE_PAUSED]
            jobs = [job for job in jobs if job["state"] not in switches.WAITING_WHILE_PAUSED]
            if waiting and not jobs:
                raise switches.DeletionPaused(tenant_id, paused)
        for job in jobs:
            # A retry starts from the stores' last statuses; failures of other steps are history (audit).
            job["targets"] = {k: v for k, v in job["targets"].items() if registry.is_registered(k)}
        batch.jobs = jobs
        if not jobs:
            return
        step = "freeze"
        try:
            started = time.perf_counter()
            with self.store.transaction() as conn:
                self.ledger.count_attempt(conn, jobs)
                self.ledger.set_state(jobs, "FROZEN", conn=conn)
            step = "gate"
            # Permits issued before the fence closed must be released or cancelled first; an expired
            # lease does not count as drained, and a drain deadline is a block, never completion.
            left = self.gate.wait_drained(
                tenant_id=tenant_id, job_ids=[j["job_id"] for j in jobs], timeout=self.drain_timeout
            )
            if left:
                raise DeletionBlocked("gate", "UNDRAINED_PERMITS", f"{left} permit(s) still in flight")
            step = "freeze"
            probing: Future[Probes] | None = None
            try:
                with self.store.transaction() as conn:
                    batch.fixed = targets.resolve_targets(conn, tenant_id, jobs)
                    # Copies of versions the scope covers whose primary row a restore dropped go too; they
                    # are looked up at every run, and are not targets of the proof (no row, no key of theirs).
                    batch.targets = targets.with_orphans(conn, tenant_id, jobs, batch.fixed)
                    # The probes (texts, the index's vectors) are read in another thread, on its own
                    # connection, while this one finds what each store holds.
                    everything = set().union(*batch.targets.values())
                    probing = _submit(targets.probes, self.derived, tenant_id, everything)
                    records = targets.Records(conn, self.derived, tenant_id, jobs, batch.targets)
                    batch.found = targets.found(conn, records, jobs)
            finally:
                if probing is not None:
                    wait([probing])  # never left running, whatever happened here
            assert probing is not None
            batch.probes = probing.result()
            with self.store.transaction() as conn:
                records.conn = conn  # the lineage read above is kept: nothing adds edges to hidden targets
                targets.fingerprint(conn, records, jobs, batch.probes)
                batch.lineage = records.read
                self.ledger.set_state(jobs, "DELETING", conn=conn)
            batch.timings["freeze"] = time.perf_counter() - started
            self._hook("frozen", jobs)
        except Exception as exc:
            self._fail(batch, step, exc)

    @staticmethod
    def _hold(batch: Batch) -> None:
        """The batch still holds the tenant's run lock. Store connections come from a pool that
        replaces dropped ones, so a lost session would otherwise go unnoticed: no step runs, and
        nothing becomes COMPLETE, without the lock."""
        conn = batch.lock_conn
        try:
            if conn is None or conn.closed or conn.broken:
                raise psycopg.OperationalError("its connection is closed")
            conn.execute("SELECT 1")
        except psycopg.Error as exc:
            raise DeletionBlocked("postgres", "RUN_LOCK_LOST", f"the tenant's forget run lock was lost: {exc}") from exc

    def _fail(self, batch: Batch, step: str, exc: Exception) -> NoReturn:
        code = _error_code(step, exc)
        if code == "RUN_LOCK_LOST" or code.endswith("_UNAVAILABLE"):
            self.store.close()  # its idle connections may be dead too: record BLOCKED on a fresh one
        self.ledger.block(batch.jobs, step, code)
        raise DeletionBlocked(step, code, f"{type(exc).__name__}: {exc}") from exc

    def delete_store(self, batch: Batch, store_name: str) -> int:
        """Delete every record of one registered store derived from the batch's targets; returns the count."""
        return self.delete_stores(batch, [store_name])[store_name]

    def delete_stores(
        self, batch: Batch, store_names: Sequence[str], *, next_state: str | None = None
    ) -> dict[str, int]:
        """Delete what each of `store_names` holds of the batch's targets: at once, a thread each, when
        there are several (they must be independent of each other, as the copies are); then record
        them DONE together, with the jobs moved to `next_state` if given and every store succeeded,
        and run their hooks in cascade order. Returns the records reached per store. A store that
        failed blocks the jobs once the others are recorded (a retry redoes it: adapters are
        idempotent)."""
        for name in store_names:
            if not registry.is_registered(name):
                raise ValidationError("store", f"no registered store {name!r}")
        if not batch.jobs:
            return dict.fromkeys(store_names, 0)
        started = time.perf_counter()
        try:
            self._hold(batch)
            prepared = _prepare(self.derived, batch, store_names)
        except Exception as exc:
            self._fail(batch, store_names[0], exc)
        outcomes = _overlapped([_bind(self._delete_one, batch, name, prepared[name]) for name in store_names])
        if len(store_names) > 1:
            batch.timings["copies"] = time.perf_counter() - started
        rebuilt: dict[str, dict[str, int]] = {}
        done: list[str] = []
        failed: list[tuple[str, Exception]] = []
        for name, outcome in zip(store_names, outcomes, strict=True):
            if isinstance(outcome, Exception):
                failed.append((name, outcome))
                continue
            seconds, kept = outcome
            done.append(name)
            batch.timings[name] = seconds
            batch.deleted[name] = batch.deleted.get(name, set()) | prepared[name].ctx.records  # verified by this run
            for job_id, n in kept.items():
                key = f"{REBUILT_PREFIX}{name}"
                batch.found.setdefault(job_id, {})[key] = n
                rebuilt.setdefault(job_id, {})[key] = n
        try:
            if done:
                # DONE:n counts what existed when the job first froze, so a retry after a lost
                # answer still reports what was deleted (the adapters are idempotent and find 0).
                self.ledger.record_done(
                    batch.jobs,
                    {name: {job_id: f[name] for job_id, f in batch.found.items()} for name in done},
                    rebuilt,
                    state=None if failed else next_state,
                )
        except Exception as exc:
            self._fail(batch, (failed[0][0] if failed else done[0]), exc)
        errors = dict(failed)
        for name in store_names:
            try:
                if name in errors:
                    raise errors[name]
                self._hook(f"deleted:{name}", batch.jobs)
            except Exception as exc:
                self._fail(batch, name, exc)
        return {name: sum(f[name] for f in batch.found.values()) for name in store_names}

    def verify(self, batch: Batch) -> dict[str, Any]:
        """Exact-id queries on every store and paraphrase probes; drops the probes once used."""
        if not batch.jobs:
            return {}
        try:
            self._hold(batch)
            if any(job["state"] != "VERIFYING" for job in batch.jobs):
                self.ledger.set_state(batch.jobs, "VERIFYING")
            started = time.perf_counter()
            batch.verification = _verify(self.derived, batch)
            batch.timings["verify"] = time.perf_counter() - started
            batch.probes = Probes(texts=[], vectors=[])
            self._hook("verified", batch.jobs)
        except Exception as exc:
            self._fail(batch, "verify", exc)
        return batch.verification

    def complete(self, batch: Batch) -> list[dict[str, Any]]:
        """Mark the verified jobs COMPLETE and return their proofs (ids, HMACs and counts only)."""
        if not batch.jobs:
            return []
        try:
            if batch.verification is None:
                raise DeletionBlocked("verify", "NOT_VERIFIED", "the batch was not verified")
            self._hold(batch)
            return self.ledger.record_complete(
                batch.tenant_id,
                batch.jobs,
                batch.fixed,
                batch.verification,
                batch.found,
                erasure_hours=self.erasure_hours,
                adapter_versions=batch.versions,
            )
        except Exception as exc:
            self._fail(batch, "verify", exc)

    def release(self, batch: Batch) -> None:
        """Drop the probes and give the tenant's run lock back (idempotent)."""
        batch.probes = Probes(texts=[], vectors=[])
        conn, batch.lock_conn = batch.lock_conn, None
        if conn is None:
            return
        # A session that died has released its advisory lock already; nothing to undo then.
        try:
            conn.execute("SELECT pg_advisory_unlock(hashtextextended(%s, 2))", (batch.lock_key,))
        except psycopg.Error:
            pass
        conn.close()

    @staticmethod
    def summary(batch: Batch) -> dict[str, Any]:
        """What a batch did: job states, records per store (as first found), seconds per phase."""
        return {
            "tenant_id": batch.tenant_id,
            "jobs": {job["job_id"]: job["state"] for job in batch.jobs},
            # Records deleted per store: those reached, less those rebuilt without the scope.
            "stores": (
                {
                    spec.name: sum(f[spec.name] - rebuilt_counts(f).get(spec.name, 0) for f in batch.found.values())
                    for spec in registry.stores()
                }
                if batch.jobs
                else {}
            ),
            "rebuilt": {
                name: n
                for name in registry.names()
                if (n := sum(rebuilt_counts(f).get(name, 0) for f in batch.found.values()))
            },
            **({"seconds": {name: round(value, 4) for name, value in batch.timings.items()}} if batch.jobs else {}),
        }

    # -- stores, through their adapters -------------------------------------------------------

    def _delete_one(self, batch: Batch, store_name: str, prepared: _Prepared) -> tuple[float, dict[str, int]]:
        """Delete `prepared` records of one store (in its own thread when overlapped: it writes no row
        of the jobs). A record also derived from versions outside the targets (a team summary of other
        members too) is rebuilt without them, not deleted: returns the seconds taken and, per job, how
        many of the records it reached were rebuilt (`rebuilt:<store>` in `found`), so the proof's
        DONE:n (records reached) tells deleted from rebuilt records."""
        started = time.perf_counter()
        registry.adapter(store_name).delete(prepared.ctx)
        kept: dict[str, int] = {}
        if prepared.shared:
            with self.store.transaction() as conn:
                left = _records_left(conn, batch.tenant_id, store_name, prepared.shared)
            kept = {job_id: len(left & records) for job_id, records in prepared.reached.items()}
        return time.perf_counter() - started, kept


def _context(derived: DerivedStores, batch: Batch, store_name: str | None = None) -> Context:
    return Context(
        derived=derived,
        tenant_id=batch.tenant_id,
        jobs=batch.jobs,
        everything=set().union(*batch.targets.values()),
        records=batch.deleted.get(store_name, set()) if store_name else set(),
        versions=batch.versions,
    )


def _prepare(derived: DerivedStores, batch: Batch, store_names: Sequence[str]) -> dict[str, _Prepared]:
    """What each store's step deletes, read now in one transaction for all of them: each store's
    records (lineage-found ones from one read of the targets' lineage for every store), those
    also derived from versions outside the targets (rebuilt, not deleted: one query for all
    stores), and which jobs reach them."""
    everything = set().union(*batch.targets.values())
    with derived.store.transaction() as conn:
        lineaged = any(registry.spec(name).derived for name in store_names)
        snapshot = batch.lineage
        if snapshot is None and lineaged:
            snapshot = lineage_map(conn, batch.tenant_id, everything)
        ctxs: dict[str, Context] = {}
        for name in store_names:
            ctx = Context(
                derived=derived,
                tenant_id=batch.tenant_id,
                jobs=batch.jobs,
                everything=everything,
                lineage=snapshot,
                versions=batch.versions,
            )
            ctx.records = registry.adapter(name).find(conn, ctx)
            ctxs[name] = ctx
        # Only a derived store's records have lineage of their own (the primary's and the keys' do not).
        records = {name: ctx.records for name, ctx in ctxs.items()}
        shared = _shared_records(conn, batch.tenant_id, records, everything) if lineaged else {}
        return {
            name: _Prepared(
                ctx=ctxs[name],
                shared=shared.get(name, set()),
                reached=_reached(derived, conn, batch, name, shared.get(name, set()), snapshot),
            )
            for name in store_names
        }


def _reached(
    derived: DerivedStores,
    conn: psycopg.Connection,
    batch: Batch,
    store_name: str,
    shared: set[str],
    snapshot: Lineage | None,
) -> dict[str, set[str]]:
    """job_id -> those of `shared` the job's own targets reach (one job: all of them)."""
    if not shared or len(batch.jobs) == 1:
        return {job["job_id"]: shared for job in batch.jobs}
    adapter = registry.adapter(store_name)
    return {
        job["job_id"]: shared
        & adapter.find(
            conn,
            Context(
                derived=derived,
                tenant_id=batch.tenant_id,
                jobs=[job],
                everything=batch.targets[job["job_id"]],
                lineage=snapshot,
            ),
        )
        for job in batch.jobs
    }


def _verify(derived: DerivedStores, batch: Batch) -> dict[str, Any]:
    """Exact-id queries on every store plus paraphrase probes; any hit blocks the job.

    Every store is asked at once (a thread each); the exact-id counts of the stores that give
    one as SQL, and the lineage edges left (of every store), in one statement. Each figure is
    still read from its store, none is taken from what the run did."""
    probes = batch.probes
    adapters = {spec.name: registry.adapter(spec.name) for spec in registry.stores()}
    ctxs = {name: _context(derived, batch, name) for name in adapters}
    in_sql = [name for name, adapter in adapters.items() if hasattr(adapter, "count_sql")]
    everything = set().union(*batch.targets.values())

    def sql_counts() -> dict[str, int]:
        parts = [adapters[name].count_sql(ctxs[name]) for name in in_sql]
        parts.append(edges_left_sql(batch.tenant_id, None, everything))
        query = sql.SQL("SELECT {}").format(sql.SQL(", ").join(sql.SQL(f"({q})") for q, _ in parts))
        with derived.store.transaction() as conn:
            row = conn.execute(query, tuple(p for _, params in parts for p in params)).fetchone()
        assert row is not None
        return dict(zip([*in_sql, "lineage"], (int(n) for n in row), strict=True))

    def counted(name: str) -> dict[str, int]:
        return {name: int(adapters[name].count(ctxs[name]))}

    def probed(name: str) -> dict[str, int]:
        return {f"probes:{name}": int(adapters[name].verify(ctxs[name], probes))}

    # A store's count and its probes are separate tasks (Chroma answers both at once); the
    # probes first, the longest of them (nearest-vector queries) starting before the rest.
    figures: dict[str, int] = {}
    for outcome in _overlapped(
        [
            *(_bind(probed, name) for name in adapters),
            sql_counts,
            *(_bind(counted, name) for name in adapters if name not in in_sql),
        ]
    ):
        if isinstance(outcome, Exception):
            raise outcome
        figures.update(outcome)
    leftovers = {name: figures[name] for name in adapters}
    probe_hits = sum(figures[f"probes:{name}"] for name in adapters)
    leftovers["lineage"] = figures["lineage"]
    leftovers["paraphrase_probes"] = probe_hits
    bad = {store: n for store, n in leftovers.items() if n}
    if bad:
        store, count = next(iter(bad.items()))
        raise DeletionBlocked(store, f"VERIFICATION_{store.upper()}", f"{count} record(s) of forgotten data found")
    return {
        "exact_id_queries": {store: 0 for store in leftovers if store != "paraphrase_probes"},
        "paraphrase_probes": {"probes": len(probes.texts), "of": probes.targets, "hits": 0},
    }


@dataclass
class _Prepared:
    """One store's step as `_prepare` found it: its context (with the records to delete), those of
    them also derived from versions outside the targets, and which jobs reach those."""

    ctx: Context
    shared: set[str]
    reached: dict[str, set[str]]


def _bind(fn: Callable[..., T], *args: Any) -> Callable[[], T]:
    return lambda: fn(*args)


def _overlapped(tasks: Sequence[Callable[[], T]]) -> list[T | Exception]:
    """Run `tasks` at once (in this thread when there is only one) and return each one's result or
    exception, in order, once every one has ended: none is left running. Each runs in a copy of the
    caller's context (its context variables), as it would inline."""

    def run(task: Callable[[], T]) -> T | Exception:
        try:
            return task()
        except Exception as exc:  # handed back: the caller decides what it blocks
            return exc

    if len(tasks) <= 1:
        return [run(task) for task in tasks]
    futures = [_submit(run, task) for task in tasks]
    return [future.result() for future in futures]


def _submit(fn: Callable[..., T], *args: Any) -> Future[T]:
    """`fn(*args)` in a thread of the process's forget pool, in a copy of the caller's context.

    One pool for the process, its threads kept between steps and runs: a thread started per task
    waited for the GIL behind the busy ones (up to 5 ms each, measured as most of a 45 ms
    verification). Tasks never wait for one another, so runs of several tenants share it safely;
    a forked child starts a pool of its own (the parent's threads are not in it)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="forget")
        pool = _POOL
    return pool.submit(contextvars.copy_context().run, fn, *args)


def _forget_pool_after_fork() -> None:
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _groups(later: Sequence[Phase]) -> list[list[Phase]]:
    """`later` phases as run_batch runs them: the copies' steps (stores ranked before the primary)
    together, every other phase alone, in phase order."""

    def copy(phase: Phase) -> bool:
        return phase.kind == STORE and phase.store is not None and registry.spec(phase.store).order < registry.PRIMARY

    groups: list[list[Phase]] = []
    for phase in later:
        if copy(phase) and groups and copy(groups[-1][-1]):
            groups[-1].append(phase)
        else:
            groups.append([phase])
    return groups


def _shared_records(
    conn: psycopg.Connection, tenant_id: str, records: dict[str, set[str]], sources: set[Source]
) -> dict[str, set[str]]:
    """store -> those of its `records` also derived from a version that is not a target: rebuilt, not
    deleted. One query for every store."""
    pairs = sorted((store, record) for store, ids in records.items() for record in ids)
    if not pairs:
        return {}
    out: dict[str, set[str]] = {}
    # Per record, its edges until the first to a version outside the targets (a team summary's first
    # edge, usually): a hashed set of the targets, not a join of every edge with every target.
    for store, record in conn.execute(
        "SELECT r.store, r.record_id FROM unnest(%s::text[], %s::text[]) AS r(store, record_id)"
        " WHERE EXISTS (SELECT 1 FROM derived.lineage l WHERE l.tenant_id = %s AND l.store = r.store"
        "  AND l.record_id = r.record_id AND (l.source_memory_id, l.source_version) NOT IN"
        "  (SELECT w.memory_id, w.version FROM unnest(%s::text[], %s::int[]) AS w(memory_id, version)))",
        ([p[0] for p in pairs], [p[1] for p in pairs], tenant_id, *lineage.pair_arrays(sorted(sources))),
    ):
        out.setdefault(store, set()).add(record)
    return out


def _records_left(conn: psycopg.Connection, tenant_id: str, store: str, records: set[str]) -> set[str]:
    """Those of `records` the store still holds (by lineage) after its deletion: the rebuilt ones."""
    rows = conn.execute(
        "SELECT DISTINCT record_id FROM derived.lineage WHERE tenant_id = %s AND store = %s AND record_id = ANY(%s)",
        (tenant_id, store, sorted(records)),
    ).fetchall()
    return {r[0] for r in rows}
