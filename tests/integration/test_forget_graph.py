"""The `forget` job as a readable graph on real engines: a step per store, a failed store is a failed
step (jobs BLOCKED) that a re-execution from failure completes, launchpad requests validated like
the CLI's, the ledger-sequence sensor (relaunch, backoff) and the `deletions_on_track` check."""

from __future__ import annotations

import itertools
import os
from datetime import UTC, datetime, timedelta

import dagster as dg
import pytest
from dagster._core.storage.dagster_run import DagsterRun

from memory_pipelines.defs.forget.jobs import FORGET_JOB, forget_run_config
from memory_pipelines.defs.forget.sensors import (
    JOBS_TAG,
    deletions_on_track_sensor,
    forget_requests_sensor,
    last_forget_run,
)
from memory_pipelines.lib.forget.deletion import (
    DeletionBlocked,
    DeletionLedger,
    DeletionService,
)
from memory_pipelines.lib.stores import registry
from memory_pipelines.resources import MemoryStoreResource
from tests.support.servers import free_port

pytestmark = pytest.mark.slow
CHROMA_URL = "MEMORY_PIPELINES_CHROMA_URL"


def forget_job_def() -> dg.JobDefinition:
    """The `forget` job as the code location builds it (reconstructable: resources read the env now)."""
    from memory_pipelines.definitions import defs

    return defs().resolve_job_def(FORGET_JOB)


def materializations(result, asset: str) -> list[dg.AssetMaterialization]:
    return [
        e.step_materialization_data.materialization
        for e in result.get_asset_materialization_events()
        if e.asset_key.to_user_string() == asset
    ]


@pytest.fixture
def home_env(session_settings):
    os.environ["MEMORY_PIPELINES_HOME"] = str(session_settings.home)
    yield
    os.environ.pop(CHROMA_URL, None)


@pytest.fixture
def alice(store, derived, tenant):
    memory = store.write(tenant_id=tenant, user_id="alice", text="Alice keeps her spare key under the blue pot")
    store.write(tenant_id=tenant, user_id="bob", text="Bob waters the ferns on Sundays")
    derived.sync_all(tenant_id=tenant)
    return memory


def test_the_graph_has_a_step_per_stage_and_per_registered_store(home_env):
    job = forget_job_def()
    [graph_node] = [n for n in job.graph.nodes if n.name == "memory_deletions"]
    names = [n.name for n in graph_node.definition.nodes]
    stores = [f"delete_{spec.name}" for spec in registry.stores()]
    assert sorted(names) == sorted(["freeze", *stores, "verify", "prove"])
    deps = graph_node.definition.dependency_structure
    # freeze -> stores in registry order -> verify -> prove
    chain = ["freeze", *stores, "verify", "prove"]
    for before, after in itertools.pairwise(chain):
        inputs = deps.input_to_upstream_outputs_for_node(after).values()
        upstream = {output.node_name for outputs in inputs for output in outputs}
        assert upstream == {before}, after
    assert job.executor_def.name == "in_process"
    check_keys = job.asset_layer.asset_graph.asset_check_keys
    assert dg.AssetCheckKey(dg.AssetKey("memory_deletions"), "deletions_on_track") in check_keys


def test_a_failed_store_is_a_failed_step_and_reexecution_from_failure_completes(
    store, derived, tenant, alice, home_env
):
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    resource = MemoryStoreResource(home=os.environ["MEMORY_PIPELINES_HOME"])
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [tenant])
        # Chroma is unreachable for this run: nothing listens at that address.
        os.environ[CHROMA_URL] = f"http://127.0.0.1:{free_port()}"
        first = dg.execute_job(
            dg.reconstructable(forget_job_def),
            instance=instance,
            run_config=forget_run_config(job_ids=[job["job_id"]]),
            tags={"dagster/partition": tenant},
            raise_on_error=False,
        )
        assert not first.success
        failed = [e for e in first.all_events if e.event_type_value == "STEP_FAILURE"]
        assert [e.step_key for e in failed] == ["memory_deletions.delete_chroma"]
        failure = failed[0].step_failure_data.user_failure_data
        assert failure.metadata["code"].value == "CHROMA_UNAVAILABLE"
        assert failure.metadata["deletion_job_ids"].value == [job["job_id"]]
        succeeded = {e.step_key for e in first.all_events if e.event_type_value == "STEP_SUCCESS"}
        assert {"memory_deletions.freeze", "memory_deletions.delete_recall_cache"} <= succeeded
        blocked = service.status(job_id=job["job_id"])
        assert blocked["state"] == "BLOCKED" and blocked["targets"]["chroma"] == "FAILED:CHROMA_UNAVAILABLE"

        # The alert: the check fails for the tenant (reported at the failed step, and by the sensor).
        context = dg.build_sensor_context(instance=instance, resources={"memory_store": resource})
        tick = deletions_on_track_sensor(context)
        sensed = {e.partition: e for e in tick.asset_events}
        assert sensed[tenant].passed is False and sensed[tenant].metadata["blocked_jobs"].value == 1
        assert job["job_id"] in sensed[tenant].metadata["blocked_job_ids"].value
        history = instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(dg.AssetKey("memory_deletions"), "deletions_on_track"), limit=5
        )
        assert history, "the failed step reported the check"

        # Chroma is back (the embedded one); re-execute from the failed step in a new run.
        os.environ[CHROMA_URL] = ""  # the home's own Chroma (a loaded code location may hold the EnvVar)
        second = dg.execute_job(
            dg.reconstructable(forget_job_def),
            instance=instance,
            reexecution_options=dg.ReexecutionOptions.from_failure(first.run_id, instance),
            tags={"dagster/partition": tenant},  # as the UI's re-execution copies the parent's tags
            raise_on_error=False,
        )
        assert second.success
        ran = {e.step_key for e in second.all_events if e.event_type_value == "STEP_SUCCESS"}
        assert "memory_deletions.freeze" not in ran and "memory_deletions.delete_chroma" in ran
        done = service.status(job_id=job["job_id"])
        assert done["state"] == "COMPLETE" and done["attempts"] == 2
        assert all(str(v).startswith("DONE:") for k, v in done["targets"].items() if registry.is_registered(k))
        [deletions] = materializations(second, "memory_deletions")
        assert deletions.metadata["deletion_states"].value == {job["job_id"]: "COMPLETE"}
        assert deletions.metadata["store_primary"].value == 1
        [memories] = materializations(second, "memories")
        assert memories.metadata["forget_job_ids"].value == [job["job_id"]]
        assert set(memories.metadata) >= {"forget_basis", "forget_removed_chroma", "forget_removed_primary"}
        assert "memories" not in memories.metadata  # never the asset's own keys
        [check] = second.get_asset_check_evaluations()
        assert check.passed and check.partition == tenant
        # The sensor reports the tenant passing again.
        again = deletions_on_track_sensor(
            dg.build_sensor_context(instance=instance, cursor=tick.cursor, resources={"memory_store": resource})
        )
        assert {e.partition: e.passed for e in again.asset_events}.get(tenant) is True
    assert derived.vectors.ids(tenant) == {
        f"{m['memory_id']}:1" for m in store.list_visible(tenant_id=tenant, user_id="bob")
    }


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"scope": "PLANET", "subject": "alice"}, "scope"),
        ({"scope": "SUBJECT", "subject": "x'; --"}, "subject"),
        ({"scope": "SUBJECT"}, "subject"),
        ({"scope": "MEMORY", "memory_id": "m_123"}, "memory_id"),
        ({"scope": "TENANT", "confirm": "someone-else"}, "confirm"),
        ({"scope": "SUBJECT", "subject": "alice", "basis": "because"}, "basis"),
        ({"scope": "SUBJECT", "subject": "alice", "job_ids": ["del_x"]}, "job_ids"),
    ],
)
def test_launchpad_requests_are_validated_like_the_cli_and_change_nothing(
    derived, tenant, alice, home_env, config, field
):
    service = DeletionService(derived)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [tenant])
        job_ids = config.pop("job_ids", [])
        result = forget_job_def().execute_in_process(
            instance=instance,
            partition_key=tenant,
            run_config=forget_run_config(job_ids=job_ids, **config),
            raise_on_error=False,
        )
        assert not result.success
        [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
        assert failure.step_key == "memory_deletions.freeze"
        assert failure.step_failure_data.user_failure_data.metadata["field"].value == field
        assert f"{field}:" in failure.step_failure_data.user_failure_data.description
    assert service.list_jobs(tenant_id=tenant) == []


def test_a_launchpad_request_runs_through_the_graph(store, derived, tenant, alice, home_env):
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [tenant])
        result = forget_job_def().execute_in_process(
            instance=instance,
            partition_key=tenant,
            run_config=forget_run_config(job_ids=[], scope="SUBJECT", subject="alice", basis="gdpr-art17"),
        )
        assert result.success
    [job] = DeletionService(derived).list_jobs(tenant_id=tenant)
    assert job["state"] == "COMPLETE" and job["basis"] == "gdpr-art17"
    [deletions] = materializations(result, "memory_deletions")
    assert deletions.metadata["basis"].value == "gdpr-art17"
    assert store.list_visible(tenant_id=tenant, user_id="alice") == []


def test_a_run_with_nothing_to_forget_reports_no_materialization(store, derived, tenant, alice, home_env):
    """A run for jobs another run completed (`forget --wait` got there first), or with none pending,
    skips every step after freeze: no empty materialization hides the tenant's last proof."""
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [tenant])
        for job_ids in ([job["job_id"]], []):
            result = forget_job_def().execute_in_process(
                instance=instance, partition_key=tenant, run_config=forget_run_config(job_ids=job_ids)
            )
            assert result.success
            assert result.get_asset_materialization_events() == []
            assert result.get_asset_check_evaluations() == []
            skipped = {e.step_key for e in result.all_events if e.event_type_value == "STEP_SKIPPED"}
            assert {"memory_deletions.prove", "memory_deletions.verify"} <= skipped
    assert service.status(job_id=job["job_id"])["attempts"] == 1  # never frozen again
    assert not DeletionLedger(store).forget_running(tenant_id=tenant)  # the run lock was given back


def _requests_for(result, tenant):
    return [r for r in result.run_requests if r.partition_key == tenant]


def _add_run(instance, tenant, status, run_config=None):
    run = DagsterRun(
        job_name=FORGET_JOB, tags={"dagster/partition": tenant}, status=status, run_config=run_config or {}
    )
    instance.add_run(run)
    return run.run_id


def _age(store, job_id, seconds=60):
    """The request as if made `seconds` ago (past the sensor's settle time)."""
    with store.transaction() as conn:
        conn.execute(
            "UPDATE control.deletion_jobs SET updated_at = now() - make_interval(secs => %s) WHERE job_id = %s",
            (seconds, job_id),
        )


def test_sensor_cursor_is_the_ledger_sequence_with_relaunch_and_backoff(
    store, derived, tenant, alice, session_settings
):
    service = DeletionService(derived)
    resource = MemoryStoreResource(home=str(session_settings.home))
    job = service.request(tenant_id=tenant, subject="alice")
    seq = next(r["seq"] for r in service.ledger(tenant_id=tenant))
    assert seq is not None
    with dg.instance_for_test() as instance:

        def tick(cursor):
            return forget_requests_sensor(
                dg.build_sensor_context(instance=instance, cursor=cursor, resources={"memory_store": resource})
            )

        # Just requested: its requester (`forget --wait`) may be submitting its own run; not yet, and
        # the cursor stays below it.
        held = tick(str(seq - 1))
        assert _requests_for(held, tenant) == [] and int(held.cursor) == seq - 1
        _age(store, job["job_id"])
        # A run that names the job and has not ended (the run `forget --wait` submitted): it is that run's.
        cli_run = _add_run(
            instance, tenant, dg.DagsterRunStatus.NOT_STARTED, run_config=forget_run_config(job_ids=[job["job_id"]])
        )
        claimed = tick(str(seq - 1))
        assert _requests_for(claimed, tenant) == [] and int(claimed.cursor) >= seq
        instance.delete_run(cli_run)
        first = tick(str(seq - 1))
        [request] = _requests_for(first, tenant)
        assert request.run_key == f"forget:{tenant}:{seq}"
        assert request.tags[JOBS_TAG] == job["job_id"]
        assert request.run_config == forget_run_config(job_ids=[job["job_id"]])
        assert int(first.cursor) >= seq

        # The run is in progress: nothing more for the tenant.
        _add_run(instance, tenant, dg.DagsterRunStatus.STARTED)
        assert _requests_for(tick(first.cursor), tenant) == []
        # It failed before reaching the job, which is still REQUESTED: relaunched once, with a new key.
        failed = _add_run(instance, tenant, dg.DagsterRunStatus.FAILURE)
        [relaunch] = _requests_for(tick(first.cursor), tenant)
        assert relaunch.run_key == f"forget:{tenant}:{seq}:after:{failed}"
        assert relaunch.tags["memory_pipelines/forget_reason"] == "relaunch"

        # A run that blocks the job: BLOCKED, a new ledger sequence, retried after its backoff only.
        def refuse(step, job_ids):
            raise TimeoutError("the store did not answer")

        with pytest.raises(DeletionBlocked):
            DeletionService(derived, hooks={"deleted:chroma": refuse}).run_batch(
                tenant_id=tenant, job_ids=[job["job_id"]]
            )
        [row] = service.ledger(tenant_id=tenant)
        assert row["state"] == "BLOCKED" and row["seq"] > seq and row["attempts"] == 1
        wait = row["next_attempt_at"] - row["updated_at"]
        assert timedelta(seconds=55) < wait <= timedelta(minutes=1, seconds=5)
        assert _requests_for(tick(first.cursor), tenant) == []  # not due yet
        with store.transaction() as conn:
            conn.execute(
                "UPDATE control.deletion_jobs SET next_attempt_at = now() - interval '1 second' WHERE job_id = %s",
                (job["job_id"],),
            )
        [retry] = _requests_for(tick(first.cursor), tenant)
        assert retry.run_key == f"forget:{tenant}:{row['seq']}:after:{failed}"
        assert retry.tags["memory_pipelines/forget_reason"] == "retry"
        # A second failure doubles the wait.
        with pytest.raises(DeletionBlocked):
            DeletionService(derived, hooks={"deleted:chroma": refuse}).run_batch(
                tenant_id=tenant, job_ids=[job["job_id"]]
            )
        [row] = service.ledger(tenant_id=tenant)
        assert row["attempts"] == 2
        assert (
            timedelta(minutes=1, seconds=55)
            < row["next_attempt_at"] - row["updated_at"]
            <= timedelta(minutes=2, seconds=5)
        )
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.ledger(tenant_id=tenant) == []


def test_a_forget_run_whose_worker_died_is_marked_failed_and_its_jobs_relaunched(
    store, derived, tenant, alice, session_settings
):
    """The local run launcher has no health check: a STARTED run past the stall grace whose worker
    holds no forget lock is dead. While a live process holds the lock, the run is left alone."""
    ledger = DeletionLedger(store)
    with dg.instance_for_test() as instance:
        run_id = _add_run(instance, tenant, dg.DagsterRunStatus.STARTED)
        soon = datetime.now(UTC) + timedelta(minutes=1)
        assert last_forget_run(instance, ledger, tenant, now=soon).status == "active"  # within the grace
        later = datetime.now(UTC) + timedelta(minutes=10)
        batch = DeletionService(derived).begin(tenant_id=tenant, job_ids=[])  # a live holder of the lock
        try:
            assert ledger.forget_running(tenant_id=tenant)
            assert last_forget_run(instance, ledger, tenant, now=later).status == "active"
            assert instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.STARTED
        finally:
            DeletionService(derived).release(batch)
        assert not ledger.forget_running(tenant_id=tenant)
        lost = last_forget_run(instance, ledger, tenant, now=later)
        assert (lost.status, lost.failures) == ("failed", 1)
        assert instance.get_run_by_id(run_id).status == dg.DagsterRunStatus.FAILURE
