"""`Runs`: the agent-run fence: leases, recall inside them, permits, prompt snapshots, `explain`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from memory_pipelines.lib.results import LeaseRevoked, PromptSnapshot, RecallHit, RunExplanation, RunLease
from memory_pipelines.platform.parts import PlatformParts, check_tenant

if TYPE_CHECKING:
    from memory_pipelines.lib.forget.gate import Permit

__all__ = ["Runs"]


class Runs:
    """The agent-run fence: leases, recall inside them, permits, prompt snapshots, `explain`."""

    def __init__(self, parts: PlatformParts) -> None:
        self.parts = parts

    def open_run(self, *, tenant_id: str, subject_id: str, run_id: str, ttl_seconds: int = 300) -> RunLease:
        """Open an agent run's lease for the subject it acts for; `ttl_seconds` its lifetime."""
        check_tenant(tenant_id)
        lease = self.parts.agent_runs.open(
            tenant_id=tenant_id, subject_id=subject_id, run_id=run_id, ttl_seconds=ttl_seconds
        )
        return {"lease_id": lease, "run_id": run_id, "tenant_id": tenant_id, "subject_id": subject_id}

    def run_recall(
        self, *, lease_id: str, query: str, team_id: str | None = None, k: int = 5, mode: str = "hybrid"
    ) -> list[RecallHit]:
        """Recall for the run's subject inside its lease: every hit is fenced on the lease."""
        return self.parts.agent_runs.recall(lease_id=lease_id, query=query, team_id=team_id, k=k, mode=mode)

    def permit(
        self, *, lease_id: str, sink: str, on_cancel: Iterable[Callable[[], None]] = ()
    ) -> AbstractContextManager[Permit]:
        """`with mp.permit(lease_id=..., sink=...) as p:` a sink boundary (model_output, tool_dispatch,
        state_write, memory_write, queued_work); call `p.check()` between units. Refused once a
        deletion closed a fence of the run; released when the block ends, cancelled on an error."""
        return self.parts.agent_runs.gate.permit(lease_id=lease_id, sink=sink, on_cancel=on_cancel)

    def revoke_lease(self, *, lease_id: str) -> LeaseRevoked:
        """Operator action for a crashed run: cancel its in-flight permits and close its lease."""
        return self.parts.agent_runs.gate.revoke(lease_id=lease_id)

    def snapshot_prompt(
        self, *, lease_id: str, prompt: str, sources: Iterable[tuple[str, int]] | None = None
    ) -> PromptSnapshot:
        """Store the prompt the run sent, sealed, with lineage to the memory versions in it
        (default: everything the lease read); forgetting any of them removes it."""
        return self.parts.agent_runs.snapshot_prompt(lease_id=lease_id, prompt=prompt, sources=sources)

    def explain(self, *, tenant_id: str, run_id: str) -> RunExplanation:
        """The recall chain of an agent run: memories it read (text while present) and derived records."""
        check_tenant(tenant_id)
        return self.parts.agent_runs.explain(tenant_id=tenant_id, run_id=run_id)
