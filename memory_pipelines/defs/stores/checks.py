"""Each store's asset checks (its spec's `checks`), generated from the registry."""

import warnings

import dagster as dg

from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.lib.stores import registry
from memory_pipelines.lib.stores.registry import StoreCheck, StoreSpec
from memory_pipelines.resources import (
    AnalyticsResource,
    ChromaResource,
    MemoryStoreResource,
    SummarizerResource,
    derived_stores,
)

# Per-tenant checks need partitioned asset checks, a preview feature in this Dagster release.
warnings.filterwarnings("ignore", message="Specifying a partitions_def on an AssetCheckSpec", category=Warning)


def _result(problems: dict[str, int], *, must_be_zero: tuple[str, ...]) -> dg.AssetCheckResult:
    """Passes when every named count is zero; every count is shown (numbers only, never text)."""
    return dg.AssetCheckResult(
        passed=all(problems[name] == 0 for name in must_be_zero),
        metadata={name: dg.MetadataValue.int(int(value)) for name, value in problems.items()},
    )


def store_check(spec: StoreSpec, check: StoreCheck) -> dg.AssetChecksDefinition:
    """The asset check `check` of `spec`'s asset, per tenant."""
    assert spec.asset is not None, spec.name

    @dg.asset_check(asset=spec.asset, name=check.name, description=check.description, partitions_def=tenants_partitions)
    def _check(
        context: dg.AssetCheckExecutionContext,
        memory_store: MemoryStoreResource,
        chroma: ChromaResource,
        summarizer: SummarizerResource,
        analytics: AnalyticsResource,
    ) -> dg.AssetCheckResult:
        derived = derived_stores(memory_store, chroma, summarizer, analytics)
        problems = registry.resolve(check.problems)(derived, tenant_id=context.partition_key)
        return _result(problems, must_be_zero=check.must_be_zero)

    return _check


def store_checks() -> list[dg.AssetChecksDefinition]:
    """Every registered store's asset checks, in registry order."""
    return [store_check(spec, check) for spec in registry.stores() if spec.asset for check in spec.checks]


STORE_CHECKS = store_checks()
