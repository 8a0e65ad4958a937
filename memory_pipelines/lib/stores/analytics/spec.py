"""The analytics copy: pseudonymised features in Parquet per tenant, queried with DuckDB."""

from memory_pipelines.lib.stores.registry import StoreSpec

SPECS = (
    StoreSpec(
        name="analytics",
        owner="team:analytics",
        locator_key="memory_id:version in the tenant=<hash of T> partition (rows carry tenant_id)",
        adapter_version="analytics-v1",
        max_completion_seconds=600,
        verification="no Parquet row of a target in the tenant partition",
        adapter="memory_pipelines.lib.stores.analytics.adapter:AnalyticsAdapter",
        order=70,
    ),
)
