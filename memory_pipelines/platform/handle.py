"""`DeletionHandle`: a deletion job accepted by `MemoryPlatform.forget`, to wait on and prove."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from memory_pipelines.lib.infra.errors import MemoryPipelinesError, ValidationError
from memory_pipelines.lib.results import DeletionJob, DeletionProof
from memory_pipelines.platform.parts import PlatformParts

__all__ = ["DEFAULT_WAIT_SECONDS", "DeletionHandle", "DeletionTimeout"]

DEFAULT_WAIT_SECONDS = 300.0
_POLL_SECONDS = 0.2


class DeletionTimeout(MemoryPipelinesError, TimeoutError):
    """`DeletionHandle.wait` ran out of time; the job goes on (a later `wait` picks it up)."""

    exit_code = 6


class DeletionHandle:
    """A deletion job accepted by `MemoryPlatform.forget`: its scope is hidden from every read already.

    `wait()` runs the cascade through every registered store (or waits for the run that holds the
    tenant's forget lock) until the job is COMPLETE; `proof()` is the proof of a COMPLETE job.
    """

    def __init__(self, parts: PlatformParts, job: Mapping[str, Any]) -> None:
        self._parts = parts
        self.job_id: str = job["job_id"]
        self.tenant_id: str = job["tenant_id"]
        self.duplicate: bool = bool(job.get("duplicate", False))

    def __repr__(self) -> str:
        return f"DeletionHandle(job_id={self.job_id!r}, tenant_id={self.tenant_id!r})"

    def status(self) -> DeletionJob:
        """The job now: state, scope, basis, deadline and per-store targets (ids and counts only)."""
        return self._parts.ledger.status(job_id=self.job_id)

    def wait(self, *, timeout: float = DEFAULT_WAIT_SECONDS) -> DeletionJob:
        """Run the cascade in this process until the job is COMPLETE and return its status.

        Like `memory-pipelines forget --wait` without Dagster: `DeletionService.run_batch` for this
        job. A BLOCKED job is retried once, as `deletion retry` does; if it blocks again,
        `DeletionBlocked` names the step and its error code. When another process (a Dagster
        forget run) holds the tenant's forget lock, this waits for it; `timeout` seconds bound that
        wait (DeletionTimeout). A cascade this call started is not interrupted midway.
        """
        from memory_pipelines.lib.forget.deletion import DeletionBlocked

        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValidationError("timeout", f"must be a positive number of seconds, got {timeout!r}")
        deadline = time.monotonic() + timeout
        ledger = self._parts.ledger
        ran = False
        while True:
            job = ledger.status(job_id=self.job_id)
            if job["state"] == "COMPLETE":
                return job
            if ran and job["state"] == "BLOCKED":
                raise DeletionBlocked(
                    "job_id", "BLOCKED", f"job {self.job_id} is BLOCKED: {_blocked_targets(job)}; wait() retries it"
                )
            if not ran and not ledger.forget_running(tenant_id=self.tenant_id):
                ran = True
                try:
                    self._parts.deletions.run_batch(tenant_id=self.tenant_id, job_ids=[self.job_id])
                except DeletionBlocked as exc:
                    raise DeletionBlocked(
                        exc.field,
                        exc.code,
                        f"job {self.job_id} is BLOCKED at step {exc.field} ({exc.message}); wait() retries it",
                    ) from exc
                continue
            if time.monotonic() >= deadline:
                raise DeletionTimeout(
                    "timeout",
                    f"job {self.job_id} is {job['state']} after {timeout:g}s: another process holds the tenant's"
                    " forget run lock; wait() again to keep waiting",
                )
            time.sleep(_POLL_SECONDS)

    def proof(self) -> DeletionProof:
        """The job's proof once COMPLETE (ids, HMACs and counts, never text); NotFoundError before."""
        return self._parts.ledger.proof(job_id=self.job_id)


def _blocked_targets(job: DeletionJob) -> str:
    failed = {name: status for name, status in (job.get("targets") or {}).items() if str(status).startswith("FAILED")}
    return ", ".join(f"{name}={status}" for name, status in sorted(failed.items())) or "see status()"
