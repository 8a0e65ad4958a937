"""`MemoryPlatform`: the one Python entry point to the memory store and everything around it.

    from memory_pipelines import MemoryPlatform

    with MemoryPlatform.from_env() as mp:
        mp.write(tenant_id="acme", user_id="alice", text="Allergic to penicillin")
        mp.recall(tenant_id="acme", user_id="alice", query="which antibiotics?")
        mp.forget(tenant_id="acme", subject="alice").wait()

It holds the existing parts and calls them: the memory store (`open_store`), the derived stores
(`open_derived`, opened on first use: they load the embedding model and reach Chroma), the
deletion service and the backup service. No Dagster: what the CLI runs as Dagster jobs (the
forget cascade, backups, restores) runs here in-process, through the same library calls the
jobs' ops make. Errors are `MemoryPipelinesError` subclasses naming the field.

The `memory-pipelines` CLI is a front end to this class: every command that does not launch a
Dagster run or manage the services calls one method here. Answers are plain dicts typed by the
TypedDicts of `memory_pipelines.lib.results`. The methods are grouped in mixin classes below
(memories, tenants, derived views, forgetting, backups, agent runs and checks), all on the parts
of `_Parts`; `MemoryPlatform` is all of them.
"""

from __future__ import annotations

import builtins
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from datetime import date
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

from memory_pipelines.lib.infra import services, validation
from memory_pipelines.lib.infra.errors import ConflictError, MemoryPipelinesError, ValidationError
from memory_pipelines.lib.infra.services import Endpoints
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import (
    AdapterPin,
    AnalyticsAnswer,
    BackupListing,
    BackupsExpired,
    BackupTaken,
    CanaryDrill,
    DeletionJob,
    DeletionPause,
    DeletionProof,
    DeletionRequest,
    DoNotSell,
    EvaluationTrend,
    ExportedVersion,
    KeysConverted,
    KeysShredded,
    LeaseRevoked,
    LineageRecord,
    MemoryVersion,
    MemoryWrite,
    Notification,
    NotificationsDelivered,
    PromptSnapshot,
    RecallHit,
    RecordSources,
    RestoreReport,
    RestoreRequest,
    RetentionPreview,
    RetentionSweep,
    RollBack,
    RunExplanation,
    RunLease,
    StoreAdapter,
    Summary,
    SummaryMode,
    SyncCounts,
    TeamMemberAdded,
    TeamMemberRemoved,
    TenantInfo,
    TenantMode,
    TenantReopened,
    TestTenant,
    VisibleMemory,
)
from memory_pipelines.lib.runtime import open_backups, open_store

if TYPE_CHECKING:
    from memory_pipelines.lib.agent_runs.runs import AgentRuns
    from memory_pipelines.lib.backups.service import BackupService
    from memory_pipelines.lib.forget.deletion import DeletionLedger, DeletionService
    from memory_pipelines.lib.forget.gate import Permit
    from memory_pipelines.lib.stores.analytics.store import AnalyticsStore
    from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = ["DEFAULT_WAIT_SECONDS", "DeletionHandle", "DeletionTimeout", "MemoryPlatform"]

# `list` is a method name of `_Memories`: annotations there use `builtins.list`, or this alias.
Rows = list[dict[str, Any]]

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

    def __init__(self, platform: MemoryPlatform, job: Mapping[str, Any]) -> None:
        self._platform = platform
        self.job_id: str = job["job_id"]
        self.tenant_id: str = job["tenant_id"]
        self.duplicate: bool = bool(job.get("duplicate", False))

    def __repr__(self) -> str:
        return f"DeletionHandle(job_id={self.job_id!r}, tenant_id={self.tenant_id!r})"

    def status(self) -> DeletionJob:
        """The job now: state, scope, basis, deadline and per-store targets (ids and counts only)."""
        return self._platform.deletion_status(job_id=self.job_id)

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
        ledger = self._platform.ledger
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
                    self._platform.deletions.run_batch(tenant_id=self.tenant_id, job_ids=[self.job_id])
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
        return self._platform.deletion_proof(job_id=self.job_id)


def _blocked_targets(job: DeletionJob) -> str:
    failed = {name: status for name, status in (job.get("targets") or {}).items() if str(status).startswith("FAILED")}
    return ", ".join(f"{name}={status}" for name, status in sorted(failed.items())) or "see status()"


def _check_tenant(tenant_id: str) -> None:
    """Every door refuses malformed and reserved tenant ids (eval, eval-*, canary-*) alike."""
    validation.check_customer_tenant("tenant", tenant_id)


class _Parts:
    """The parts every group of methods works with, each opened on first use, and the lifecycle."""

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
        # tenant -> the change sequence its recall indexes were last synced at by this object.
        self._synced: dict[str, int] = {}
        self._closed = False

    def _open(self) -> None:
        if self._closed:
            raise ConflictError("platform", "is closed; open a new MemoryPlatform")

    @property
    def closed(self) -> bool:
        """Whether `close()` was called."""
        return self._closed

    @property
    def store(self) -> MemoryStore:
        """The versioned memory store (PostgreSQL)."""
        self._open()
        return self._store

    @property
    def derived(self) -> DerivedStores:
        """Every derived store (Chroma vectors, keyword index, summaries, analytics), opened on first use."""
        self._open()
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
        self._open()
        with self._lock:
            if self._backups is None:
                self._backups = open_backups(self.settings, self._store)
            return self._backups

    def _agent_runs(self) -> AgentRuns:
        """Agent runs on the derived stores: one gate (a connection per thread) for every run call."""
        derived = self.derived
        with self._lock:
            if self._runs is None:
                from memory_pipelines.lib.agent_runs.runs import AgentRuns

                self._runs = AgentRuns(derived)
            return self._runs

    def _analytics_store(self) -> AnalyticsStore:
        """The derived stores' analytics copy if they are open, else one of its own: a query needs
        neither Chroma nor the embedding model."""
        self._open()
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


class _Memories(_Parts):
    """Write, recall, version and export memories."""

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
    ) -> MemoryWrite:
        """Write a memory, or a new version of `memory_id`; identical re-writes are no-ops (`changed` False)."""
        _check_tenant(tenant_id)
        written = self.store.write(
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
        return written.as_dict()

    def write_many(self, *, tenant_id: str, items: Rows) -> builtins.list[MemoryWrite]:
        """Bulk-write new memories (`user_id`, `text`, optional fields); every item is checked first.

        Commits in chunks so a deletion never waits for the whole batch; one stopped part way raises
        `PartialWriteError` with `written` (what landed). Writing the same items again is safe.
        """
        _check_tenant(tenant_id)
        return [result.as_dict() for result in self.store.write_many(tenant_id=tenant_id, items=items)]

    def recall(
        self,
        *,
        tenant_id: str,
        user_id: str,
        query: str,
        team_id: str | None = None,
        k: int = 5,
        mode: str = "hybrid",
        sync: bool = True,
    ) -> builtins.list[RecallHit]:
        """Top-k memories visible to the user for `query` (semantic, keyword or hybrid); sees every write.

        With `sync` (the default) the tenant's recall indexes (vectors and keyword postings) are
        brought up to date first when the tenant changed since this object last synced them, so a
        write is found by the next recall. Measured on 2 busy cores, 1,000-memory tenant: unchanged,
        ~1 ms (one indexed query); after one write, ~0.3 s (listing the tenant's current versions,
        embedding only the new one); the first recall of a never-indexed tenant embeds everything
        (~14 s for 1,000 memories, as `materialize` would). Writes in a batch share one sync.
        `sync=False` reads the indexes as the Dagster assets last built them.
        """
        _check_tenant(tenant_id)
        if validation.check_bool("sync", sync):
            # Bad input is refused before any index work (the tenant id is checked above).
            validation.check_id("user", user_id)
            validation.check_optional_id("team", team_id)
            validation.check_text("query", query)
            validation.check_recall(k, mode)
            self._sync_recall_indexes(tenant_id)
        return self.derived.recaller.recall(
            tenant_id=tenant_id, user_id=user_id, team_id=team_id, query=query, k=k, mode=mode
        )

    def _sync_recall_indexes(self, tenant_id: str) -> None:
        from memory_pipelines.lib.stores.derived import sync_embeddings, sync_keywords

        derived = self.derived
        seq = self._store.change_seq(tenant_id=tenant_id)  # read first: a write during the sync is synced next time
        with self._lock:
            if self._synced.get(tenant_id) == seq:
                return
        sync_embeddings(derived.store, derived.vectors, tenant_id=tenant_id)
        sync_keywords(derived.store, tenant_id=tenant_id)
        with self._lock:
            self._synced[tenant_id] = seq

    def sync(self, *, tenant_id: str) -> SyncCounts:
        """Bring every derived store of the tenant up to date (what `materialize` does, without Dagster)."""
        _check_tenant(tenant_id)
        seq = self.store.change_seq(tenant_id=tenant_id)
        counts = self.derived.sync_all(tenant_id=tenant_id)
        with self._lock:
            self._synced[tenant_id] = seq
        return counts

    def list(self, *, tenant_id: str, user_id: str, team_id: str | None = None) -> builtins.list[VisibleMemory]:
        """Current memories visible to the user: the personal view, or the team view with `team_id`."""
        _check_tenant(tenant_id)
        return self.store.list_visible(tenant_id=tenant_id, user_id=user_id, team_id=team_id)

    def history(self, *, tenant_id: str, memory_id: str) -> builtins.list[MemoryVersion]:
        """Every version of a memory, oldest first."""
        _check_tenant(tenant_id)
        return self.store.history(tenant_id=tenant_id, memory_id=memory_id)

    def rollback(self, *, tenant_id: str, memory_id: str, user_id: str) -> RollBack:
        """Make the previous version current again, as a new version (only the author may)."""
        _check_tenant(tenant_id)
        return self.store.rollback(tenant_id=tenant_id, memory_id=memory_id, user_id=user_id)

    def export(self, *, tenant_id: str, subject: str) -> builtins.list[ExportedVersion]:
        """Every version of every memory the subject wrote, personal and team (GDPR Art. 15/20, CCPA)."""
        _check_tenant(tenant_id)
        return list(self.store.iter_export(tenant_id=tenant_id, subject=subject))

    def export_json(self, *, tenant_id: str, subject: str) -> Iterator[str]:
        """The subject's export as chunks of one JSON document, streamed (what `memory-pipelines export`
        prints): every version of every memory they wrote, then their subject summary (decrypted),
        consent (`do_not_sell`, summary mode), deletion jobs, and the agent runs that read their memories."""
        _check_tenant(tenant_id)
        return self.store.export_json(
            tenant_id=tenant_id, subject=subject, more=lambda: self._held_about(tenant_id, subject)
        )

    def _held_about(self, tenant_id: str, subject: str) -> dict[str, Any]:
        from memory_pipelines.lib.forget.about_subject import held_about
        from memory_pipelines.lib.infra.errors import NotFoundError

        try:
            summary: Summary | None = self.derived.summaries.read(
                tenant_id=tenant_id, scope="subject", scope_id=subject
            )
        except NotFoundError:
            summary = None
        with self.store.transaction() as conn:
            return {"summary": summary, **held_about(conn, tenant_id=tenant_id, subject=subject)}


class _Tenants(_Parts):
    """Tenants, their sharing modes and teams, and do-not-sell flags."""

    def tenants(self) -> list[TenantInfo]:
        """Every tenant with its sharing mode and counts (no text)."""
        return self.store.tenants()

    def require_tenant(self, *, tenant_id: str) -> str:
        """The tenant's sharing mode: NotFoundError for an unknown or deleted tenant, ConflictError
        while it is being restored (as every read and write of it)."""
        _check_tenant(tenant_id)
        return self.store.require_tenant(tenant_id=tenant_id)

    def create_tenant(self, *, tenant_id: str, sharing_mode: str = "strict") -> TenantMode:
        """Create a tenant (idempotent); an existing tenant keeps its data and gets `sharing_mode`."""
        _check_tenant(tenant_id)
        return self.store.create_tenant(tenant_id=tenant_id, sharing_mode=sharing_mode)

    def set_test_tenant(self, *, tenant_id: str, test: bool = True) -> TestTenant:
        """Mark a tenant as a test tenant (made if absent), or not: stores registered `onboarding`
        receive only test tenants' memories."""
        _check_tenant(tenant_id)
        if not test:
            from memory_pipelines.lib.stores import registry

            with self.store.transaction() as conn:
                held = registry.onboarding_records(conn, tenant_id)
            if held:
                store, n = next(iter(sorted(held.items())))
                raise ConflictError(
                    "tenant",
                    f"{tenant_id!r} still has {n} record(s) in the onboarding store {store!r}, which would then go"
                    " stale: keep it a test tenant until the store is enforced, or forget those memories first",
                )
        return self.store.set_test_tenant(tenant_id=tenant_id, test=test)

    def set_sharing_mode(self, *, tenant_id: str, sharing_mode: str) -> TenantMode:
        """Change an existing tenant's sharing mode: strict, shared_pool or progressive."""
        _check_tenant(tenant_id)
        return self.store.set_sharing_mode(tenant_id=tenant_id, sharing_mode=sharing_mode)

    def add_team_member(self, *, tenant_id: str, team_id: str, user_id: str) -> TeamMemberAdded:
        """Add a user to a team, creating tenant and team if needed (idempotent)."""
        _check_tenant(tenant_id)
        return self.store.add_team_member(tenant_id=tenant_id, team_id=team_id, user_id=user_id)

    def remove_team_member(self, *, tenant_id: str, team_id: str, user_id: str) -> TeamMemberRemoved:
        """Remove a user from a team; the memories they wrote for it stay with the team."""
        _check_tenant(tenant_id)
        return self.store.remove_team_member(tenant_id=tenant_id, team_id=team_id, user_id=user_id)

    def set_do_not_sell(
        self,
        *,
        tenant_id: str,
        user_id: str,
        memory_id: str | None = None,
        subject: str | None = None,
        value: bool = True,
    ) -> DoNotSell:
        """CCPA opt-out (`value` False clears it) for one memory (its author acts) or for every memory
        of a subject, present and future (the subject acts: `subject` == `user_id`)."""
        _check_tenant(tenant_id)
        return self.store.set_do_not_sell(
            tenant_id=tenant_id, user_id=user_id, value=value, memory_id=memory_id, subject=subject
        )


class _DerivedViews(_Parts):
    """What the derived stores answer: lineage, summaries, analytics."""

    def lineage(
        self, *, tenant_id: str, memory_id: str | None = None, record: str | None = None
    ) -> list[LineageRecord] | RecordSources:
        """Derived records of every version of `memory_id` (a list), or the sources of a derived
        `record` (STORE:ID)."""
        _check_tenant(tenant_id)
        if (memory_id is None) == (record is None):
            raise ValidationError("memory_id", "give exactly one of memory_id or record")
        if memory_id is not None:
            return self.derived.lineage_of_memory(tenant_id=tenant_id, memory_id=memory_id)
        assert record is not None
        return self.derived.sources_of_record(tenant_id=tenant_id, record=record)

    def lineage_picture(self, *, tenant_id: str, memory_id: str, fmt: str = "png") -> bytes:
        """A picture (png or svg) of one memory's lineage: its versions, each derived record, an edge per link."""
        from memory_pipelines.lib.forget.certificate import lineage_graph

        records = self.lineage(tenant_id=tenant_id, memory_id=memory_id)
        assert isinstance(records, list)  # a memory_id's lineage: always the list
        return lineage_graph(records, title=f"lineage of {memory_id}", fmt=fmt)

    def summary(self, *, tenant_id: str, subject: str | None = None, team_id: str | None = None) -> Summary:
        """A subject's summary, or else a team's (`team_id`), decrypted, with its sources."""
        _check_tenant(tenant_id)
        if subject is not None and team_id is not None:
            raise ValidationError("subject", "give exactly one of subject or team_id")
        summaries = self.derived.summaries
        if subject is not None:
            return summaries.read(tenant_id=tenant_id, scope="subject", scope_id=subject)
        # Kept: with neither subject nor team_id, None goes on to `read`, whose check of the id refuses it
        # (ValidationError naming team), as before; only the type checker is told it is a str.
        return summaries.read(tenant_id=tenant_id, scope="team", scope_id=cast(str, team_id))

    def set_summary_mode(self, *, tenant_id: str, subject: str, mode: str) -> SummaryMode:
        """How the subject's summary is made: full, summary or hybrid."""
        _check_tenant(tenant_id)
        return self.derived.summaries.set_mode(tenant_id=tenant_id, subject=subject, mode=mode)

    def analytics(self, *, tenant_id: str, sql: str) -> AnalyticsAnswer:
        """One SELECT over the tenant's analytics rows (the table `memories`), in a locked-down DuckDB.

        Only this tenant's rows, less those an accepted deletion hides; an unknown, deleted or
        restoring tenant is refused as by every read."""
        _check_tenant(tenant_id)
        return self._analytics_store().query(sql, tenant_id=tenant_id)


class _Forgetting(_Parts):
    """Deletion requests, jobs, proofs and certificates, crypto-shredding, retention sweeps."""

    def forget(
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
    ) -> DeletionHandle:
        """Request deletion of a subject, a memory (one `version`) or the whole tenant; hidden at once.

        Exactly one of `subject`, `memory_id`, `all_tenant` (with `confirm` repeating the tenant id).
        Returns a handle: `wait()` runs the cascade, `proof()` proves it. The same open request
        again returns the first one's job (`duplicate` True).
        """
        job = self.request_deletion(
            tenant_id=tenant_id,
            subject=subject,
            memory_id=memory_id,
            version=version,
            all_tenant=all_tenant,
            confirm=confirm,
            basis=basis,
            requested_by=requested_by,
        )
        # Kept: this mixin is only ever part of a MemoryPlatform (the class below), what a handle holds.
        return DeletionHandle(cast(MemoryPlatform, self), job)

    def request_deletion(
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
    ) -> DeletionRequest:
        """`forget`'s request, answered with the job itself (`duplicate` True for an open job of that scope)."""
        _check_tenant(tenant_id)
        return self.deletions.request(
            tenant_id=tenant_id,
            subject=subject,
            memory_id=memory_id,
            version=version,
            all_tenant=all_tenant,
            confirm=confirm,
            basis=basis,
            requested_by=requested_by,
        )

    def deletion(self, *, job_id: str) -> DeletionHandle:
        """A handle on an existing deletion job (from `forget`, the CLI or a Dagster run)."""
        # Kept: this mixin is only ever part of a MemoryPlatform (see `forget`).
        return DeletionHandle(cast(MemoryPlatform, self), self.deletion_status(job_id=job_id))

    def deletion_status(self, *, job_id: str) -> DeletionJob:
        """A job's state, scope, basis, deadline and per-store targets (control plane only)."""
        return self.ledger.status(job_id=job_id)

    def deletion_proof(self, *, job_id: str) -> DeletionProof:
        """A COMPLETE job's proof (ids, HMACs and counts, never text); NotFoundError before."""
        return self.ledger.proof(job_id=job_id)

    def deletion_certificate(self, *, job_id: str, fmt: str = "md") -> str:
        """A COMPLETE job's deletion certificate for a privacy officer, as Markdown (md) or HTML (html)."""
        from memory_pipelines.lib.forget.certificate import render

        ledger = self.ledger
        proof = ledger.proof(job_id=job_id)
        return render(proof, ledger.status(job_id=job_id), fmt)

    def deletion_jobs(self, *, state: str | None = None, tenant_id: str | None = None) -> list[DeletionJob]:
        """Every deletion job, oldest first; only those in `state`, or of `tenant_id`, when given."""
        if tenant_id is not None:
            _check_tenant(tenant_id)
        return self.ledger.list_jobs(state=state, tenant_id=tenant_id)

    def notifications(self, *, job_id: str | None = None, limit: int = 50) -> list[Notification]:
        """The newest deletion notices (or one job's), each with every channel's delivery state."""
        from memory_pipelines.lib.notify.outbox import notifications

        if not 1 <= limit <= 10_000:
            raise ValidationError("limit", "must be from 1 to 10000")
        return cast(list[Notification], notifications(self.store, job_id=job_id, limit=limit))

    def deliver_notifications(self) -> NotificationsDelivered:
        """Send the due deletion notices now on the channels the environment configures (what the
        `notify` job does); none configured: nothing is sent and `channels` is empty."""
        import os

        from memory_pipelines.lib.notify.channels import channels_of
        from memory_pipelines.lib.notify.config import NotifySettings
        from memory_pipelines.lib.notify.outbox import deliver

        settings = NotifySettings.from_env(os.environ)
        found = deliver(db=self.store, channels=channels_of(settings), events=settings.events)
        return cast(NotificationsDelivered, found)

    def shred_keys(self, *, tenant_id: str, subject: str | None = None, confirm: str | None = None) -> KeysShredded:
        """Crypto-shred now: destroy the subject's key, or every key of the tenant (`confirm` repeats
        the tenant id). Its data becomes unreadable at once, in every backup too; the forget job of
        the same scope is requested (hidden at once)."""
        _check_tenant(tenant_id)
        return self.deletions.shred_keys(tenant_id=tenant_id, subject=subject, confirm=confirm)

    def convert_keys(self, *, tenant_id: str | None = None) -> list[KeysConverted]:
        """Seal texts written before version keys (an older release's) under keys of their own, tenant
        by tenant (`tenant_id`: that tenant only); every read works throughout. Returns counts per
        tenant converted: versions re-sealed, MACs recomputed, subject keys retired."""
        from memory_pipelines.lib.memories.key_conversion import KeyConversion
        from memory_pipelines.lib.stores.derived import convert_keys

        if tenant_id is not None:
            _check_tenant(tenant_id)
        store = self.store
        todo = KeyConversion(store.transaction, store.keys, backup_days=self.settings.backup_days).pending(
            tenant_id=tenant_id
        )
        return [convert_keys(store, tenant_id=tenant, backup_days=self.settings.backup_days) for tenant in todo]

    def retention_preview(self, *, day: str | date) -> RetentionPreview:
        """What a retention sweep of `day` (YYYY-MM-DD, a future day too) would remove: counts only."""
        from memory_pipelines.lib.retention import rules

        return rules.preview(self.store, day=day)

    def sweep_retention(self, *, day: str | date, tenant_id: str | None = None, run: bool = True) -> RetentionSweep:
        """Request the removal of what day `day`'s retention ended (a day that has ended, UTC), one
        RETENTION job per tenant (`tenant_id`: that tenant only); with `run` carry it out now, in
        this process, else the jobs wait for the forget sensor."""
        from memory_pipelines.lib.retention import rules

        if tenant_id is not None:
            _check_tenant(tenant_id)
        return rules.sweep(self.deletions, day=day, tenant_id=tenant_id, run=run)


class _Switches(_Parts):
    """Incident switches: deletion work paused and resumed, a store's adapter version pinned. None
    re-opens a COMPLETE deletion."""

    def pause_deletions(self, *, tenant_id: str | None = None, reason: str) -> DeletionPause:
        """Pause deletion work of the tenant (None: of every tenant): requests are still accepted and
        hidden at once; no cascade or erasure starts until `resume_deletions`. Deadlines keep running."""
        from memory_pipelines.lib.forget import switches

        if tenant_id is not None:
            _check_tenant(tenant_id)
        with self.store.transaction() as conn:
            return cast(DeletionPause, switches.pause(conn, tenant_id=tenant_id, reason=reason))

    def resume_deletions(self, *, tenant_id: str | None = None) -> DeletionPause:
        """End the pause of exactly that scope (the tenant's, or with None every tenant's); NotFoundError
        when none is open. The waiting jobs run at the forget sensor's next tick (or `deletion retry`)."""
        from memory_pipelines.lib.forget import switches

        if tenant_id is not None:
            _check_tenant(tenant_id)
        with self.store.transaction() as conn:
            return cast(DeletionPause, switches.resume(conn, tenant_id=tenant_id))

    def deletion_pauses(self, *, tenant_id: str | None = None) -> list[DeletionPause]:
        """Every pause (the tenant's and every tenant's, when a tenant is given), newest first."""
        from memory_pipelines.lib.forget import switches

        if tenant_id is not None:
            _check_tenant(tenant_id)
        with self.store.transaction() as conn:
            return cast(list[DeletionPause], switches.pauses(conn, tenant_id=tenant_id))

    def pin_adapter(self, *, store: str, version: str, reason: str) -> AdapterPin:
        """Make later cascades run `version` of the store's deletion adapter (one the store ships);
        every proof records the versions its cascade ran."""
        from memory_pipelines.lib.forget import switches

        with self.store.transaction() as conn:
            return cast(AdapterPin, switches.pin(conn, store=store, version=version, reason=reason))

    def unpin_adapter(self, *, store: str) -> AdapterPin:
        """Later cascades run the store's default adapter version again."""
        from memory_pipelines.lib.forget import switches

        with self.store.transaction() as conn:
            return cast(AdapterPin, switches.unpin(conn, store=store))

    def adapters(self) -> list[StoreAdapter]:
        """Every registered store: the adapter version cascades run now, its default, what it ships, the pin."""
        from memory_pipelines.lib.forget import switches

        with self.store.transaction() as conn:
            found = switches.adapter_versions(conn)
        return [cast(StoreAdapter, {"store": name, **entry}) for name, entry in found.items()]


class _Backups(_Parts):
    """Encrypted backups and safe restores."""

    def backup(self, *, tenant_id: str) -> BackupTaken:
        """Back the tenant up now, encrypted; returns the manifest (backup_id, counts, expiry; no text)."""
        _check_tenant(tenant_id)
        return self.backups.backup(tenant_id=tenant_id)

    def restore(self, *, tenant_id: str, backup_id: str) -> RestoreReport:
        """Restore the tenant from a backup: journal replayed so forgotten data stays forgotten, verified.

        Returns the report; `state` is COMPLETE, or BLOCKED when verification failed (the tenant's
        rows are as before and it stays closed until a later restore succeeds). Recall rebuilds its
        indexes from the restored memories on its next call.
        """
        _check_tenant(tenant_id)
        return self.backups.restore(tenant_id=tenant_id, backup_id=backup_id)

    def list_backups(self, *, tenant_id: str) -> list[BackupListing]:
        """The tenant's backups, oldest first, in flight and failed ones included (ids and counts only)."""
        _check_tenant(tenant_id)
        return self.backups.list_backups(tenant_id=tenant_id)

    def sweep_backups(self) -> BackupsExpired:
        """Delete every tenant's backups past their expiry (S3's lifecycle rule does the same there)."""
        return self.backups.sweep_expired()

    def request_restore(self, *, tenant_id: str, backup_id: str, restore_id: str | None = None) -> RestoreRequest:
        """Record a restore for the restore sensor to run; the backup and `restore_id` are checked now."""
        _check_tenant(tenant_id)
        return self.backups.request_restore(tenant_id=tenant_id, backup_id=backup_id, restore_id=restore_id)

    def check_restore(self, *, tenant_id: str, backup_id: str, restore_id: str | None = None) -> None:
        """Refuse a restore before it is launched elsewhere (a Dagster run): the backup must be the
        tenant's, stored and not expired, and `restore_id` (when given) free or this restore's own."""
        _check_tenant(tenant_id)
        backups = self.backups
        backups.find_backup(tenant_id=tenant_id, backup_id=backup_id)
        if restore_id is not None:
            backups.check_restore_id(tenant_id=tenant_id, backup_id=backup_id, restore_id=restore_id)

    def reopen_tenant(self, *, tenant_id: str) -> TenantReopened:
        """Open a tenant a BLOCKED restore left closed; its rows are those before that restore."""
        _check_tenant(tenant_id)
        return self.backups.reopen(tenant_id=tenant_id)


class _Runs(_Parts):
    """The agent-run fence: leases, recall inside them, permits, prompt snapshots, `explain`."""

    def open_run(self, *, tenant_id: str, subject_id: str, run_id: str, ttl_seconds: int = 300) -> RunLease:
        """Open an agent run's lease for the subject it acts for; `ttl_seconds` its lifetime."""
        _check_tenant(tenant_id)
        lease = self._agent_runs().open(
            tenant_id=tenant_id, subject_id=subject_id, run_id=run_id, ttl_seconds=ttl_seconds
        )
        return {"lease_id": lease, "run_id": run_id, "tenant_id": tenant_id, "subject_id": subject_id}

    def run_recall(
        self, *, lease_id: str, query: str, team_id: str | None = None, k: int = 5, mode: str = "hybrid"
    ) -> list[RecallHit]:
        """Recall for the run's subject inside its lease: every hit is fenced on the lease."""
        return self._agent_runs().recall(lease_id=lease_id, query=query, team_id=team_id, k=k, mode=mode)

    def permit(
        self, *, lease_id: str, sink: str, on_cancel: Iterable[Callable[[], None]] = ()
    ) -> AbstractContextManager[Permit]:
        """`with mp.permit(lease_id=..., sink=...) as p:` a sink boundary (model_output, tool_dispatch,
        state_write, memory_write, queued_work); call `p.check()` between units. Refused once a
        deletion closed a fence of the run; released when the block ends, cancelled on an error."""
        return self._agent_runs().gate.permit(lease_id=lease_id, sink=sink, on_cancel=on_cancel)

    def revoke_lease(self, *, lease_id: str) -> LeaseRevoked:
        """Operator action for a crashed run: cancel its in-flight permits and close its lease."""
        return self._agent_runs().gate.revoke(lease_id=lease_id)

    def snapshot_prompt(
        self, *, lease_id: str, prompt: str, sources: Iterable[tuple[str, int]] | None = None
    ) -> PromptSnapshot:
        """Store the prompt the run sent, sealed, with lineage to the memory versions in it
        (default: everything the lease read); forgetting any of them removes it."""
        return self._agent_runs().snapshot_prompt(lease_id=lease_id, prompt=prompt, sources=sources)

    def explain(self, *, tenant_id: str, run_id: str) -> RunExplanation:
        """The recall chain of an agent run: memories it read (text while present) and derived records."""
        _check_tenant(tenant_id)
        return self._agent_runs().explain(tenant_id=tenant_id, run_id=run_id)


class _Checks(_Parts):
    """The platform checking itself: memory quality over time, the deletion canary drill."""

    def evaluation_trend(self, *, mode: str = "hybrid") -> EvaluationTrend:
        """Month by month precision, recall (of recall `mode`) and drift of the evaluation tenant,
        with the Markdown table; `months` is empty before any `eval run`. `at_k`: every mode's
        precision and recall at K = 1, 5 and 10 in the evaluation computed last (empty before one)."""
        from memory_pipelines.lib.evaluation import evaluator

        evaluator.check_mode(mode)
        eval_set = evaluator.load_eval_set()
        rows = evaluator.trend(self.store, tenant_id=eval_set.tenant, mode=mode)
        at_k = evaluator.latest_at_k(self.store, tenant_id=eval_set.tenant)
        return {
            "tenant": eval_set.tenant,
            "mode": mode,
            "k": eval_set.k,
            "months": rows,
            "markdown": evaluator.trend_markdown(rows),
            "at_k": at_k,
            "at_k_markdown": evaluator.at_k_markdown(at_k) if at_k else "",
        }

    def canary_drill(self) -> CanaryDrill:
        """The end-to-end deletion drill in a tenant of its own (written, backed up, forgotten, erased,
        restored, offboarded); `passed` only when nothing of the canaries is left anywhere."""
        from memory_pipelines.lib.forget.canary import run_canary_drill

        derived, backups = self.derived, self.backups
        home = None if self.settings.pg_url else self.settings.home
        return run_canary_drill(derived, home=home, backups=backups)


class MemoryPlatform(_Memories, _Tenants, _DerivedViews, _Forgetting, _Switches, _Backups, _Runs, _Checks):
    """Write, recall, version, export, forget, back up and explain memories: one object for all of it.

    `MemoryPlatform.from_env()` reads the settings from the environment (MEMORY_PIPELINES_HOME and
    the rest) and starts or reuses the embedded PostgreSQL and Chroma of that HOME. The
    constructor takes the parts, for tests and for callers that built them. Methods take keyword
    arguments only. Use it as a context manager, or call `close()`; the services keep running for
    the next process (`memory-pipelines stop` stops them).
    """

    @classmethod
    def from_env(cls) -> MemoryPlatform:
        """A platform on the settings of the environment; starts or reuses the embedded services."""
        settings = Settings.from_env()
        endpoints = services.ensure_services(settings)
        return cls(settings=settings, store=open_store(settings, endpoints), endpoints=endpoints)

    def __enter__(self) -> MemoryPlatform:
        self._open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemoryPlatform(home={str(self.settings.home)!r}{', closed' if self._closed else ''})"
