"""Forgetting: deletion jobs that hide at once, cascade through every registered store via lineage,
erase physically, destroy keys, verify (exact ids and paraphrase probes) and prove.

`DeletionService` is the one object callers use (CLI, API, Dagster ops, tests): it holds the
ledger of jobs (`jobs`) and the requests (`requests`, both `ledger.py`) and the cascade runner
(`cascade.py`), which records every step through that same ledger. The freeze's
targets, counts, probes and fingerprints are `targets.py`; the forget sensor's planning is
`planning.py`. Every name is re-exported here, so `deletion` stays the import path.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from memory_pipelines.lib.forget import targets
from memory_pipelines.lib.forget.cascade import (
    FREEZE,
    PROVE,
    STORE,
    VERIFY,
    Batch,
    DeletionCascade,
    Hook,
    Phase,
    phases,
)
from memory_pipelines.lib.forget.gate import Gate
from memory_pipelines.lib.forget.ledger import (
    DEADLINE_DAYS,
    NEAR_DEADLINE,
    OPEN_STATES,
    POLICY_VERSION,
    REBUILT_PREFIX,
    DeletionBlocked,
    DeletionLedger,
    DeletionRequests,
    rebuilt_counts,
)
from memory_pipelines.lib.forget.planning import (
    MAX_BACKOFF,
    MAX_RELAUNCH_GRACE,
    RELAUNCH_GRACE,
    REQUEST_SETTLE,
    STALL_GRACE,
    LastRun,
    PlannedRun,
    backoff,
    plan_forget_runs,
    relaunch_grace,
)
from memory_pipelines.lib.forget.targets import MAX_PROBES, Probes
from memory_pipelines.lib.results import DeletionJob, DeletionProof, DeletionRequest, KeysShredded
from memory_pipelines.lib.stores.adapter import Source
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "DEADLINE_DAYS",
    "FREEZE",
    "MAX_BACKOFF",
    "MAX_PROBES",
    "MAX_RELAUNCH_GRACE",
    "NEAR_DEADLINE",
    "OPEN_STATES",
    "POLICY_VERSION",
    "PROVE",
    "REBUILT_PREFIX",
    "RELAUNCH_GRACE",
    "REQUEST_SETTLE",
    "STALL_GRACE",
    "STORE",
    "VERIFY",
    "Batch",
    "DeletionBlocked",
    "DeletionCascade",
    "DeletionLedger",
    "DeletionRequests",
    "DeletionService",
    "Hook",
    "LastRun",
    "Phase",
    "PlannedRun",
    "Probes",
    "Source",
    "backoff",
    "phases",
    "plan_forget_runs",
    "rebuilt_counts",
    "relaunch_grace",
]


class DeletionService:
    """Accepts deletion requests and runs them. `hooks` let fault-injection tests act between steps.

    Its parts: `jobs` (the ledger: job rows, states, proofs), `requests` (accepting and hiding) and
    `cascade` (running batches); the requests and the cascade read and write jobs through `jobs`."""

    # Versions with derived copies and no primary row (what a restore leaves); a test reads them here.
    _orphans = staticmethod(targets.orphans)

    def __init__(
        self,
        derived: DerivedStores,
        *,
        hooks: dict[str, Hook] | None = None,
        drain_timeout: float = 30.0,
        erasure_hours: int | None = None,
    ) -> None:
        self.derived = derived
        self.store = derived.store
        self.jobs = DeletionLedger(derived.store)
        self.requests = DeletionRequests(derived, jobs=self.jobs)
        self.cascade = DeletionCascade(
            derived, ledger=self.jobs, hooks=hooks, drain_timeout=drain_timeout, erasure_hours=erasure_hours
        )

    # -- requests (`DeletionRequests`) ----------------------------------------------------------

    def request(
        self,
        *,
        tenant_id: str,
        subject: str | None = None,
        memory_id: str | None = None,
        version: int | None = None,
        all_tenant: bool = False,
        confirm: str | None = None,
        basis: str = "user-request",
        requested_by: str | None = None,
        request_key: str | None = None,
    ) -> DeletionRequest:
        """Accept a request and hide its scope from every read at once (`DeletionRequests.request`)."""
        return self.requests.request(
            tenant_id=tenant_id,
            subject=subject,
            memory_id=memory_id,
            version=version,
            all_tenant=all_tenant,
            confirm=confirm,
            basis=basis,
            requested_by=requested_by,
            request_key=request_key,
        )

    def shred_keys(self, *, tenant_id: str, subject: str | None = None, confirm: str | None = None) -> KeysShredded:
        """Crypto-shred the subject's (or the tenant's) keys now (`DeletionRequests.shred_keys`)."""
        return self.requests.shred_keys(tenant_id=tenant_id, subject=subject, confirm=confirm)

    def request_retention(
        self, *, tenant_id: str, day: date, memory_ids: list[str], categories: dict[str, int], policy_version: str
    ) -> dict[str, Any] | None:
        """Accept a retention sweep of one tenant and day (`DeletionRequests.request_retention`)."""
        return self.requests.request_retention(
            tenant_id=tenant_id, day=day, memory_ids=memory_ids, categories=categories, policy_version=policy_version
        )

    # -- the ledger's reads (`DeletionLedger`) --------------------------------------------------

    def status(self, *, job_id: str) -> DeletionJob:
        """A job's ids, state, targets and counts (`DeletionLedger.status`)."""
        return self.jobs.status(job_id=job_id)

    def proof(self, *, job_id: str) -> DeletionProof:
        """A COMPLETE job's proof, as stored (`DeletionLedger.proof`)."""
        return self.jobs.proof(job_id=job_id)

    def list_jobs(self, *, state: str | None = None, tenant_id: str | None = None) -> list[DeletionJob]:
        """Jobs, oldest first, of a state and tenant when given (`DeletionLedger.list_jobs`)."""
        return self.jobs.list_jobs(state=state, tenant_id=tenant_id)

    def pending(
        self, *, tenant_id: str | None = None, states: tuple[str, ...] = ("REQUESTED",)
    ) -> dict[str, list[str]]:
        """tenant -> job ids in `states` (`DeletionLedger.pending`)."""
        return self.jobs.pending(tenant_id=tenant_id, states=states)

    def ledger(self, *, tenant_id: str | None = None, paused: bool = True) -> list[dict[str, Any]]:
        """Every open job as the forget sensor reads it (`DeletionLedger.ledger`)."""
        return self.jobs.ledger(tenant_id=tenant_id, paused=paused)

    def forget_running(self, *, tenant_id: str) -> bool:
        """Whether a live process holds the tenant's forget run lock now (`DeletionLedger.forget_running`)."""
        return self.jobs.forget_running(tenant_id=tenant_id)

    def attention(self, *, tenant_id: str | None = None, now: datetime | None = None) -> dict[str, dict[str, Any]]:
        """tenant -> open jobs that need a person (`DeletionLedger.attention`)."""
        return self.jobs.attention(tenant_id=tenant_id, now=now)

    # -- the cascade (`DeletionCascade`) ---------------------------------------------------------

    @property
    def hooks(self) -> dict[str, Hook]:
        """Fault-injection hooks by step (`frozen`, `deleted:<store>`, `verified`)."""
        return self.cascade.hooks

    @property
    def gate(self) -> Gate:
        """The gate whose permits a freeze waits to drain."""
        return self.cascade.gate

    @property
    def drain_timeout(self) -> float:
        """Seconds a freeze waits for in-flight permits before the job is BLOCKED."""
        return self.cascade.drain_timeout

    @property
    def erasure_hours(self) -> int:
        """Hours a COMPLETE job has until its physical erasure."""
        return self.cascade.erasure_hours

    def run_batch(self, *, tenant_id: str, job_ids: list[str]) -> dict[str, Any]:
        """Run deletion jobs of one tenant together, phase by phase (`DeletionCascade.run_batch`)."""
        return self.cascade.run_batch(tenant_id=tenant_id, job_ids=job_ids)

    def run_phase(self, batch: Batch, phase: Phase) -> Any:
        """Run one phase after freeze on a batch (`DeletionCascade.run_phase`)."""
        return self.cascade.run_phase(batch, phase)

    def begin(self, *, tenant_id: str, job_ids: list[str]) -> Batch:
        """Take the tenant's run lock and freeze the jobs (`DeletionCascade.begin`)."""
        return self.cascade.begin(tenant_id=tenant_id, job_ids=job_ids)

    def delete_store(self, batch: Batch, store_name: str) -> int:
        """Delete what one registered store holds of the batch's targets; returns the count."""
        return self.cascade.delete_store(batch, store_name)

    def verify(self, batch: Batch) -> dict[str, Any]:
        """Exact-id queries on every store and paraphrase probes; drops the probes once used."""
        return self.cascade.verify(batch)

    def complete(self, batch: Batch) -> list[dict[str, Any]]:
        """Mark the verified jobs COMPLETE and return their proofs (ids, HMACs and counts only)."""
        return self.cascade.complete(batch)

    def release(self, batch: Batch) -> None:
        """Drop the probes and give the tenant's run lock back (idempotent)."""
        self.cascade.release(batch)

    @staticmethod
    def summary(batch: Batch) -> dict[str, Any]:
        """What a batch did: job states, records per store (as first found), seconds per phase."""
        return DeletionCascade.summary(batch)
