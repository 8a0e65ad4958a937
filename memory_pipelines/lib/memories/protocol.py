"""The questions another part asks a memory store: written and read by tenant, user and team, and
answered by `MemoryStore` on PostgreSQL or by `InMemoryStore` (lib/memories/in_memory.py) in unit
tests of the logic above it."""

from __future__ import annotations

from typing import Protocol

from memory_pipelines.lib.memories.records import WriteResult
from memory_pipelines.lib.results import TeamMemberAdded, TenantMode, VisibleMemory

__all__ = ["MemoryRecords"]


class MemoryRecords(Protocol):
    def create_tenant(self, *, tenant_id: str, sharing_mode: str = "strict") -> TenantMode: ...

    def set_sharing_mode(self, *, tenant_id: str, sharing_mode: str) -> TenantMode: ...

    def add_team_member(self, *, tenant_id: str, team_id: str, user_id: str) -> TeamMemberAdded: ...

    def write(
        self,
        *,
        tenant_id: str,
        user_id: str,
        text: str,
        memory_id: str | None = None,
        team_id: str | None = None,
        shareable: bool | None = None,
        category: str | None = None,
        confidence: float | None = None,
    ) -> WriteResult: ...

    def list_visible(self, *, tenant_id: str, user_id: str, team_id: str | None = None) -> list[VisibleMemory]: ...
