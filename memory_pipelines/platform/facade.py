"""`MemoryPlatform`: one object holding one of each group of methods, on one `PlatformParts`.

Each public method is the group's own, delegated (`delegate`): the same name, keyword-only
signature, return type and docstring, so `help(MemoryPlatform)` and `inspect.signature` show what
the group defines. The groups are plain classes, each usable alone on a `PlatformParts`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar

from memory_pipelines.lib.infra import services
from memory_pipelines.lib.infra.services import Endpoints
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.platform.backups import Backups
from memory_pipelines.platform.checks import Checks
from memory_pipelines.platform.derived_views import DerivedViews
from memory_pipelines.platform.forgetting import Forgetting
from memory_pipelines.platform.memories import Memories
from memory_pipelines.platform.parts import PlatformParts
from memory_pipelines.platform.runs import Runs
from memory_pipelines.platform.switches import Switches
from memory_pipelines.platform.tenants import Tenants

if TYPE_CHECKING:
    from memory_pipelines.lib.backups.service import BackupService
    from memory_pipelines.lib.forget.deletion import DeletionLedger, DeletionService
    from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = ["MemoryPlatform", "delegate"]

P = ParamSpec("P")
R = TypeVar("R")
G = TypeVar("G")


def delegate(group: str, method: Callable[Concatenate[G, P], R]) -> Callable[Concatenate[MemoryPlatform, P], R]:
    """A `MemoryPlatform` method calling `method` on the group it holds at attribute `group`.

    It wears the group method's name, docstring and signature (`__wrapped__`), for `help()` and
    `inspect.signature`; a type checker sees the same parameters and return type.
    """

    def call(self: MemoryPlatform, /, *args: P.args, **kwargs: P.kwargs) -> R:
        held: G = getattr(self, group)
        return method(held, *args, **kwargs)

    functools.update_wrapper(call, method)
    call.__module__ = __name__
    call.__qualname__ = f"MemoryPlatform.{method.__name__}"
    return call


class MemoryPlatform:
    """Write, recall, version, export, forget, back up and explain memories: one object for all of it.

    `MemoryPlatform.from_env()` reads the settings from the environment (MEMORY_PIPELINES_HOME and
    the rest) and starts or reuses the embedded PostgreSQL and Chroma of that HOME. The
    constructor takes the parts, for tests and for callers that built them. Methods take keyword
    arguments only. Use it as a context manager, or call `close()`; the services keep running for
    the next process (`memory-pipelines stop` stops them).
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
        parts = PlatformParts(
            settings=settings, store=store, endpoints=endpoints, derived=derived, deletions=deletions, backups=backups
        )
        self.settings = settings
        self._parts = parts
        # The groups of methods, each on the same parts (the names `delegate` is given below).
        self._memories = Memories(parts)
        self._tenants = Tenants(parts)
        self._derived_views = DerivedViews(parts)
        self._forgetting = Forgetting(parts)
        self._switches = Switches(parts)
        self._backups = Backups(parts)
        self._runs = Runs(parts)
        self._checks = Checks(parts)

    @classmethod
    def from_env(cls) -> MemoryPlatform:
        """A platform on the settings of the environment; starts or reuses the embedded services."""
        settings = Settings.from_env()
        endpoints = services.ensure_services(settings)
        return cls(settings=settings, store=open_store(settings, endpoints), endpoints=endpoints)

    def __enter__(self) -> MemoryPlatform:
        self._parts.check_open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemoryPlatform(home={str(self.settings.home)!r}{', closed' if self.closed else ''})"

    def close(self) -> None:
        """Release the connections this object holds; idempotent. Later calls raise ConflictError."""
        self._parts.close()

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._parts.closed

    @property
    def store(self) -> MemoryStore:
        """The versioned memory store (PostgreSQL)."""
        return self._parts.store

    @property
    def derived(self) -> DerivedStores:
        """Every derived store (Chroma vectors, keyword index, summaries, analytics), opened on first use."""
        return self._parts.derived

    @property
    def ledger(self) -> DeletionLedger:
        """Deletion jobs and proofs, read from the control plane only (no Chroma, no embedding model)."""
        return self._parts.ledger

    @property
    def deletions(self) -> DeletionService:
        """The deletion service: requests, the cascade, status and proofs."""
        return self._parts.deletions

    @property
    def backups(self) -> BackupService:
        """The backup service: local under HOME/backups, or S3 when MEMORY_PIPELINES_S3_BUCKET is set."""
        return self._parts.backups

    # Memories: write, recall, version and export.
    write = delegate("_memories", Memories.write)
    write_many = delegate("_memories", Memories.write_many)
    recall = delegate("_memories", Memories.recall)
    sync = delegate("_memories", Memories.sync)
    list = delegate("_memories", Memories.list)
    history = delegate("_memories", Memories.history)
    rollback = delegate("_memories", Memories.rollback)
    export = delegate("_memories", Memories.export)
    export_json = delegate("_memories", Memories.export_json)

    # Tenants, their sharing modes and teams, do-not-sell flags.
    tenants = delegate("_tenants", Tenants.tenants)
    require_tenant = delegate("_tenants", Tenants.require_tenant)
    create_tenant = delegate("_tenants", Tenants.create_tenant)
    set_test_tenant = delegate("_tenants", Tenants.set_test_tenant)
    set_sharing_mode = delegate("_tenants", Tenants.set_sharing_mode)
    add_team_member = delegate("_tenants", Tenants.add_team_member)
    remove_team_member = delegate("_tenants", Tenants.remove_team_member)
    set_do_not_sell = delegate("_tenants", Tenants.set_do_not_sell)

    # What the derived stores answer: lineage, summaries, analytics.
    lineage = delegate("_derived_views", DerivedViews.lineage)
    lineage_picture = delegate("_derived_views", DerivedViews.lineage_picture)
    summary = delegate("_derived_views", DerivedViews.summary)
    set_summary_mode = delegate("_derived_views", DerivedViews.set_summary_mode)
    analytics = delegate("_derived_views", DerivedViews.analytics)

    # Forgetting: requests, jobs, proofs, certificates, notices, crypto-shredding, retention.
    forget = delegate("_forgetting", Forgetting.forget)
    request_deletion = delegate("_forgetting", Forgetting.request_deletion)
    deletion = delegate("_forgetting", Forgetting.deletion)
    deletion_status = delegate("_forgetting", Forgetting.deletion_status)
    deletion_proof = delegate("_forgetting", Forgetting.deletion_proof)
    deletion_certificate = delegate("_forgetting", Forgetting.deletion_certificate)
    deletion_jobs = delegate("_forgetting", Forgetting.deletion_jobs)
    notifications = delegate("_forgetting", Forgetting.notifications)
    deliver_notifications = delegate("_forgetting", Forgetting.deliver_notifications)
    shred_keys = delegate("_forgetting", Forgetting.shred_keys)
    convert_keys = delegate("_forgetting", Forgetting.convert_keys)
    retention_preview = delegate("_forgetting", Forgetting.retention_preview)
    sweep_retention = delegate("_forgetting", Forgetting.sweep_retention)

    # Incident switches: deletion work paused, a store's adapter version pinned.
    pause_deletions = delegate("_switches", Switches.pause_deletions)
    resume_deletions = delegate("_switches", Switches.resume_deletions)
    deletion_pauses = delegate("_switches", Switches.deletion_pauses)
    pin_adapter = delegate("_switches", Switches.pin_adapter)
    unpin_adapter = delegate("_switches", Switches.unpin_adapter)
    adapters = delegate("_switches", Switches.adapters)

    # Encrypted backups and safe restores.
    backup = delegate("_backups", Backups.backup)
    restore = delegate("_backups", Backups.restore)
    list_backups = delegate("_backups", Backups.list_backups)
    sweep_backups = delegate("_backups", Backups.sweep_backups)
    request_restore = delegate("_backups", Backups.request_restore)
    check_restore = delegate("_backups", Backups.check_restore)
    reopen_tenant = delegate("_backups", Backups.reopen_tenant)

    # The agent-run fence: leases, recall inside them, permits, prompt snapshots, explain.
    open_run = delegate("_runs", Runs.open_run)
    run_recall = delegate("_runs", Runs.run_recall)
    permit = delegate("_runs", Runs.permit)
    revoke_lease = delegate("_runs", Runs.revoke_lease)
    snapshot_prompt = delegate("_runs", Runs.snapshot_prompt)
    explain = delegate("_runs", Runs.explain)

    # The platform checking itself.
    evaluation_trend = delegate("_checks", Checks.evaluation_trend)
    canary_drill = delegate("_checks", Checks.canary_drill)
