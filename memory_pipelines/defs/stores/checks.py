"""Each store's asset checks (its spec's `checks`), from the registry: evaluated in the store asset's
own step (`assets.py`), not in a step of their own."""

from collections.abc import Iterator, Set

import dagster as dg

from memory_pipelines.defs.memories.partitions import tenant_check_spec
from memory_pipelines.lib.stores import registry
from memory_pipelines.lib.stores.derived import DerivedStores
from memory_pipelines.lib.stores.registry import StoreSpec


def check_specs(spec: StoreSpec) -> list[dg.AssetCheckSpec]:
    """The asset checks of `spec`'s asset, per tenant."""
    assert spec.asset is not None, spec.name
    return [tenant_check_spec(check.name, asset=spec.asset, description=check.description) for check in spec.checks]


def check_results(
    spec: StoreSpec, derived: DerivedStores, *, tenant_id: str, selected: Set[dg.AssetCheckKey]
) -> Iterator[dg.AssetCheckResult]:
    """The results of `spec`'s checks among `selected` for one tenant: each passes when every count
    its spec names is zero; every count is shown (numbers only, never text)."""
    assert spec.asset is not None, spec.name
    for check in spec.checks:
        if dg.AssetCheckKey(dg.AssetKey(spec.asset), check.name) not in selected:
            continue
        problems = registry.resolve(check.problems)(derived, tenant_id=tenant_id)
        yield dg.AssetCheckResult(
            asset_key=spec.asset,
            check_name=check.name,
            passed=all(problems[name] == 0 for name in check.must_be_zero),
            metadata={name: dg.MetadataValue.int(int(value)) for name, value in problems.items()},
        )
