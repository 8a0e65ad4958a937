"""`Tenants`: tenants, their sharing modes and teams, and do-not-sell flags."""

from __future__ import annotations

from memory_pipelines.lib.infra.errors import ConflictError
from memory_pipelines.lib.results import (
    DoNotSell,
    TeamMemberAdded,
    TeamMemberRemoved,
    TenantInfo,
    TenantMode,
    TestTenant,
)
from memory_pipelines.platform.parts import PlatformParts, check_tenant

__all__ = ["Tenants"]


class Tenants:
    """Tenants, their sharing modes and teams, and do-not-sell flags."""

    def __init__(self, parts: PlatformParts) -> None:
        self.parts = parts

    def tenants(self) -> list[TenantInfo]:
        """Every tenant with its sharing mode and counts (no text)."""
        return self.parts.store.tenants()

    def require_tenant(self, *, tenant_id: str) -> str:
        """The tenant's sharing mode: NotFoundError for an unknown or deleted tenant, ConflictError
        while it is being restored (as every read and write of it)."""
        check_tenant(tenant_id)
        return self.parts.store.require_tenant(tenant_id=tenant_id)

    def create_tenant(self, *, tenant_id: str, sharing_mode: str = "strict") -> TenantMode:
        """Create a tenant (idempotent); an existing tenant keeps its data and gets `sharing_mode`."""
        check_tenant(tenant_id)
        return self.parts.store.create_tenant(tenant_id=tenant_id, sharing_mode=sharing_mode)

    def set_test_tenant(self, *, tenant_id: str, test: bool = True) -> TestTenant:
        """Mark a tenant as a test tenant (made if absent), or not: stores registered `onboarding`
        receive only test tenants' memories."""
        check_tenant(tenant_id)
        if not test:
            from memory_pipelines.lib.stores import registry

            with self.parts.store.transaction() as conn:
                held = registry.onboarding_records(conn, tenant_id)
            if held:
                store, n = next(iter(sorted(held.items())))
                raise ConflictError(
                    "tenant",
                    f"{tenant_id!r} still has {n} record(s) in the onboarding store {store!r}, which would then go"
                    " stale: keep it a test tenant until the store is enforced, or forget those memories first",
                )
        return self.parts.store.set_test_tenant(tenant_id=tenant_id, test=test)

    def set_sharing_mode(self, *, tenant_id: str, sharing_mode: str) -> TenantMode:
        """Change an existing tenant's sharing mode: strict, shared_pool or progressive."""
        check_tenant(tenant_id)
        return self.parts.store.set_sharing_mode(tenant_id=tenant_id, sharing_mode=sharing_mode)

    def add_team_member(self, *, tenant_id: str, team_id: str, user_id: str) -> TeamMemberAdded:
        """Add a user to a team, creating tenant and team if needed (idempotent)."""
        check_tenant(tenant_id)
        return self.parts.store.add_team_member(tenant_id=tenant_id, team_id=team_id, user_id=user_id)

    def remove_team_member(self, *, tenant_id: str, team_id: str, user_id: str) -> TeamMemberRemoved:
        """Remove a user from a team; the memories they wrote for it stay with the team."""
        check_tenant(tenant_id)
        return self.parts.store.remove_team_member(tenant_id=tenant_id, team_id=team_id, user_id=user_id)

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
        check_tenant(tenant_id)
        return self.parts.store.set_do_not_sell(
            tenant_id=tenant_id, user_id=user_id, value=value, memory_id=memory_id, subject=subject
        )
