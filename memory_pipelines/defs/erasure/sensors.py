import json
from datetime import UTC, datetime

import dagster as dg

from memory_pipelines.defs.erasure.checks import erasure_evaluation
from memory_pipelines.defs.erasure.jobs import ERASURE_JOB, KEY_CONVERSION_JOB, key_conversion_job, physical_erasure_job
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.defs.runs.sensors import NOT_ENDED
from memory_pipelines.lib.forget.canary import is_reserved_tenant
from memory_pipelines.lib.forget.erasure import ErasureLedger
from memory_pipelines.lib.memories.key_conversion import KeyConversion
from memory_pipelines.resources import MemoryStoreResource


def _idle(context: dg.SensorEvaluationContext, job_name: str, tenants: list[str]) -> list[str]:
    """Those of `tenants` that are partitions, not reserved (canary and evaluation tenants erase inside
    their own drills), and have no run of `job_name` queued or running."""
    known = set(context.instance.get_dynamic_partitions(tenants_partitions.name or "tenants"))
    return [
        tenant_id
        for tenant_id in tenants
        if tenant_id in known
        and not is_reserved_tenant(tenant_id)
        and not context.instance.get_run_records(
            dg.RunsFilter(job_name=job_name, tags={"dagster/partition": tenant_id}, statuses=NOT_ENDED), limit=1
        )
    ]


def _one_run_each(
    context: dg.SensorEvaluationContext, job_name: str, prefix: str, tenants: list[str], now: datetime
) -> dg.SensorResult:
    """A run of `job_name` for each idle one of `tenants`, keyed by the minute (a tick repeated within
    it asks for nothing new)."""
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(run_key=f"{prefix}:{tenant_id}:{now.strftime('%Y%m%dT%H%M')}", partition_key=tenant_id)
            for tenant_id in _idle(context, job_name, tenants)
        ]
    )


@dg.sensor(
    job=physical_erasure_job,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="One `physical_erasure` run per tenant whose COMPLETE deletions wait for erasure: after the batch"
    " window (MEMORY_PIPELINES_ERASURE_BATCH_MINUTES, 60 by default) or when the deadline nears.",
)
def physical_erasure_sensor(context: dg.SensorEvaluationContext, memory_store: MemoryStoreResource) -> dg.SensorResult:
    ledger = ErasureLedger(memory_store.store())
    now = datetime.now(UTC)
    return _one_run_each(context, ERASURE_JOB, "erasure", ledger.due_tenants(now=now), now)


@dg.sensor(
    minimum_interval_seconds=300,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Evaluates the `erasures_on_time` check of each tenant with pending erasures every 5 minutes,"
    " reporting it when its outcome changes.",
)
def erasures_on_time_sensor(context: dg.SensorEvaluationContext, memory_store: MemoryStoreResource) -> dg.SensorResult:
    ledger = ErasureLedger(memory_store.store())
    last: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
    known = set(context.instance.get_dynamic_partitions(tenants_partitions.name or "tenants"))
    tenants = ({job["tenant_id"] for job in ledger.pending()} | {t for t, s in last.items() if s != "pass"}) & known
    events, state = [], {}
    for tenant_id in sorted(tenants):
        evaluation = erasure_evaluation(ledger, tenant_id)
        outcome = "pass" if evaluation.passed else f"fail:{evaluation.metadata['overdue_erasures'].value}"
        if last.get(tenant_id) != outcome:
            events.append(evaluation)
        state[tenant_id] = outcome
    return dg.SensorResult(asset_events=events, cursor=json.dumps(state, sort_keys=True))


@dg.sensor(
    job=key_conversion_job,
    minimum_interval_seconds=300,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="One `key_conversion` run per tenant holding texts an older release sealed under their author's"
    " key, until none is left (after an upgrade; then it finds nothing).",
)
def key_conversion_sensor(context: dg.SensorEvaluationContext, memory_store: MemoryStoreResource) -> dg.SensorResult:
    store = memory_store.store()
    pending = KeyConversion(store.transaction, store.keys, backup_days=memory_store.settings().backup_days).pending()
    return _one_run_each(context, KEY_CONVERSION_JOB, "keys", sorted(pending), datetime.now(UTC))
