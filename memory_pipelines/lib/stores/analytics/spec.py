"""The analytics copy: pseudonymised features per tenant in PostgreSQL, queried with DuckDB."""

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
    """Rewrite the tenant's analytics rows from its current, sellable memories."""
    counts = derived.analytics.rebuild(store=derived.store, tenant_id=tenant_id)
    return Synced(counts, text={"table": "derived.analytics_rows"})


def problems(derived: DerivedStores, *, tenant_id: str) -> dict[str, int]:
    return derived.analytics.check(store=derived.store, tenant_id=tenant_id)


SPECS = (
    StoreSpec(
        name="analytics",
        owner="team:analytics",
        locator_key="(tenant_id, memory_id, version) in derived.analytics_rows",
        adapter_version="analytics-v2",
        max_completion_seconds=600,
        verification="no row of a target in the tenant's partition of derived.analytics_rows",
        adapter="memory_pipelines.lib.stores.analytics.adapter:AnalyticsAdapter",
        order=70,
        sealed_by="nothing: pseudonymised features (no text) in PostgreSQL, in the clear",
        asset="analytics_memories",
        sync=sync,
        asset_description="Pseudonymised memory features for analysts (no text, no do-not-sell rows), in"
        " PostgreSQL where every host reaches them; queried with DuckDB.",
        kinds=("postgres", "duckdb"),
        # Rows of versions a restore drops go in the restore's own transaction, as every table of ours.
        restore_drop="DELETE FROM derived.analytics_rows WHERE tenant_id = %(t)s"
        " AND memory_id || ':' || version = ANY(%(ids)s)",
        checks=(
            StoreCheck(
                "analytics_no_text_no_do_not_sell",
                "No text column, no do-not-sell row; every row has lineage and a current source version.",
                problems,
                ("text_columns", "do_not_sell_rows", "without_lineage", "not_current"),
            ),
        ),
    ),
)
