"""Forgetting: deletion jobs that hide at once, cascade through every registered store via lineage,
erase physically, destroy keys, verify (exact ids and paraphrase probes) and prove.

`DeletionService` is the one object callers use (CLI, API, Dagster ops, tests): the ledger's
requests and reads (`ledger.py`) with the cascade runner (`cascade.py`) composed in. The freeze's
targets, counts, probes and fingerprints are `targets.py`; the forget sensor's planning is
`planning.py`. Every name is re-exported here, so `deletion` stays the import path.
"""

from __future__ import annotations

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


class DeletionService(DeletionRequests):
    """Accepts deletion requests and runs them. `hooks` let fault-injection tests act between steps."""

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
        super().__init__(derived)
        self.cascade = DeletionCascade(
            derived, ledger=self, hooks=hooks, drain_timeout=drain_timeout, erasure_hours=erasure_hours
        )

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
