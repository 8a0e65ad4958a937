"""`Forgetting`: deletion requests, jobs, proofs and certificates, crypto-shredding, retention sweeps."""

from __future__ import annotations

from datetime import date
from typing import cast

from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.lib.results import (
    DeletionJob,
    DeletionProof,
    DeletionRequest,
    KeysConverted,
    KeysShredded,
    Notification,
    NotificationsDelivered,
    RetentionPreview,
    RetentionSweep,
)
from memory_pipelines.platform.handle import DeletionHandle
from memory_pipelines.platform.parts import PlatformParts, check_tenant

__all__ = ["Forgetting"]


class Forgetting:
    """Deletion requests, jobs, proofs and certificates, crypto-shredding, retention sweeps."""

    def __init__(self, parts: PlatformParts) -> None:
        self.parts = parts

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
        return DeletionHandle(self.parts, job)

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
        check_tenant(tenant_id)
        return self.parts.deletions.request(
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
        return DeletionHandle(self.parts, self.deletion_status(job_id=job_id))

    def deletion_status(self, *, job_id: str) -> DeletionJob:
        """A job's state, scope, basis, deadline and per-store targets (control plane only)."""
        return self.parts.ledger.status(job_id=job_id)

    def deletion_proof(self, *, job_id: str) -> DeletionProof:
        """A COMPLETE job's proof (ids, HMACs and counts, never text); NotFoundError before."""
        return self.parts.ledger.proof(job_id=job_id)

    def deletion_certificate(self, *, job_id: str, fmt: str = "md") -> str:
        """A COMPLETE job's deletion certificate for a privacy officer, as Markdown (md) or HTML (html)."""
        from memory_pipelines.lib.forget.certificate import render

        ledger = self.parts.ledger
        proof = ledger.proof(job_id=job_id)
        return render(proof, ledger.status(job_id=job_id), fmt)

    def deletion_jobs(self, *, state: str | None = None, tenant_id: str | None = None) -> list[DeletionJob]:
        """Every deletion job, oldest first; only those in `state`, or of `tenant_id`, when given."""
        if tenant_id is not None:
            check_tenant(tenant_id)
        return self.parts.ledger.list_jobs(state=state, tenant_id=tenant_id)

    def notifications(self, *, job_id: str | None = None, limit: int = 50) -> list[Notification]:
        """The newest deletion notices (or one job's), each with every channel's delivery state."""
        from memory_pipelines.lib.notify.outbox import notifications

        if not 1 <= limit <= 10_000:
            raise ValidationError("limit", "must be from 1 to 10000")
        return cast(list[Notification], notifications(self.parts.store, job_id=job_id, limit=limit))

    def deliver_notifications(self) -> NotificationsDelivered:
        """Send the due deletion notices now on the channels the environment configures (what the
        `notify` job does); none configured: nothing is sent and `channels` is empty."""
        import os

        from memory_pipelines.lib.notify.channels import channels_of
        from memory_pipelines.lib.notify.config import NotifySettings
        from memory_pipelines.lib.notify.outbox import deliver

        settings = NotifySettings.from_env(os.environ)
        found = deliver(db=self.parts.store, channels=channels_of(settings), events=settings.events)
        return cast(NotificationsDelivered, found)

    def shred_keys(self, *, tenant_id: str, subject: str | None = None, confirm: str | None = None) -> KeysShredded:
        """Crypto-shred now: destroy the subject's key, or every key of the tenant (`confirm` repeats
        the tenant id). Its data becomes unreadable at once, in every backup too; the forget job of
        the same scope is requested (hidden at once)."""
        check_tenant(tenant_id)
        return self.parts.deletions.shred_keys(tenant_id=tenant_id, subject=subject, confirm=confirm)

    def convert_keys(self, *, tenant_id: str | None = None) -> list[KeysConverted]:
        """Seal texts written before version keys (an older release's) under keys of their own, tenant
        by tenant (`tenant_id`: that tenant only); every read works throughout. Returns counts per
        tenant converted: versions re-sealed, MACs recomputed, subject keys retired."""
        from memory_pipelines.lib.memories.key_conversion import KeyConversion
        from memory_pipelines.lib.stores.derived import convert_keys

        if tenant_id is not None:
            check_tenant(tenant_id)
        store = self.parts.store
        todo = KeyConversion(store.transaction, store.keys, backup_days=self.parts.settings.backup_days).pending(
            tenant_id=tenant_id
        )
        return [convert_keys(store, tenant_id=tenant, backup_days=self.parts.settings.backup_days) for tenant in todo]

    def retention_preview(self, *, day: str | date) -> RetentionPreview:
        """What a retention sweep of `day` (YYYY-MM-DD, a future day too) would remove: counts only."""
        from memory_pipelines.lib.retention import rules

        return rules.preview(self.parts.store, day=day)

    def sweep_retention(self, *, day: str | date, tenant_id: str | None = None, run: bool = True) -> RetentionSweep:
        """Request the removal of what day `day`'s retention ended (a day that has ended, UTC), one
        RETENTION job per tenant (`tenant_id`: that tenant only); with `run` carry it out now, in
        this process, else the jobs wait for the forget sensor."""
        from memory_pipelines.lib.retention import rules

        if tenant_id is not None:
            check_tenant(tenant_id)
        return rules.sweep(self.parts.deletions, day=day, tenant_id=tenant_id, run=run)
