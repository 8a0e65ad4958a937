"""The blind keyword index: MACs of tokens, no plaintext at rest."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.stores.registry import StoreCheck, StoreSpec, Synced

if TYPE_CHECKING:
    from memory_pipelines.lib.stores.derived import DerivedStores


__all__ = [
    "SPECS",
    "problems",
    "sync",
]


def sync(derived: DerivedStores, *, tenant_id: str, progress: Progress = no_progress) -> Synced:
    """Index what is new, drop what is gone; cached recalls go when the index changed."""
    from memory_pipelines.lib.stores.derived import sync_keywords

    return Synced(sync_keywords(derived.store, tenant_id=tenant_id))


def problems(derived: DerivedStores, *, tenant_id: str) -> dict[str, int]:
    return derived.keywords.check(tenant_id=tenant_id)


SPECS = (
    StoreSpec(
        name="keyword_index",
        owner="team:memory-platform",
        locator_key="(tenant, memory_id, version)",
        adapter_version="keyword-index-v2",
        max_completion_seconds=300,
        verification="no posting for a target; keyword probes return no target",
        adapter="memory_pipelines.lib.stores.keyword.adapter:KeywordIndexAdapter",
        order=40,
        key_erasure=("TENANT",),
        sealed_by="MACs of tokens under the author's keyword key (versions only their author sees;"
        " destroyed by SUBJECT) or the tenant's (the rest)",
        asset="keyword_index",
        sync=sync,
        asset_description="Exact-token search over current memories, as keyed hashes of tokens (no plaintext at rest).",
        checks=(
            StoreCheck(
                "keyword_index_lineage",
                "Every posting has lineage and a current source version.",
                problems,
                ("without_lineage", "not_current"),
            ),
        ),
        # A posting's record id is its version's `memory_id:version` (memory ids hold no colon).
        restore_drop="DELETE FROM derived.keyword_postings p USING unnest(%(ids)s::text[]) AS r(id)"
        " WHERE p.tenant_id = %(t)s AND p.memory_id = split_part(r.id, ':', 1)"
        " AND p.version = split_part(r.id, ':', 2)::int",
    ),
)
