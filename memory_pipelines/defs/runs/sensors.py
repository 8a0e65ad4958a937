"""Runs whose worker is gone are marked failed, by whoever looks first: this sensor under the daemon,
or any CLI command waiting on the instance's runs (materialize.py), so a tenant's queue never
waits on a dead run with or without a daemon.

A run is dead when (defs/runs/executors.py takes the lease):
- STARTED, tagged as holding its lease, and no session holds it (the worker's process or host died);
- STARTED without the tag, or STARTING, for longer than the instance's start timeout
  (`run_monitoring.start_timeout_seconds`): its worker never reached its first step.
Each is confirmed twice, CONFIRM_SECONDS apart, on a re-read run: a worker ends its lease just
before it records the run's end, and a run that ended meanwhile is left alone. Only runs of this
code location are judged; another location's runs sharing the instance are not ours to end.
The work itself resumes from what our tables recorded (deletion jobs, restores, backups) at its
next run: the forget sensor relaunches a tenant's jobs, a waiting command its own run.
"""

import socket
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import dagster as dg

from memory_pipelines.defs.runs.executors import LEASE_TAG
from memory_pipelines.launch.code_server import LOCATION
from memory_pipelines.launch.dagster_internals import instance_conninfo
from memory_pipelines.lib.infra import leases

CONFIRM_SECONDS = 3.0
# Far above the runs in flight on one instance (max_concurrent_runs is 4 by default).
ACTIVE_RUNS = 1000
JUDGED = [dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED]
# A run not ended yet: the sensors that start one run per job (or tenant) at a time wait for these.
NOT_ENDED = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
    dg.DagsterRunStatus.MANAGED,
]


@dataclass(frozen=True)
class DeadRun:
    run_id: str
    job_name: str
    partition: str
    reason: str


def _ours(run: dg.DagsterRun) -> bool:
    origin = run.remote_job_origin
    return origin is not None and origin.location_name == LOCATION


def _started_at(instance: dg.DagsterInstance, record: dg.RunRecord) -> float:
    if record.dagster_run.status == dg.DagsterRunStatus.STARTED and record.start_time is not None:
        return record.start_time
    launched = instance.get_run_stats(record.dagster_run.run_id).launch_time
    return launched if launched is not None else record.create_timestamp.timestamp()


def suspects(instance: dg.DagsterInstance, conninfo: str, now: float) -> dict[str, str]:
    """Run id to the reason it looks dead, for the runs of this location that do."""
    records = [
        record
        for record in instance.get_run_records(dg.RunsFilter(statuses=JUDGED), limit=ACTIVE_RUNS)
        if _ours(record.dagster_run)
    ]
    held = leases.holders(conninfo, [record.dagster_run.run_id for record in records])
    timeout = instance.run_monitoring_start_timeout_seconds
    found: dict[str, str] = {}
    for record in records:
        run = record.dagster_run
        age = now - _started_at(instance, record)
        if run.tags.get(LEASE_TAG) and run.status == dg.DagsterRunStatus.STARTED:
            if run.run_id not in held:
                found[run.run_id] = f"its worker's lease ended {round(age)} s into the run (its process or host died)"
        elif age > timeout:
            found[run.run_id] = f"its worker did not reach its first step within {timeout} s ({run.status.value})"
    return found


def reap(instance: dg.DagsterInstance, *, by: str) -> list[DeadRun]:
    """Mark the runs whose worker is gone failed, each with its reason; returns them."""
    conninfo = instance_conninfo(instance)
    if conninfo is None:
        return []
    first = suspects(instance, conninfo, time.time())
    if not first:
        return []
    time.sleep(CONFIRM_SECONDS)
    again = suspects(instance, conninfo, time.time())
    dead: list[DeadRun] = []
    for run_id in sorted(first.keys() & again.keys()):
        run = instance.get_run_by_id(run_id)
        if run is None or run.is_finished:
            continue
        message = (
            f"Run worker lost: {again[run_id]}. Marked failed by {by} on {socket.gethostname()} at "
            f"{datetime.now(UTC).isoformat(timespec='seconds')}; its work resumes from its recorded state at the"
            " next run."
        )
        instance.report_run_failed(run, message=message)
        dead.append(DeadRun(run_id, run.job_name, run.tags.get("dagster/partition", ""), again[run_id]))
    return dead


@dg.sensor(minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING)
def dead_run_workers_sensor(context: dg.SensorEvaluationContext) -> dg.SkipReason:
    """Marks failed the runs whose worker died, so their tenant's queue moves on."""
    dead = reap(context.instance, by="the dead_run_workers_sensor")
    for each in dead:
        context.log.warning(f"marked run {each.run_id} ({each.job_name} {each.partition}) failed: {each.reason}")
    return dg.SkipReason(f"{len(dead)} run(s) with a dead worker marked failed" if dead else "no run's worker is lost")
