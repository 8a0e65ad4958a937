"""`Switches`: incident switches: deletion work paused and resumed, a store's adapter version pinned."""

from __future__ import annotations

from typing import cast

from memory_pipelines.lib.results import AdapterPin, DeletionPause, StoreAdapter
from memory_pipelines.platform.parts import PlatformParts, check_tenant

__all__ = ["Switches"]


class Switches:
    """Incident switches: deletion work paused and resumed, a store's adapter version pinned. None
    re-opens a COMPLETE deletion."""

    def __init__(self, parts: PlatformParts) -> None:
        self.parts = parts

    def pause_deletions(self, *, tenant_id: str | None = None, reason: str) -> DeletionPause:
        """Pause deletion work of the tenant (None: of every tenant): requests are still accepted and
        hidden at once; no cascade or erasure starts until `resume_deletions`. Deadlines keep running."""
        from memory_pipelines.lib.forget import switches

        if tenant_id is not None:
            check_tenant(tenant_id)
        with self.parts.store.transaction() as conn:
            return cast(DeletionPause, switches.pause(conn, tenant_id=tenant_id, reason=reason))

    def resume_deletions(self, *, tenant_id: str | None = None) -> DeletionPause:
        """End the pause of exactly that scope (the tenant's, or with None every tenant's); NotFoundError
        when none is open. The waiting jobs run at the forget sensor's next tick (or `deletion retry`)."""
        from memory_pipelines.lib.forget import switches

        if tenant_id is not None:
            check_tenant(tenant_id)
        with self.parts.store.transaction() as conn:
            return cast(DeletionPause, switches.resume(conn, tenant_id=tenant_id))

    def deletion_pauses(self, *, tenant_id: str | None = None) -> list[DeletionPause]:
        """Every pause (the tenant's and every tenant's, when a tenant is given), newest first."""
        from memory_pipelines.lib.forget import switches

        if tenant_id is not None:
            check_tenant(tenant_id)
        with self.parts.store.transaction() as conn:
            return cast(list[DeletionPause], switches.pauses(conn, tenant_id=tenant_id))

    def pin_adapter(self, *, store: str, version: str, reason: str) -> AdapterPin:
        """Make later cascades run `version` of the store's deletion adapter (one the store ships);
        every proof records the versions its cascade ran."""
        from memory_pipelines.lib.forget import switches

        with self.parts.store.transaction() as conn:
            return cast(AdapterPin, switches.pin(conn, store=store, version=version, reason=reason))

    def unpin_adapter(self, *, store: str) -> AdapterPin:
        """Later cascades run the store's default adapter version again."""
        from memory_pipelines.lib.forget import switches

        with self.parts.store.transaction() as conn:
            return cast(AdapterPin, switches.unpin(conn, store=store))

    def adapters(self) -> list[StoreAdapter]:
        """Every registered store: the adapter version cascades run now, its default, what it ships, the pin."""
        from memory_pipelines.lib.forget import switches

        with self.parts.store.transaction() as conn:
            found = switches.adapter_versions(conn)
        return [cast(StoreAdapter, {"store": name, **entry}) for name, entry in found.items()]
