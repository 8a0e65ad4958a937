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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from memory_pipelines.lib.infra import services, validation
from memory_pipelines.lib.infra.errors import ConflictError, MemoryPipelinesError, ValidationError
from memory_pipelines.lib.infra.runtime import open_backups, open_store
from memory_pipelines.lib.infra.services import Endpoints
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories.store import MemoryStore

if TYPE_CHECKING:
    from memory_pipelines.lib.backups.service import BackupService
    from memory_pipelines.lib.forget.deletion import DeletionLedger, DeletionService
    from memory_pipelines.lib.stores.derived import DerivedStores

# `list` is a method name here: annotations use these aliases.
Row = dict[str, Any]
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

    def __init__(self, platform: MemoryPlatform, job: Row) -> None:
        self._platform = platform
        self.job_id: str = job["job_id"]
        self.tenant_id: str = job["tenant_id"]
        self.duplicate: bool = bool(job.get("duplicate", False))

    def __repr__(self) -> str:
        return f"DeletionHandle(job_id={self.job_id!r}, tenant_id={self.tenant_id!r})"

    def status(self) -> Row:
        """The job now: state, scope, basis, deadline and per-store targets (ids and counts only)."""
        return self._platform.ledger.status(job_id=self.job_id)

    def wait(self, *, timeout: float = DEFAULT_WAIT_SECONDS) -> Row:
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

    def proof(self) -> Row:
        """The job's proof once COMPLETE (ids, HMACs and counts, never text); NotFoundError before."""
        return self._platform.ledger.proof(job_id=self.job_id)


def _blocked_targets(job: Row) -> str:
    failed = {name: status for name, status in (job.get("targets") or {}).items() if str(status).startswith("FAILED")}
    return ", ".join(f"{name}={status}" for name, status in sorted(failed.items())) or "see status()"


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
        self.settings = settings
        self._store = store
        self._endpoints = endpoints
        self._derived = derived
        self._backups = backups
        self._deletions = deletions
        self._lock = threading.Lock()
        # tenant -> the change sequence its recall indexes were last synced at by this object.
        self._synced: dict[str, int] = {}
        self._closed = False

    @classmethod
    def from_env(cls) -> MemoryPlatform:
        """A platform on the settings of the environment; starts or reuses the embedded services."""
        settings = Settings.from_env()
        endpoints = services.ensure_services(settings)
        return cls(settings=settings, store=open_store(settings, endpoints), endpoints=endpoints)

    # -- parts -----------------------------------------------------------------------------------

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

    # -- memories --------------------------------------------------------------------------------

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
    ) -> Row:
        """Write a memory, or a new version of `memory_id`; identical re-writes are no-ops (`changed` False)."""
        validation.check_customer_tenant("tenant", tenant_id)
        return self.store.write(
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
        ).as_dict()

    def write_many(self, *, tenant_id: str, items: Rows) -> Rows:
        """Bulk-write new memories (`user_id`, `text`, optional fields); every item is checked first.

        Commits in chunks so a deletion never waits for the whole batch; one stopped part way raises
        `PartialWriteError` with `written` (what landed). Writing the same items again is safe.
        """
        validation.check_customer_tenant("tenant", tenant_id)
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
    ) -> Rows:
        """Top-k memories visible to the user for `query` (semantic, keyword or hybrid); sees every write.

        With `sync` (the default) the tenant's recall indexes (vectors and keyword postings) are
        brought up to date first when the tenant changed since this object last synced them, so a
        write is found by the next recall. Measured on 2 busy cores, 1,000-memory tenant: unchanged,
        ~1 ms (one indexed query); after one write, ~0.3 s (listing the tenant's current versions,
        embedding only the new one); the first recall of a never-indexed tenant embeds everything
        (~14 s for 1,000 memories, as `materialize` would). Writes in a batch share one sync.
        `sync=False` reads the indexes as the Dagster assets last built them.
        """
        validation.check_customer_tenant("tenant", tenant_id)
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

    def sync(self, *, tenant_id: str) -> dict[str, dict[str, int]]:
        """Bring every derived store of the tenant up to date (what `materialize` does, without Dagster)."""
        validation.check_customer_tenant("tenant", tenant_id)
        seq = self.store.change_seq(tenant_id=tenant_id)
        counts = self.derived.sync_all(tenant_id=tenant_id)
        with self._lock:
            self._synced[tenant_id] = seq
        return counts

    def list(self, *, tenant_id: str, user_id: str, team_id: str | None = None) -> Rows:
        """Current memories visible to the user: the personal view, or the team view with `team_id`."""
        validation.check_customer_tenant("tenant", tenant_id)
        return self.store.list_visible(tenant_id=tenant_id, user_id=user_id, team_id=team_id)

    def history(self, *, tenant_id: str, memory_id: str) -> Rows:
        """Every version of a memory, oldest first."""
        validation.check_customer_tenant("tenant", tenant_id)
        return self.store.history(tenant_id=tenant_id, memory_id=memory_id)

    def rollback(self, *, tenant_id: str, memory_id: str, user_id: str) -> Row:
        """Make the previous version current again, as a new version (only the author may)."""
        validation.check_customer_tenant("tenant", tenant_id)
        return self.store.rollback(tenant_id=tenant_id, memory_id=memory_id, user_id=user_id)

    def export(self, *, tenant_id: str, subject: str) -> Rows:
        """Every version of every memory the subject wrote, personal and team (GDPR Art. 15/20, CCPA)."""
        validation.check_customer_tenant("tenant", tenant_id)
        return list(self.store.iter_export(tenant_id=tenant_id, subject=subject))

    def export_json(self, *, tenant_id: str, subject: str) -> Iterator[str]:
        """The subject's export as chunks of one JSON document, streamed (what `memory-pipelines export` prints)."""
        validation.check_customer_tenant("tenant", tenant_id)
        return self.store.export_json(tenant_id=tenant_id, subject=subject)

    # -- forgetting --------------------------------------------------------------------------------

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
        validation.check_customer_tenant("tenant", tenant_id)
        job = self.deletions.request(
            tenant_id=tenant_id,
            subject=subject,
            memory_id=memory_id,
            version=version,
            all_tenant=all_tenant,
            confirm=confirm,
            basis=basis,
            requested_by=requested_by,
        )
        return DeletionHandle(self, job)

    def deletion(self, *, job_id: str) -> DeletionHandle:
        """A handle on an existing deletion job (from `forget`, the CLI or a Dagster run)."""
        return DeletionHandle(self, self.ledger.status(job_id=job_id))

    # -- backups -----------------------------------------------------------------------------------

    def backup(self, *, tenant_id: str) -> Row:
        """Back the tenant up now, encrypted; returns the manifest (backup_id, counts, expiry; no text)."""
        validation.check_customer_tenant("tenant", tenant_id)
        return self.backups.backup(tenant_id=tenant_id)

    def restore(self, *, tenant_id: str, backup_id: str) -> Row:
        """Restore the tenant from a backup: journal replayed so forgotten data stays forgotten, verified.

        Returns the report; `state` is COMPLETE, or BLOCKED when verification failed (the tenant's
        rows are as before and it stays closed until a later restore succeeds). Recall rebuilds its
        indexes from the restored memories on its next call.
        """
        validation.check_customer_tenant("tenant", tenant_id)
        return self.backups.restore(tenant_id=tenant_id, backup_id=backup_id)

    # -- lineage and explain -----------------------------------------------------------------------

    def lineage(self, *, tenant_id: str, memory_id: str | None = None, record: str | None = None) -> Any:
        """Derived records of every version of `memory_id`, or the sources of a derived `record` (STORE:ID)."""
        validation.check_customer_tenant("tenant", tenant_id)
        if (memory_id is None) == (record is None):
            raise ValidationError("memory_id", "give exactly one of memory_id or record")
        if memory_id is not None:
            return self.derived.lineage_of_memory(tenant_id=tenant_id, memory_id=memory_id)
        assert record is not None
        return self.derived.sources_of_record(tenant_id=tenant_id, record=record)

    def explain(self, *, tenant_id: str, run_id: str) -> Row:
        """The recall chain of an agent run: memories it read (text while present) and derived records."""
        validation.check_customer_tenant("tenant", tenant_id)
        from memory_pipelines.lib.agent_runs.runs import AgentRuns

        return AgentRuns(self.derived).explain(tenant_id=tenant_id, run_id=run_id)

    # -- lifecycle ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the connections this object holds; idempotent. Later calls raise ConflictError."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._store.close()

    def __enter__(self) -> MemoryPlatform:
        self._open()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"MemoryPlatform(home={str(self.settings.home)!r}{', closed' if self._closed else ''})"
