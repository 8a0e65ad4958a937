import json

import dagster as dg

from memory_pipelines.defs.memories.assets import stats_metadata
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.resources import MemoryStoreResource


@dg.sensor(
    name="tenant_partitions_sensor",
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    asset_selection=["memories"],
    description="Adds a `tenants` partition per store tenant and reports a `memories` materialization (counts only)"
    " when a tenant's memories changed, so the derived stores follow by declarative automation.",
)
def tenant_partitions_sensor(context: dg.SensorEvaluationContext, memory_store: MemoryStoreResource) -> dg.SensorResult:
    store = memory_store.store()
    seen: dict[str, int] = json.loads(context.cursor) if context.cursor else {}
    watermarks = store.tenant_watermarks()
    known = set(context.instance.get_dynamic_partitions(tenants_partitions.name or "tenants"))
    new = sorted(set(watermarks) - known)
    # Writes happen through the API, outside Dagster: a reported (runless) materialization is how
    # the asset graph learns of them; eager automation on the derived assets reacts to it.
    events = []
    for tenant_id, seq in sorted(watermarks.items()):
        if seen.get(tenant_id) == seq:
            continue
        stats = store.tenant_stats(tenant_id=tenant_id)
        events.append(
            dg.AssetMaterialization(
                asset_key="memories",
                partition=tenant_id,
                metadata={**stats_metadata(stats), "change_seq": dg.MetadataValue.int(seq)},
            )
        )
    return dg.SensorResult(
        dynamic_partitions_requests=[tenants_partitions.build_add_request(new)] if new else [],
        asset_events=events,
        cursor=json.dumps(watermarks, sort_keys=True),
    )
