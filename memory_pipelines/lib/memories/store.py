"""The versioned, encrypted memory store on PostgreSQL (source of truth for every derived store).

A memory has a stable `memory_id` and an append-only list of versions; exactly one is current.
Text is sealed under its author's subject key with (tenant, memory_id, version) as associated data,
so no plaintext reaches the database, its WAL or its backups.

`MemoryStore` is a facade over parts it holds, one per concern, each in a module of its own and
usable alone: connections.py (pool, transactions), tenants.py (tenants, subjects, change sequence),
teams.py, sealing.py (texts at rest), versions.py (heads, rollback, history), writes.py (writes,
do-not-sell), visibility.py (who sees what), derived_reads.py (what derived stores read), export.py
and statistics.py. Names other modules import from here are re-exported unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import psycopg

from memory_pipelines.lib.memories import tenants, visibility
from memory_pipelines.lib.memories.connections import POOL_IDLE, Connections
from memory_pipelines.lib.memories.derived_reads import DerivedReads
from memory_pipelines.lib.memories.export import EXPORT_BATCH, Export
from memory_pipelines.lib.memories.keys import KeyStore
from memory_pipelines.lib.memories.records import CurrentVersion, WriteResult
from memory_pipelines.lib.memories.sealing import Sealing
from memory_pipelines.lib.memories.sealing import query_aad as query_aad
from memory_pipelines.lib.memories.sealing import text_aad as text_aad
from memory_pipelines.lib.memories.statistics import Statistics
from memory_pipelines.lib.memories.teams import Teams
from memory_pipelines.lib.memories.tenants import Tenants
from memory_pipelines.lib.memories.versions import Versions, repair_heads
from memory_pipelines.lib.memories.visibility import Visibility, visible_candidates_sql
from memory_pipelines.lib.memories.write_rules import DEFAULT_CATEGORY, DEFAULT_CONFIDENCE
from memory_pipelines.lib.memories.writes import Writes
from memory_pipelines.lib.results import (
    DoNotSell,
    ExportedVersion,
    MemoryVersion,
    RollBack,
    TeamMemberAdded,
    TeamMemberRemoved,
    TenantInfo,
    TenantMode,
    TestTenant,
    VisibleMemory,
)

__all__ = [
    "DEFAULT_CATEGORY",
    "DEFAULT_CONFIDENCE",
    "EXPORT_BATCH",
    "POOL_IDLE",
    "CurrentVersion",
    "MemoryStore",
    "WriteResult",
    "repair_heads",
    "visible_candidates_sql",
]


class MemoryStore:
    """API over the memory and key-store schemas. Methods take keyword arguments only.

    Each method hands its call to the part that does it; the parts share one `Connections`, so a
    transaction opened here is the one every part joins in this thread."""

    def __init__(self, conninfo: str, keys: KeyStore) -> None:
        self.conninfo = conninfo
        self.keys = keys
        self.connections = Connections(conninfo)
        self.sealing = Sealing(keys)
        self.tenancy = Tenants(self.connections)
        self.membership = Teams(self.connections)
        self.versions = Versions(self.connections, keys, self.sealing)
        self.writes = Writes(self.connections, keys, self.sealing, self.versions)
        self.visibility = Visibility(self.connections, self.sealing)
        self.derived_reads = DerivedReads(self.connections, keys, self.sealing)
        self.export = Export(self.connections, keys)
        self.statistics = Statistics(self.connections)

    # -- connections -------------------------------------------------------------------------------

    def transaction(self) -> AbstractContextManager[psycopg.Connection[Any]]:
        """One transaction on a pooled connection; nested in a thread, a savepoint of the open one."""
        return self.connections.transaction()

    def close(self) -> None:
        """Close the idle connections; the store stays usable (it opens new ones when asked)."""
        self.connections.close()

    # -- tenants and teams -------------------------------------------------------------------------

    def create_tenant(self, *, tenant_id: str, sharing_mode: str = "strict") -> TenantMode:
        """Create a tenant (idempotent); an existing tenant keeps its data and gets `sharing_mode`."""
        return self.tenancy.create_tenant(tenant_id=tenant_id, sharing_mode=sharing_mode)

    def set_test_tenant(self, *, tenant_id: str, test: bool = True) -> TestTenant:
        """Mark a tenant as a test tenant (made if absent), or not (see `Tenants.set_test_tenant`)."""
        return self.tenancy.set_test_tenant(tenant_id=tenant_id, test=test)

    def set_sharing_mode(self, *, tenant_id: str, sharing_mode: str) -> TenantMode:
        """Change an existing tenant's sharing mode."""
        return self.tenancy.set_sharing_mode(tenant_id=tenant_id, sharing_mode=sharing_mode)

    def tenants(self) -> list[TenantInfo]:
        """Every tenant with its sharing mode and counts (no text)."""
        return self.tenancy.tenants()

    def tenant_watermarks(self) -> dict[str, int]:
        """tenant -> change sequence, tenants behind the restore gate left out."""
        return self.tenancy.tenant_watermarks()

    @staticmethod
    def tenant_mode(conn: psycopg.Connection, tenant_id: str) -> str:
        """The sharing mode of a tenant open for use, checked on `conn` (see `tenants.tenant_mode`)."""
        return tenants.tenant_mode(conn, tenant_id)

    def tenant_exists(self, *, tenant_id: str) -> bool:
        """Whether the tenant has a row (deleted or not)."""
        return self.tenancy.tenant_exists(tenant_id=tenant_id)

    def require_tenant(self, *, tenant_id: str) -> str:
        """The tenant's sharing mode; NotFoundError('tenant') when it does not exist."""
        return self.tenancy.require_tenant(tenant_id=tenant_id)

    def change_seq(self, *, tenant_id: str) -> int:
        """The tenant's change sequence."""
        return self.tenancy.change_seq(tenant_id=tenant_id)

    def add_team_member(self, *, tenant_id: str, team_id: str, user_id: str) -> TeamMemberAdded:
        """Add a user to a team, creating tenant and team if needed (idempotent)."""
        return self.membership.add_team_member(tenant_id=tenant_id, team_id=team_id, user_id=user_id)

    def remove_team_member(self, *, tenant_id: str, team_id: str, user_id: str) -> TeamMemberRemoved:
        """Remove a user from a team; the memories they wrote for it stay with the team."""
        return self.membership.remove_team_member(tenant_id=tenant_id, team_id=team_id, user_id=user_id)

    def teams(self, *, tenant_id: str) -> dict[str, list[str]]:
        """team_id -> current members."""
        return self.membership.teams(tenant_id=tenant_id)

    # -- writes and versions -----------------------------------------------------------------------

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
        original_query: str | None = None,
        do_not_sell: bool | None = None,
    ) -> WriteResult:
        """Write a memory or a new version of one (see `Writes.write`; an identical write is a no-op)."""
        return self.writes.write(
            tenant_id=tenant_id,
            user_id=user_id,
            text=text,
            memory_id=memory_id,
            team_id=team_id,
            shareable=shareable,
            category=category,
            confidence=confidence,
            original_query=original_query,
            do_not_sell=do_not_sell,
        )

    def write_many(self, *, tenant_id: str, items: list[dict[str, Any]]) -> list[WriteResult]:
        """Bulk-write new memories in chunks (see `Writes.write_many`); results in item order."""
        return self.writes.write_many(tenant_id=tenant_id, items=items)

    def set_do_not_sell(
        self,
        *,
        tenant_id: str,
        user_id: str,
        value: bool = True,
        memory_id: str | None = None,
        subject: str | None = None,
    ) -> DoNotSell:
        """CCPA opt-out for one memory or for every memory of a subject (present and future)."""
        return self.writes.set_do_not_sell(
            tenant_id=tenant_id, user_id=user_id, value=value, memory_id=memory_id, subject=subject
        )

    def rollback(self, *, tenant_id: str, memory_id: str, user_id: str) -> RollBack:
        """Make the previous version current again, as a new version (see `Versions.rollback`)."""
        return self.versions.rollback(tenant_id=tenant_id, memory_id=memory_id, user_id=user_id)

    def history(self, *, tenant_id: str, memory_id: str) -> list[MemoryVersion]:
        """Every version of a memory, oldest first, decrypted."""
        return self.versions.history(tenant_id=tenant_id, memory_id=memory_id)

    # -- visibility --------------------------------------------------------------------------------

    def list_visible(self, *, tenant_id: str, user_id: str, team_id: str | None = None) -> list[VisibleMemory]:
        """Current memories a user sees (see `Visibility.list_visible`)."""
        return self.visibility.list_visible(tenant_id=tenant_id, user_id=user_id, team_id=team_id)

    def visible_scope(self, *, tenant_id: str, user_id: str, team_id: str | None = None) -> dict[str, Any]:
        """What a user may see, without decrypting: sharing mode, team members, visible (memory_id, version)."""
        return self.visibility.visible_scope(tenant_id=tenant_id, user_id=user_id, team_id=team_id)

    def check_scope(self, conn: psycopg.Connection, tenant_id: str, user_id: str, team_id: str | None) -> str | None:
        """Validate a recall scope on `conn`; the key of its rule (see `visibility.check_scope`)."""
        return visibility.check_scope(conn, tenant_id, user_id, team_id)

    def recall_scope(self, *, tenant_id: str, user_id: str, team_id: str | None = None) -> dict[str, Any]:
        """Sharing mode, members and change sequence: what recall needs before it asks the indexes."""
        return self.visibility.recall_scope(tenant_id=tenant_id, user_id=user_id, team_id=team_id)

    @staticmethod
    def scope_versions(
        conn: psycopg.Connection, scope: str | None, tenant_id: str, user_id: str, team_id: str | None, *, cap: int
    ) -> list[tuple[str, int]] | None:
        """Every version a scope's rule can admit, or None beyond `cap` memories (`visibility.scope_versions`)."""
        return visibility.scope_versions(conn, scope, tenant_id, user_id, team_id, cap=cap)

    def confirm_visible(
        self,
        *,
        tenant_id: str,
        user_id: str,
        team_id: str | None = None,
        candidates: list[tuple[str, int]],
        in_scope: bool = False,
    ) -> dict[tuple[str, int], dict[str, Any]]:
        """The `candidates` the user sees now (see `Visibility.confirm_visible`)."""
        return self.visibility.confirm_visible(
            tenant_id=tenant_id, user_id=user_id, team_id=team_id, candidates=candidates, in_scope=in_scope
        )

    # -- what derived stores read ------------------------------------------------------------------

    def current_versions(
        self, *, tenant_id: str, user_ids: list[str] | None = None, team_ids: list[str] | None = None
    ) -> list[CurrentVersion]:
        """Every current version of the tenant with its metadata (no text), ordered by memory_id."""
        return self.derived_reads.current_versions(tenant_id=tenant_id, user_ids=user_ids, team_ids=team_ids)

    def original_queries(self, *, tenant_id: str, memory_ids: list[str]) -> dict[str, str]:
        """memory_id -> the query that produced its current version; hidden ones left out."""
        return self.derived_reads.original_queries(tenant_id=tenant_id, memory_ids=memory_ids)

    def open_texts(
        self,
        *,
        tenant_id: str,
        sources: list[tuple[str, int]],
        skip_unreadable: bool = False,
        visible_only: bool = False,
    ) -> dict[tuple[str, int], str]:
        """Decrypt the text of exactly these versions (see `DerivedReads.open_texts`)."""
        return self.derived_reads.open_texts(
            tenant_id=tenant_id, sources=sources, skip_unreadable=skip_unreadable, visible_only=visible_only
        )

    # -- a subject's export, statistics ------------------------------------------------------------

    def iter_export(self, *, tenant_id: str, subject: str) -> Iterator[ExportedVersion]:
        """Every version of every memory the subject wrote, personal and team, streamed in batches."""
        return self.export.iter_export(tenant_id=tenant_id, subject=subject)

    def export_json(
        self, *, tenant_id: str, subject: str, more: Callable[[], Mapping[str, Any]] | None = None
    ) -> Iterator[str]:
        """The subject's export as chunks of one JSON document (see `Export.export_json`)."""
        return self.export.export_json(tenant_id=tenant_id, subject=subject, more=more)

    def tenant_stats(self, *, tenant_id: str) -> dict[str, Any]:
        """Counts for one tenant (no text): what the `memories` asset reports per partition."""
        return self.statistics.tenant_stats(tenant_id=tenant_id)

    def integrity_problems(self, *, tenant_id: str) -> dict[str, int]:
        """Counts of rows that break the store's invariants (all zero when healthy)."""
        return self.statistics.integrity_problems(tenant_id=tenant_id)
