"""The deletion cascade: a batch of one tenant's jobs run phase by phase, each step recorded in the
ledger (`ledger.py`) so a retry resumes where the last run stopped.

The phase order is written once, in `phases()`: freeze (take the tenant's run lock, fix targets,
counts, probes and fingerprints), one step per registered store in the registry's cascade order
(copies first, the primary and the keys last), verify, prove. `DeletionCascade.run_batch` (the CLI
and API's in-process path) iterates it, and the forget graph (defs/forget/deletions.py) has one op
per phase. It is read from the registry at each call, since stores may register at runtime.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import psycopg

from memory_pipelines.lib.forget import gate, targets
from memory_pipelines.lib.forget.ledger import REBUILT_PREFIX, DeletionBlocked, DeletionLedger, rebuilt_counts
from memory_pipelines.lib.forget.targets import Probes
from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.results import DeletionJob
from memory_pipelines.lib.stores import lineage, registry
from memory_pipelines.lib.stores.adapter import Context, Source
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
                for phase in later:
                    self.run_phase(batch, phase)
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
        lock_key = f"forget\x1f{tenant_id}"
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
        """Freeze the batch's open jobs, wait for their permits to drain, fix what the run works on."""
        tenant_id = batch.tenant_id
        with self.store.transaction() as conn:
            jobs = [self.ledger.job_row(conn, job_id) for job_id in job_ids]
        for job in jobs:
            if job["tenant_id"] != tenant_id:
                raise ValidationError("job_id", f"job {job['job_id']} belongs to another tenant")
        jobs = [job for job in jobs if job["state"] != "COMPLETE"]
        for job in jobs:
            # A retry starts from the stores' last statuses; failures of other steps are history (audit).
            job["targets"] = {k: v for k, v in job["targets"].items() if registry.is_registered(k)}
        batch.jobs = jobs
        if not jobs:
            return
        with self.store.transaction() as conn:
            conn.execute(
                "UPDATE control.deletion_jobs SET attempts = attempts + 1 WHERE job_id = ANY(%s)",
                ([j["job_id"] for j in jobs],),
            )
        step = "freeze"
        try:
            started = time.perf_counter()
            self.ledger.set_state(jobs, "FROZEN")
            step = "gate"
            # Permits issued before the fence closed must be released or cancelled first; an expired
            # lease does not count as drained, and a drain deadline is a block, never completion.
            left = self.gate.wait_drained(
                tenant_id=tenant_id, job_ids=[j["job_id"] for j in jobs], timeout=self.drain_timeout
            )
            if left:
                raise DeletionBlocked("gate", "UNDRAINED_PERMITS", f"{left} permit(s) still in flight")
            step = "freeze"
            batch.fixed = targets.resolve_targets(self.store, tenant_id, jobs)
            # Copies of versions the scope covers whose primary row a restore dropped go too; they are
            # looked up at every run, and are not targets of the proof (no row, no key of theirs).
            batch.targets = targets.with_orphans(self.store, tenant_id, jobs, batch.fixed)
            batch.found = targets.found(self.derived, tenant_id, jobs, batch.targets)
            batch.probes = targets.probes(self.derived, tenant_id, set().union(*batch.targets.values()))
            targets.fingerprint(self.derived, tenant_id, jobs, batch.targets, batch.probes.stored)
            batch.timings["freeze"] = time.perf_counter() - started
            self._hook("frozen", jobs)
            self.ledger.set_state(jobs, "DELETING")
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
        if not registry.is_registered(store_name):
            raise ValidationError("store", f"no registered store {store_name!r}")
        if not batch.jobs:
            return 0
        try:
            self._hold(batch)
            started = time.perf_counter()
            self._delete_in(store_name, batch)
            batch.timings[store_name] = time.perf_counter() - started
            # DONE:n counts what existed when the job first froze, so a retry after a lost
            # answer still reports what was deleted (the adapters are idempotent and find 0).
            self.ledger.record_targets(
                batch.jobs, store_name, {job_id: f[store_name] for job_id, f in batch.found.items()}
            )
            self._hook(f"deleted:{store_name}", batch.jobs)
        except Exception as exc:
            self._fail(batch, store_name, exc)
        return sum(f[store_name] for f in batch.found.values())

    def verify(self, batch: Batch) -> dict[str, Any]:
        """Exact-id queries on every store and paraphrase probes; drops the probes once used."""
        if not batch.jobs:
            return {}
        try:
            self._hold(batch)
            self.ledger.set_state(batch.jobs, "VERIFYING")
            started = time.perf_counter()
            batch.verification = self._verify(batch)
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

    def _context(self, batch: Batch, store_name: str | None = None) -> Context:
        return Context(
            derived=self.derived,
            tenant_id=batch.tenant_id,
            jobs=batch.jobs,
            everything=set().union(*batch.targets.values()),
            records=batch.deleted.get(store_name, set()) if store_name else set(),
        )

    def _delete_in(self, store_name: str, batch: Batch) -> None:
        """Delete every record of `store_name` derived from the targets (counts come from `targets.found`).

        A record also derived from versions outside the targets (a team summary of other members too)
        is rebuilt without them, not deleted: how many were is recorded per job (`rebuilt:<store>` in
        `found`), so the proof's DONE:n (records reached) tells deleted from rebuilt records."""
        adapter = registry.adapter(store_name)
        ctx = self._context(batch)
        with self.store.transaction() as conn:
            ctx.records = adapter.find(conn, ctx)
            shared = _shared_records(conn, batch.tenant_id, store_name, ctx.records, ctx.everything)
            reached = self._reached(conn, batch, store_name, shared)
        adapter.delete(ctx)
        batch.deleted[store_name] = batch.deleted.get(store_name, set()) | ctx.records  # verified by this run
        if shared:
            with self.store.transaction() as conn:
                kept = _records_left(conn, batch.tenant_id, store_name, shared)
                for job_id, records in reached.items():
                    key = f"{REBUILT_PREFIX}{store_name}"
                    batch.found.setdefault(job_id, {})[key] = len(kept & records)
                    conn.execute(
                        "UPDATE control.deletion_jobs SET found = coalesce(found, '{}'::jsonb) || %s::jsonb"
                        " WHERE job_id = %s",
                        (json.dumps({key: len(kept & records)}), job_id),
                    )

    def _reached(
        self, conn: psycopg.Connection, batch: Batch, store_name: str, shared: set[str]
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
                    derived=self.derived, tenant_id=batch.tenant_id, jobs=[job], everything=batch.targets[job["job_id"]]
                ),
            )
            for job in batch.jobs
        }

    def _verify(self, batch: Batch) -> dict[str, Any]:
        """Exact-id queries on every store plus paraphrase probes; any hit blocks the job."""
        probes = batch.probes
        leftovers: dict[str, int] = {}
        probe_hits = 0
        for spec in registry.stores():
            adapter = registry.adapter(spec.name)
            ctx = self._context(batch, spec.name)
            leftovers[spec.name] = adapter.count(ctx)
            probe_hits += adapter.verify(ctx, probes)
        ctx = self._context(batch)
        with self.store.transaction() as conn:
            row = conn.execute(_LINEAGE_LEFT, (*lineage.pair_arrays(sorted(ctx.everything)), ctx.tenant_id)).fetchone()
        leftovers["lineage"] = int(row[0]) if row else 0
        leftovers["paraphrase_probes"] = probe_hits
        bad = {store: n for store, n in leftovers.items() if n}
        if bad:
            store, count = next(iter(bad.items()))
            raise DeletionBlocked(store, f"VERIFICATION_{store.upper()}", f"{count} record(s) of forgotten data found")
        return {
            "exact_id_queries": {store: 0 for store in leftovers if store != "paraphrase_probes"},
            "paraphrase_probes": {"probes": len(probes.texts), "of": probes.targets, "hits": 0},
        }


def _shared_records(
    conn: psycopg.Connection, tenant_id: str, store: str, records: set[str], sources: set[Source]
) -> set[str]:
    """Those of `records` also derived from a version that is not a target: rebuilt, not deleted."""
    if not records:
        return set()
    rows = conn.execute(
        "SELECT DISTINCT l.record_id FROM derived.lineage l WHERE l.tenant_id = %s AND l.store = %s"
        " AND l.record_id = ANY(%s) AND NOT EXISTS (SELECT 1 FROM unnest(%s::text[], %s::int[])"
        " AS w(memory_id, version) WHERE w.memory_id = l.source_memory_id AND w.version = l.source_version)",
        (tenant_id, store, sorted(records), *lineage.pair_arrays(sorted(sources))),
    ).fetchall()
    return {r[0] for r in rows}


def _records_left(conn: psycopg.Connection, tenant_id: str, store: str, records: set[str]) -> set[str]:
    """Those of `records` the store still holds (by lineage) after its deletion: the rebuilt ones."""
    rows = conn.execute(
        "SELECT DISTINCT record_id FROM derived.lineage WHERE tenant_id = %s AND store = %s AND record_id = ANY(%s)",
        (tenant_id, store, sorted(records)),
    ).fetchall()
    return {r[0] for r in rows}


# Lineage edges of any store still reaching a target (every adapter drops its own; this checks all).
_LINEAGE_LEFT = (
    "SELECT count(*) FROM derived.lineage x JOIN unnest(%s::text[], %s::int[])"
    " AS w(memory_id, version) ON x.source_memory_id = w.memory_id AND x.source_version = w.version"
    " WHERE x.tenant_id = %s"
)
