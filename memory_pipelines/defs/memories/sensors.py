import json

import dagster as dg

from memory_pipelines.defs.memories.assets import stats_metadata
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.lib.backups.service import restored_sequences
from memory_pipelines.lib.forget.canary import is_reserved_tenant, retired_tenants
from memory_pipelines.resources import MemoryStoreResource


@dg.sensor(
    name="tenant_partitions_sensor",
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    asset_selection=["memories"],
    description="Keeps the `tenants` partitions to the store's tenants (adds new ones; deletes offboarded,"
    " vanished and internal ones) and reports a `memories` materialization (counts only) when a tenant's"
    " memories changed, so the derived stores follow by declarative automation.",
)
def tenant_partitions_sensor(context: dg.SensorEvaluationContext, memory_store: MemoryStoreResource) -> dg.SensorResult:
    store = memory_store.store()
    seen: dict[str, int] = json.loads(context.cursor) if context.cursor else {}
    watermarks = {t: seq for t, seq in store.tenant_watermarks().items() if not is_reserved_tenant(t)}
    known = set(context.instance.get_dynamic_partitions(tenants_partitions.name or "tenants"))
    new = sorted(set(watermarks) - known)
    retired = sorted(retired_tenants(store, sorted(known)))
    restored = restored_sequences(store)
    # Writes happen through the API, outside Dagster: a reported (runless) materialization is how
    # the asset graph learns of them; eager automation on the derived assets reacts to it.
    events = []
    for tenant_id, seq in sorted(watermarks.items()):
        if seen.get(tenant_id) == seq or restored.get(tenant_id) == seq:
            continue  # unchanged, or changed by a restore: its backfill rebuilds the tenant
        stats = store.tenant_stats(tenant_id=tenant_id)
        events.append(
            dg.AssetMaterialization(
                asset_key="memories",
                partition=tenant_id,
                metadata={**stats_metadata(stats), "change_seq": dg.MetadataValue.int(seq)},
            )
        )
    requests: list[dg.AddDynamicPartitionsRequest | dg.DeleteDynamicPartitionsRequest] = []
    if new:
        requests.append(tenants_partitions.build_add_request(new))
    if retired:
        requests.append(tenants_partitions.build_delete_request(retired))
    return dg.SensorResult(
        dynamic_partitions_requests=requests,
        asset_events=events,
        cursor=json.dumps(watermarks, sort_keys=True),
    )
