import json
from datetime import UTC, datetime

import dagster as dg

from memory_pipelines.defs.forget.checks import check_evaluation
from memory_pipelines.defs.forget.jobs import FORGET_JOB, forget_job, forget_run_config, named_job_ids
from memory_pipelines.defs.forget.ops import JOBS_TAG, jobs_tag
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.defs.runs.sensors import NOT_ENDED
from memory_pipelines.lib.forget.canary import is_reserved_tenant
from memory_pipelines.lib.forget.deletion import STALL_GRACE, DeletionLedger, LastRun, plan_forget_runs
from memory_pipelines.resources import MemoryStoreResource

# Forget runs read to count a tenant's consecutive failures (the relaunch backoff doubles per failure).
RECENT_RUNS = 8
# Forget runs not yet ended, read for the job ids they name; far above the tenants with one at a time.
ACTIVE_RUNS = 1000


def claimed_job_ids(instance: dg.DagsterInstance) -> set[str]:
    """Deletion job ids named by a `forget` run that has not ended, whoever launched it (this sensor,
    `forget --wait`, the launchpad): the sensor never launches another run for them."""
    records = instance.get_run_records(dg.RunsFilter(job_name=FORGET_JOB, statuses=NOT_ENDED), limit=ACTIVE_RUNS)
    claimed: set[str] = set()
    for record in records:
        run = record.dagster_run
        claimed.update(named_job_ids(run.run_config or {}))
        # The tag lists the first ids only; the config, when present, has them all.
        claimed.update(i for i in run.tags.get(JOBS_TAG, "").split(",") if i.startswith("del_"))
    return claimed


def last_forget_run(
    instance: dg.DagsterInstance, ledger: DeletionLedger, tenant_id: str, now: datetime | None = None
) -> LastRun | None:
    """The tenant's latest `forget` run (found by its partition tag), as the planner needs it.

    A run STARTED for longer than the stall grace whose worker holds no forget lock has lost its
    worker (the local run launcher has no health check): it is marked failed here, so the tenant's
    jobs are relaunched and its queue slot is freed instead of waiting forever."""
    records = instance.get_run_records(
        dg.RunsFilter(job_name=FORGET_JOB, tags={"dagster/partition": tenant_id}), limit=RECENT_RUNS
    )
    if not records:
        return None
    record = records[0]
    run = record.dagster_run
    now = now or datetime.now(UTC)
    ended = None if record.end_time is None else datetime.fromtimestamp(record.end_time, UTC)
    if run.status in NOT_ENDED:
        kind = "active"
        started = (
            datetime.fromtimestamp(record.start_time, UTC) if record.start_time is not None else record.create_timestamp
        )
        stalled = now - started.astimezone(UTC) > STALL_GRACE
        if run.status == dg.DagsterRunStatus.STARTED and stalled and not ledger.forget_running(tenant_id=tenant_id):
            instance.report_run_failed(run, message="forget run worker lost: it holds no forget lock; relaunching")
            kind, ended = "failed", now
    elif run.status == dg.DagsterRunStatus.SUCCESS:
        kind = "succeeded"
    else:
        kind = "failed"
    failures = 0
    for earlier in records:
        if earlier.dagster_run.status not in (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED):
            break
        failures += 1
    return LastRun(run_id=run.run_id, status=kind, ended_at=ended, failures=max(failures, int(kind == "failed")))


@dg.sensor(
    job=forget_job,
    minimum_interval_seconds=15,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="One `forget` run per tenant for new deletion requests, 30 s after they were made and unless a"
    " forget run not yet ended names them, e.g. `forget --wait`'s (cursor: the ledger sequence); relaunches"
    " requests whose run failed, retries BLOCKED jobs with backoff (1 min doubling, at most 1 h).",
)
def forget_requests_sensor(context: dg.SensorEvaluationContext, memory_store: MemoryStoreResource) -> dg.SensorResult:
    ledger = DeletionLedger(memory_store.store())
    # Canary and evaluation tenants run their own deletions and never become partitions.
    # A paused tenant's jobs wait, accepted and hidden, for `deletion resume` (their deadlines run on).
    rows = [row for row in ledger.ledger(paused=False) if not is_reserved_tenant(row["tenant_id"])]
    cursor = int(context.cursor or 0)
    last_runs = {
        tenant: run
        for tenant in sorted({row["tenant_id"] for row in rows})
        if (run := last_forget_run(context.instance, ledger, tenant)) is not None
    }
    # Read after the ledger: a run submitted in between is seen, so its jobs are not launched twice.
    claimed = claimed_job_ids(context.instance)
    planned, new_cursor = plan_forget_runs(
        rows, cursor=cursor, last_runs=last_runs, now=datetime.now(UTC), claimed=claimed
    )
    known = set(context.instance.get_dynamic_partitions(tenants_partitions.name or "tenants"))
    requests = [
        dg.RunRequest(
            run_key=run.run_key,
            partition_key=run.tenant_id,
            run_config=forget_run_config(job_ids=run.job_ids),
            tags={JOBS_TAG: jobs_tag(run.job_ids), "memory_pipelines/forget_reason": run.reason},
        )
        for run in planned
    ]
    new = sorted({run.tenant_id for run in planned} - known)
    return dg.SensorResult(
        run_requests=requests,
        cursor=str(new_cursor),
        dynamic_partitions_requests=[tenants_partitions.build_add_request(new)] if new else [],
    )


@dg.sensor(
    minimum_interval_seconds=300,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Evaluates the `deletions_on_track` check of each tenant with deletion jobs every 5 minutes,"
    " reporting it when its outcome changes.",
)
def deletions_on_track_sensor(
    context: dg.SensorEvaluationContext, memory_store: MemoryStoreResource
) -> dg.SensorResult:
    ledger = DeletionLedger(memory_store.store())
    last: dict[str, str] = json.loads(context.cursor) if context.cursor else {}
    known = set(context.instance.get_dynamic_partitions(tenants_partitions.name or "tenants"))
    # Tenants with open jobs, and those whose last report was a failure (so it passes again).
    tenants = ({row["tenant_id"] for row in ledger.ledger()} | {t for t, s in last.items() if s != "pass"}) & known
    events = []
    state: dict[str, str] = {}
    for tenant_id in sorted(tenants):
        evaluation = check_evaluation(ledger, tenant_id, context.instance)
        outcome = (
            "pass"
            if evaluation.passed
            else "fail:"
            + json.dumps({k: getattr(v, "value", None) for k, v in sorted(evaluation.metadata.items())}, sort_keys=True)
        )
        if last.get(tenant_id) != outcome:
            events.append(evaluation)
        state[tenant_id] = outcome
    return dg.SensorResult(asset_events=events, cursor=json.dumps(state, sort_keys=True))
