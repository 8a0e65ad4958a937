"""CLI runs go through the instance as `dagster job launch` runs: with their code-location origin,
partition and tenant tags, through the run queue's per-tenant limit, and read back from the instance."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.settings import Settings
from tests.conftest import CLI, run_cli
from tests.integration.test_cli import ok
from tests.support.instances import database_sessions

pytestmark = pytest.mark.slow

# Sessions a small `materialize` may open on the instance's database, command and run worker together:
# those before each holds its connections (opening the instance, the run's first events), and one
# per storage each keeps. 51-57 when measured (2026-12-06), 305 before.
MOST_SESSIONS_PER_RUN = 100


@pytest.fixture(scope="module")
def instance(cli_env) -> Iterator:
    """The CLI HOME's Dagster instance, opened as the CLI opens it (environment restored after)."""
    import dagster as dg

    from memory_pipelines.lib.infra.services import ensure_services

    saved = dict(os.environ)
    try:
        os.environ.update(cli_env["env"], MEMORY_PIPELINES_HOME=str(cli_env["home"]))
        settings = Settings.from_env()  # as the CLI reads it: the session's server, no second one
        ensure_services(settings)
        with dg.DagsterInstance.from_config(str(settings.dagster_home)) as opened:
            yield opened
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _run_of(instance, job_name: str, run_id: str):
    from dagster._core.storage.dagster_run import RunsFilter

    runs = {r.run_id: r for r in instance.get_runs(RunsFilter(job_name=job_name))}
    assert run_id in runs, f"{job_name} run {run_id} not in the instance"
    return runs[run_id]


def _launched_like_job_launch(run, tenant: str) -> None:
    assert run.status.value == "SUCCESS"
    assert run.remote_job_origin is not None and run.job_code_origin is not None
    assert run.remote_job_origin.location_name == "memory_pipelines"
    assert run.tags["dagster/partition"] == tenant and run.tags["memory_pipelines/tenant"] == tenant


def test_materialize_backup_and_restore_runs_have_their_origin_and_partition(cli_env, instance, tenant):
    ok(cli_env, "write", "--tenant", tenant, "--user", "ann", "Ann keeps bees")
    refresh = ok(cli_env, "materialize", "--tenant", tenant, "--select", "memories,keyword_index")
    assert refresh["success"] and set(refresh["assets"]) == {"memories", "keyword_index"}
    assert refresh["checks"] == {"store_integrity": True, "keyword_index_lineage": True}
    assert refresh["assets"]["memories"]["memories"] == 1
    _launched_like_job_launch(_run_of(instance, "tenant_refresh", refresh["run_id"]), tenant)
    backup = ok(cli_env, "backup", "--tenant", tenant)
    assert backup["rows_memories"] == 1
    _launched_like_job_launch(_run_of(instance, "backup", backup["run_id"]), tenant)
    report = ok(cli_env, "restore", "--tenant", tenant, "--backup", backup["backup_id"], "--wait")
    assert report["state"] == "COMPLETE" and report["loaded"]["memories"] == 1
    _launched_like_job_launch(_run_of(instance, "restore", report["run_id"]), tenant)


def test_a_failing_run_is_the_cli_error_with_its_root_cause(cli_env, instance, tenant):
    ok(cli_env, "write", "--tenant", tenant, "--user", "ann", "Ann keeps bees")
    backup = ok(cli_env, "backup", "--tenant", tenant)
    archive = Path(backup["location"]) / tenant / f"{backup['backup_id']}.bin"
    data = archive.read_bytes()
    archive.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])  # one flipped bit
    result = run_cli(
        "restore",
        "--tenant",
        tenant,
        "--backup",
        backup["backup_id"],
        "--wait",
        home=cli_env["home"],
        env=cli_env["env"],
    )
    assert result.returncode != 0 and result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("memory-pipelines: error: restore: ") and "failed authentication" in last, last
    from dagster._core.storage.dagster_run import RunsFilter

    failed = instance.get_runs(RunsFilter(job_name="restore", tags={"dagster/partition": tenant}))
    assert [r.status.value for r in failed] == ["FAILURE"]


def test_runs_of_one_tenant_never_overlap_without_a_daemon(cli_env, instance, tenant):
    from dagster._core.run_coordinator import QueuedRunCoordinator

    if not isinstance(instance.run_coordinator, QueuedRunCoordinator):
        pytest.skip("the instance has no run queue (DefaultRunCoordinator): runs start at once")
    assert not instance.get_daemon_heartbeats(), "this test is about CLI use without a daemon"
    ok(cli_env, "write", "--tenant", tenant, "--user", "ann", "Ann keeps bees")
    env = {**os.environ, "MEMORY_PIPELINES_HOME": str(cli_env["home"]), **cli_env["env"]}
    args = [str(CLI), "materialize", "--tenant", tenant, "--select", "memories,keyword_index"]
    both = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"]
    outputs = [p.communicate(timeout=300) for p in both]
    assert [p.returncode for p in both] == [0, 0], [err[-2000:] for _, err in outputs]
    run_ids = [json.loads(out)["run_id"] for out, _ in outputs]
    records = sorted((instance.get_run_record_by_id(r) for r in run_ids), key=lambda r: r.start_time)
    assert all(r.dagster_run.status.value == "SUCCESS" for r in records)
    first, second = records
    assert first.end_time <= second.start_time, "two runs of one tenant ran at once"


def test_a_command_and_its_run_worker_each_keep_their_connections_to_the_instance(cli_env, instance, tenant):
    """dagster-postgres opens a connection per storage call: a small `materialize` made about 300, each
    a new server process (113 from the command, 200 from its run worker). Each keeps its own now, once
    it has opened the instance (21 and 38)."""
    from memory_pipelines.launch.dagster_internals import instance_conninfo

    conninfo = instance_conninfo(instance)
    assert conninfo is not None
    ok(cli_env, "write", "--tenant", tenant, "--user", "ann", "Ann keeps bees")
    ok(cli_env, "materialize", "--tenant", tenant)  # the warm code server's first run: its fork server starts
    ok(cli_env, "write", "--tenant", tenant, "--user", "ann", "Ann mends clocks")
    before = database_sessions(conninfo)
    assert ok(cli_env, "materialize", "--tenant", tenant)["success"]
    opened = database_sessions(conninfo) - before - 1
    assert opened <= MOST_SESSIONS_PER_RUN, opened


def test_offboarded_vanished_and_internal_tenants_do_not_stay_partitions(store, derived, session_settings, tenant):
    """The partitions sensor deletes them; the nightly backups skip them (and tenants being offboarded)
    even before it has."""
    import uuid
    from datetime import UTC, datetime

    import dagster as dg

    from memory_pipelines.defs.backups.schedules import nightly_backups
    from memory_pipelines.defs.memories.sensors import tenant_partitions_sensor
    from memory_pipelines.lib.forget.deletion import DeletionService
    from memory_pipelines.resources import MemoryStoreResource

    offboarded, leaving, vanished = (f"t-{uuid.uuid4().hex[:12]}" for _ in range(3))
    for t in (tenant, offboarded, leaving):
        store.write(tenant_id=t, user_id="ann", text="Ann keeps bees")
    with validation.platform_owned():  # as the canary drill makes its tenants
        store.write(tenant_id="canary-x-" + tenant, user_id="ann", text="internal")
    service = DeletionService(derived)
    job = service.request(tenant_id=offboarded, all_tenant=True, confirm=offboarded, basis="offboarding")
    service.run_batch(tenant_id=offboarded, job_ids=[job["job_id"]])
    # Requested, not yet run: its forget run still reports to the partition, which stays.
    service.request(tenant_id=leaving, all_tenant=True, confirm=leaving, basis="offboarding")
    resource = MemoryStoreResource(home=str(session_settings.home))
    known = [tenant, offboarded, leaving, vanished, "eval", "canary-x-" + tenant]
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", known)
        context = dg.build_sensor_context(instance=instance, resources={"memory_store": resource})
        result = tenant_partitions_sensor(context)
        assert isinstance(result, dg.SensorResult)
        deleted = {
            key
            for request in result.dynamic_partitions_requests or []
            if isinstance(request, dg.DeleteDynamicPartitionsRequest)
            for key in request.partition_keys
        }
        assert deleted >= {offboarded, vanished, "eval", "canary-x-" + tenant}
        assert not deleted & {tenant, leaving}
        reported = {e.partition for e in result.asset_events if isinstance(e, dg.AssetMaterialization)}
        assert tenant in reported and not reported & {offboarded, "eval", "canary-x-" + tenant}
        night = datetime(2026, 11, 1, 1, 30, tzinfo=UTC)
        with dg.build_schedule_context(
            instance=instance, resources={"memory_store": resource}, scheduled_execution_time=night
        ) as schedule_context:
            backed_up = {r.partition_key for r in nightly_backups(schedule_context)}
        assert backed_up == {tenant}  # not the one being offboarded either
