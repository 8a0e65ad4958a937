"""`PlatformParts`: what every group of `MemoryPlatform` methods works with, each part opened on first
use (the derived stores load the embedding model and reach Chroma), and the platform's lifecycle."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import ConflictError
from memory_pipelines.lib.infra.services import Endpoints
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.runtime import open_backups

if TYPE_CHECKING:
    from memory_pipelines.lib.agent_runs.runs import AgentRuns
    from memory_pipelines.lib.backups.service import BackupService
    from memory_pipelines.lib.forget.deletion import DeletionLedger, DeletionService
    from memory_pipelines.lib.stores.analytics.store import AnalyticsStore
    from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = ["PlatformParts", "check_tenant"]


def check_tenant(tenant_id: str) -> None:
    """Every door refuses malformed and reserved tenant ids (eval, eval-*, canary-*) alike."""
    validation.check_customer_tenant("tenant", tenant_id)


class PlatformParts:
    """The parts every group of methods works with, each opened on first use, and the lifecycle.

    Given parts are used as they are; the others are opened from `settings` when first read. After
    `close()` every part refuses (ConflictError naming the platform).
    """

    def __init__(
        self,
        *,
        settings: Settings,
        store: MemoryStore,
        endpoints: Endpoints | None = None,
        derived: DerivedStores | None = None,
        deletions: DeletionService | None = None,
        backups: BackupService | None = None,
    ) -> None:
        self.settings = settings
        self._store = store
        self._endpoints = endpoints
        self._derived = derived
        self._backups = backups
        self._deletions = deletions
        self._runs: AgentRuns | None = None
        self._analytics: AnalyticsStore | None = None
        self._lock = threading.Lock()
        self._closed = False

    def check_open(self) -> None:
        """Refuse once closed: ConflictError naming the platform."""
        if self._closed:
            raise ConflictError("platform", "is closed; open a new MemoryPlatform")

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    @property
    def store(self) -> MemoryStore:
        """The versioned memory store (PostgreSQL)."""
        self.check_open()
        return self._store

    @property
    def derived(self) -> DerivedStores:
        """Every derived store (Chroma vectors, keyword index, summaries, analytics), opened on first use."""
        self.check_open()
        with self._lock:
            if self._derived is None:
                from memory_pipelines.lib.stores.derived import open_derived

                self._derived = open_derived(self.settings, self._store, endpoints=self._endpoints)
            return self._derived

    @property
    def ledger(self) -> DeletionLedger:
        """Deletion jobs and proofs, read from the control plane only (no Chroma, no embedding model)."""
        from memory_pipelines.lib.forget.deletion import DeletionLedger

        return DeletionLedger(self.store)

    @property
    def deletions(self) -> DeletionService:
        """The deletion service: requests, the cascade, status and proofs."""
        derived = self.derived
        with self._lock:
            if self._deletions is None:
                from memory_pipelines.lib.forget.deletion import DeletionService

                self._deletions = DeletionService(derived, erasure_hours=self.settings.erasure_hours)
            return self._deletions

    @property
    def backups(self) -> BackupService:
        """The backup service: local under HOME/backups, or S3 when MEMORY_PIPELINES_S3_BUCKET is set."""
        self.check_open()
        with self._lock:
            if self._backups is None:
                self._backups = open_backups(self.settings, self._store)
            return self._backups

    @property
    def agent_runs(self) -> AgentRuns:
        """Agent runs on the derived stores: one gate (a connection per thread) for every run call."""
        derived = self.derived
        with self._lock:
            if self._runs is None:
                from memory_pipelines.lib.agent_runs.runs import AgentRuns

                self._runs = AgentRuns(derived)
            return self._runs

    @property
    def analytics(self) -> AnalyticsStore:
        """The derived stores' analytics copy if they are open, else one of its own: a query needs
        neither Chroma nor the embedding model."""
        self.check_open()
        with self._lock:
            if self._derived is not None:
                return self._derived.analytics
            if self._analytics is None:
                from memory_pipelines.lib.stores.analytics.store import AnalyticsStore, QueryLimits

                self._analytics = AnalyticsStore(
                    store=self._store, limits=QueryLimits.of(self.settings), old_files=self.settings.analytics_old_files
                )
            return self._analytics

    def close(self) -> None:
        """Release the connections this object holds; idempotent. Later calls raise ConflictError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._store.close()
