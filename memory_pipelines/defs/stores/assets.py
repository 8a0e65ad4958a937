"""One asset per registered store that follows `memories` (its spec's `asset`), generated from the registry."""

from collections.abc import Iterator
from typing import Any

import dagster as dg

from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.defs.stores.checks import check_results, check_specs
from memory_pipelines.lib.infra.progress import throttled
from memory_pipelines.lib.stores import registry
from memory_pipelines.lib.stores.registry import StoreSpec
from memory_pipelines.resources import (
    AnalyticsResource,
    ChromaResource,
    MemoryStoreResource,
    SummarizerResource,
    derived_stores,
)

OWNERS = ["team:memory-platform"]
GROUP = "derived_stores"


# Every derived store: one partition per tenant, downstream of `memories`, follows it eagerly.
DERIVED: dict[str, Any] = {
    "deps": ["memories"],
    "group_name": GROUP,
    "owners": OWNERS,
    "tags": {"domain": "derived"},
    "automation_condition": dg.AutomationCondition.eager(),
}


def store_asset(spec: StoreSpec) -> dg.AssetsDefinition:
    """The asset that keeps `spec`'s store in sync with the tenant's memories (its counts as metadata),
    with its checks in the same step: under the daemon's multi-process executor every step is a
    process that loads the code location again, and a refresh run had twice as many.

    The checks alone can still be executed (from the UI, or a checks-only selection): then the store
    is not synced, only checked."""
    assert spec.asset is not None and spec.sync is not None, spec.name
    key = dg.AssetKey(spec.asset)

    @dg.multi_asset(
        name=spec.asset,
        specs=[dg.AssetSpec(key, description=spec.asset_description, kinds=set(spec.kinds), **DERIVED)],
        check_specs=check_specs(spec),
        partitions_def=tenants_partitions,
        can_subset=True,
    )
    def _asset(
        context: dg.AssetExecutionContext,
        memory_store: MemoryStoreResource,
        chroma: ChromaResource,
        summarizer: SummarizerResource,
        analytics: AnalyticsResource,
    ) -> Iterator[dg.MaterializeResult | dg.AssetCheckResult]:
        # Stores are made on first use: a step builds only what its own sync touches.
        derived = derived_stores(memory_store, chroma, summarizer, analytics)
        tenant_id = context.partition_key
        if key in context.selected_asset_keys:
            synced = registry.run_sync(spec, derived, tenant_id=tenant_id, progress=throttled(context.log.info))
            metadata: dict[str, Any] = {name: dg.MetadataValue.int(int(value)) for name, value in synced.counts.items()}
            metadata |= {name: dg.MetadataValue.text(value) for name, value in synced.text.items()}
            metadata |= {name: dg.MetadataValue.path(value) for name, value in synced.paths.items()}
            yield dg.MaterializeResult(asset_key=key, metadata=metadata)
        yield from check_results(spec, derived, tenant_id=tenant_id, selected=context.selected_asset_check_keys)

    return _asset


def store_assets() -> list[dg.AssetsDefinition]:
    """Every registered store's asset, in registry order."""
    return [store_asset(spec) for spec in registry.stores() if spec.asset]


STORE_ASSETS = store_assets()
