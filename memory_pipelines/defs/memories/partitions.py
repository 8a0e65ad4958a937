import warnings
from collections.abc import Callable
from typing import Any

import dagster as dg

# Tenants, never users, are partitions: thousands of users per asset exceed what Dagster handles.
tenants_partitions = dg.DynamicPartitionsDefinition(name="tenants")


def check_result(evaluation: dg.AssetCheckEvaluation) -> dg.AssetCheckResult:
    """An evaluation a sensor reports, as the result the same check returns inside a run."""
    return dg.AssetCheckResult(
        passed=evaluation.passed,
        severity=evaluation.severity,
        description=evaluation.description,
        metadata=evaluation.metadata,
    )


def tenant_asset_check(*, asset: str, name: str, description: str) -> Callable[[Callable[..., Any]], Any]:
    """`dg.asset_check` per tenant partition. That is a preview feature in this release and warns
    at every definitions load, which would drown real warnings: silenced here only."""

    def decorate(fn: Callable[..., Any]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", category=dg.PreviewWarning)
            return dg.asset_check(asset=asset, name=name, description=description, partitions_def=tenants_partitions)(
                fn
            )

    return decorate


def tenant_check_spec(name: str, *, asset: str, description: str) -> dg.AssetCheckSpec:
    """`dg.AssetCheckSpec` per tenant partition, for a check evaluated in its asset's own step (the
    same preview feature as `tenant_asset_check`, silenced here only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=dg.PreviewWarning)
        return dg.AssetCheckSpec(name, asset=asset, description=description, partitions_def=tenants_partitions)
