import json
from datetime import UTC, datetime

import dagster as dg

from memory_pipelines.defs.erasure.checks import erasure_evaluation
from memory_pipelines.defs.erasure.jobs import ERASURE_JOB, physical_erasure_job
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.lib.forget.canary import is_reserved_tenant
from memory_pipelines.lib.forget.erasure import ErasureLedger
from memory_pipelines.resources import MemoryStoreResource

_ACTIVE = {
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
}


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
    known = set(context.instance.get_dynamic_partitions(tenants_partitions.name or "tenants"))
    requests = []
    for tenant_id in ledger.due_tenants(now=now):
        if is_reserved_tenant(tenant_id) or tenant_id not in known:
            continue  # canary and evaluation tenants erase inside their own drills
        active = context.instance.get_run_records(
            dg.RunsFilter(job_name=ERASURE_JOB, tags={"dagster/partition": tenant_id}, statuses=list(_ACTIVE)),
            limit=1,
        )
        if active:
            continue
        requests.append(
            dg.RunRequest(run_key=f"erasure:{tenant_id}:{now.strftime('%Y%m%dT%H%M')}", partition_key=tenant_id)
        )
    return dg.SensorResult(run_requests=requests)


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
