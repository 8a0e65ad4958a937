"""memory_pipelines/launch/dagster_internals.py: each private Dagster name, signature and behaviour the
project relies on, pinned here so that a Dagster upgrade fails in this file first, with a message
naming what changed. And no other module of the package imports `dagster._`.

The behavioural checks run against a throwaway instance (`dg.instance_for_test`) and an in-process
code location defined below: no code server, no PostgreSQL."""

from __future__ import annotations

import ast
import inspect
import io
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from memory_pipelines.launch import dagster_internals as internals

PACKAGE = Path(internals.__file__).parent
INTERNALS = Path(internals.__file__)


def pinned(condition: object, what: str, got: object = None) -> None:
    assert condition, (
        f"dagster {dg.__version__}: {what} changed{'' if got is None else f' (got {got!r})'}."
        " memory_pipelines/launch/dagster_internals.py relies on it; adapt it there"
        " (its docstring says what it is for)."
    )


def accepts(function: Any, *args: Any, **kwargs: Any) -> bool:
    """Whether `function`'s signature binds these arguments (what the project passes it)."""
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


# -- no private import outside dagster_internals.py --------------------------------------------


def _private_imports(path: Path) -> list[str]:
    """`line: module` of each import of a private Dagster module or name in the file: import
    statements (inside functions and TYPE_CHECKING blocks too) and importlib calls."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            private_module = _private(node.module)
            names = [node.module] if private_module else [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            if ast.unparse(node.func) in {"importlib.import_module", "import_module", "__import__"}:
                names = [str(node.args[0].value)]
        found += [f"{getattr(node, 'lineno', 0)}: {name}" for name in names if _private(name)]
    return found


def _private(module: str) -> bool:
    """dagster._core..., dagster._daemon..., `from dagster import _x`; not dagster.__version__."""
    parts = module.split(".")
    return parts[0] == "dagster" and len(parts) > 1 and parts[1].startswith("_") and not parts[1].startswith("__")


def test_only_dagster_internals_imports_private_dagster_modules() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{hit}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != INTERNALS
        for hit in _private_imports(path)
    ]
    assert not offenders, (
        "private Dagster imports outside memory_pipelines/launch/dagster_internals.py (use the public API, or add"
        " what has none to dagster_internals.py with a pin here):\n" + "\n".join(offenders)
    )


def test_the_import_check_sees_every_form(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import dagster._core.x\nfrom dagster._utils import y\nfrom dagster import _priv, asset\n"
        "import dagster\nfrom dagster import __version__\nimport importlib\n"
        "def f():\n    from dagster._core.z import w\n    return importlib.import_module('dagster._daemon')\n",
        encoding="utf-8",
    )
    assert sorted(_private_imports(probe)) == [
        "1: dagster._core.x",
        "2: dagster._utils",
        "3: dagster._priv",
        "8: dagster._core.z",
        "9: dagster._daemon",
    ]


# -- a throwaway instance and code location ------------------------------------------------------


@dg.asset
def first() -> dg.MaterializeResult:
    return dg.MaterializeResult(metadata={"rows": 3})


@dg.asset(deps=[first])
def second() -> None:
    return None


@dg.asset_check(asset=first)
def first_checked() -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=False, severity=dg.AssetCheckSeverity.WARN)


@dg.asset
def broken() -> None:
    raise ValueError("broken on purpose")


TENANTS = dg.DynamicPartitionsDefinition(name="tenants")


@dg.asset(partitions_def=TENANTS)
def per_tenant() -> None:
    return None


@dg.asset(partitions_def=TENANTS, deps=[per_tenant])
def per_tenant_derived() -> None:
    return None


PIN_JOB = dg.define_asset_job("pin_job", selection=[first, second], tags={"job/own": "yes"})
pin_defs = dg.Definitions(
    assets=[first, second, broken, per_tenant, per_tenant_derived], asset_checks=[first_checked], jobs=[PIN_JOB]
)
LOCATION = "pin_location"
TAG = "pin/tenant"


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    """The run coordinator as in assets/dagster/dagster.yaml (one run per tag value), with a run
    launcher that only records what it launches."""
    overrides = {
        "run_coordinator": {
            "module": "dagster",
            "class": "QueuedRunCoordinator",
            "config": {
                "max_concurrent_runs": 4,
                "tag_concurrency_limits": [{"key": TAG, "value": {"applyLimitPerUniqueValue": True}, "limit": 1}],
            },
        },
        "run_launcher": {"module": "dagster._core.test_utils", "class": "MockedRunLauncher"},
    }
    with dg.instance_for_test(overrides=overrides) as test_instance:
        yield test_instance


@pytest.fixture
def workspace(instance: dg.DagsterInstance) -> Iterator[internals.WorkspaceProcessContext]:
    """This module's `pin_defs` as an in-process code location, and one that fails to load."""
    from dagster._core.remote_origin import InProcessCodeLocationOrigin
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget

    def origin(module: str, name: str) -> InProcessCodeLocationOrigin:
        target = LoadableTargetOrigin(module_name=module, attribute="pin_defs", working_directory=str(PACKAGE.parent))
        return InProcessCodeLocationOrigin(loadable_target_origin=target, location_name=name)

    load_target = InProcessWorkspaceLoadTarget([origin(__name__, LOCATION), origin(f"{__name__}_absent", "absent")])
    with warnings.catch_warnings():  # Dagster warns of the location that fails to load, as it should
        warnings.filterwarnings("ignore", message="Error loading repository location absent", category=UserWarning)
        context = WorkspaceProcessContext(instance, load_target)
    with context:
        yield context


# -- runs through the workspace (materialize.py) -----------------------------------------------


def test_open_workspace_passes_what_the_workspace_context_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    from dagster._core.workspace import context as workspace_module
    from dagster._core.workspace.load_target import WorkspaceFileTarget

    real = workspace_module.WorkspaceProcessContext
    seen: dict[str, Any] = {}

    def recording(*args: Any, **kwargs: Any) -> str:
        pinned(accepts(real, *args, **kwargs), f"WorkspaceProcessContext's constructor (we pass {sorted(kwargs)})")
        seen.update(kwargs)
        return "context"

    monkeypatch.setattr(workspace_module, "WorkspaceProcessContext", recording)
    with dg.instance_for_test() as test_instance:
        assert internals.open_workspace(test_instance, Path("/x/workspace.yaml")) == "context"
    target = seen["workspace_load_target"]
    pinned(
        isinstance(target, WorkspaceFileTarget) and list(target.paths) == ["/x/workspace.yaml"], "WorkspaceFileTarget"
    )
    pinned(seen["code_server_log_level"] == "WARNING" and seen["version"] == dg.__version__, "the workspace's keywords")
    for method in ("__enter__", "__exit__", "create_request_context", "instance"):
        pinned(hasattr(real, method), f"WorkspaceProcessContext.{method}")


def test_submit_job_run_creates_a_queued_run_of_the_location_job(
    instance: dg.DagsterInstance, workspace: internals.WorkspaceProcessContext
) -> None:
    run_id = internals.submit_job_run(
        instance,
        workspace,
        location_name=LOCATION,
        job_name="pin_job",
        run_config={},
        tags={TAG: "t1"},
        asset_keys=[dg.AssetKey("first")],
    )
    run = instance.get_run_by_id(run_id)
    assert run is not None
    pinned(run.status == dg.DagsterRunStatus.QUEUED, "submit_run with a QueuedRunCoordinator (the run is queued)")
    pinned(run.tags[TAG] == "t1" and run.tags["job/own"] == "yes", "create_run's tags (ours over the job's)")
    pinned(run.asset_selection == {dg.AssetKey("first")}, "create_run's asset_selection")
    steps = run.step_keys_to_execute
    pinned(steps == ["first", "first_first_checked"], "the execution plan of an asset subset (and its checks)", steps)
    pinned(run.remote_job_origin is not None and run.remote_job_origin.location_name == LOCATION, "the run's origin")
    whole = internals.submit_job_run(
        instance, workspace, location_name=LOCATION, job_name="pin_job", run_config={}, tags={}
    )
    whole_run = instance.get_run_by_id(whole)
    assert whole_run is not None
    pinned(whole_run.asset_selection is None and len(whole_run.step_keys_to_execute or []) == 3, "a whole-job run")


def test_a_location_that_failed_to_load_is_reported_with_its_error(
    instance: dg.DagsterInstance, workspace: internals.WorkspaceProcessContext
) -> None:
    from memory_pipelines.launch.materialize import _root_cause

    with pytest.raises(internals.CodeLocationLoadError) as failed:
        internals.submit_job_run(
            instance, workspace, location_name="absent", job_name="pin_job", run_config={}, tags={}
        )
    error = failed.value.error
    pinned(all(hasattr(error, name) for name in ("message", "cls_name", "cause")), "SerializableErrorInfo's fields")
    assert "ModuleNotFoundError" in _root_cause(error) or "No module named" in _root_cause(error)


def test_the_dequeue_iteration_honours_the_tag_limits(
    instance: dg.DagsterInstance, workspace: internals.WorkspaceProcessContext
) -> None:
    pinned(isinstance(instance.run_coordinator, dg.QueuedRunCoordinator), "dg.QueuedRunCoordinator from dagster.yaml")
    kwargs: dict[str, Any] = {"location_name": LOCATION, "job_name": "pin_job", "run_config": {}}
    same = [internals.submit_job_run(instance, workspace, tags={TAG: "t1"}, **kwargs) for _ in range(2)]
    other = internals.submit_job_run(instance, workspace, tags={TAG: "t2"}, **kwargs)
    dequeuer = internals.RunDequeuer()
    try:
        dequeuer.run_iteration(workspace)
    finally:
        dequeuer.close()

    def status(run_id: str) -> dg.DagsterRunStatus:
        run = instance.get_run_by_id(run_id)
        assert run is not None
        return run.status

    launched = instance.run_launcher.queue()  # type: ignore[attr-defined]
    pinned(
        sorted(status(run_id) == dg.DagsterRunStatus.QUEUED for run_id in same) == [False, True],
        "the dequeue iteration: one run per tag value (tag_concurrency_limits)",
    )
    pinned(status(other) != dg.DagsterRunStatus.QUEUED, "the dequeue iteration: another tag value is launched")
    pinned(len(launched) == 2, "the dequeue iteration launches through the instance's run launcher")


def test_the_queued_run_daemon_heartbeat() -> None:
    from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon
    from dagster._daemon.types import DaemonHeartbeat

    pinned(QueuedRunCoordinatorDaemon.daemon_type() == internals.QUEUED_RUN_DAEMON, "the run queue daemon's type")
    pinned(accepts(QueuedRunCoordinatorDaemon, interval_seconds=1), "QueuedRunCoordinatorDaemon(interval_seconds=)")
    with dg.instance_for_test() as test_instance:
        assert internals.queued_run_daemon_heartbeat(test_instance) is None
        now = time.time()
        test_instance.add_daemon_heartbeat(DaemonHeartbeat(now, internals.QUEUED_RUN_DAEMON, "pin", None))
        pinned(internals.queued_run_daemon_heartbeat(test_instance) == now, "get_daemon_heartbeats")


def test_the_instance_names_its_postgres_run_storage() -> None:
    """The lease's database (defs/runs/executors.py): DagsterInstance.run_storage and dagster-postgres'
    postgres_url attribute; any other storage has no lease."""
    from dagster_postgres import PostgresRunStorage

    pinned(
        isinstance(inspect.getattr_static(dg.DagsterInstance, "run_storage"), property), "DagsterInstance.run_storage"
    )
    pinned("self.postgres_url = postgres_url" in inspect.getsource(PostgresRunStorage.__init__), "postgres_url")
    with dg.instance_for_test() as test_instance:
        assert internals.instance_conninfo(test_instance) is None


def test_holding_connections_is_the_webservers_pool_on_each_postgres_storage() -> None:
    """hold_connections: DagsterInstance.optimize_for_webserver with its keywords, which each
    dagster-postgres storage answers with an engine that keeps a connection; any other storage is left."""
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage, PostgresScheduleStorage

    pinned(
        accepts(dg.DagsterInstance.optimize_for_webserver, None, statement_timeout=0, pool_recycle=1, max_overflow=1),
        "DagsterInstance.optimize_for_webserver(statement_timeout=, pool_recycle=, max_overflow=)",
    )
    for storage in (PostgresRunStorage, PostgresEventLogStorage, PostgresScheduleStorage):
        source = inspect.getsource(storage.optimize_for_webserver)
        pinned('"pool_size": 1' in source and "self._engine = " in source, f"{storage.__name__}.optimize_for_webserver")
    with dg.instance_for_test() as test_instance:
        internals.hold_connections(test_instance)  # SQLite: nothing to hold, and no error


def test_the_shipped_storage_shares_an_engine_built_as_dagster_postgres_builds_its_own() -> None:
    """HeldPostgresStorage: dagster-postgres' helpers make the engine from the storage's config, and
    each storage reaches the database only through its `_engine`, which the engine replaces."""
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage, PostgresScheduleStorage, utils

    config = {"postgres_url": "postgresql+psycopg2://postgres@/dagster?host=%2Ftmp"}
    pinned(utils.pg_url_from_config(config) == config["postgres_url"], "dagster_postgres.utils.pg_url_from_config")
    pinned(utils.get_token_provider_from_config(config) is None, "utils.get_token_provider_from_config")
    pinned(accepts(utils.create_pg_engine, "url", None, pool_size=1), "dagster_postgres.utils.create_pg_engine")
    pinned(accepts(utils.set_pg_statement_timeout, None, 0), "dagster_postgres.utils.set_pg_statement_timeout")
    for storage, method in (
        (PostgresRunStorage, PostgresRunStorage.connect),
        (PostgresEventLogStorage, PostgresEventLogStorage._connect),
        (PostgresScheduleStorage, PostgresScheduleStorage.connect),
    ):
        pinned("create_pg_connection(self._engine)" in inspect.getsource(method), f"{storage.__name__} connects")
        init = inspect.getsource(storage.__init__)
        made = "self._engine = " in init and "if self.should_autocreate_tables:" in init
        pinned(made, f"{storage.__name__}.__init__")


def test_reading_a_run_from_the_event_log() -> None:
    """What materialize.py reads from the instance (not public methods: all_logs, get_records_for_run,
    DagsterEvent.event_specific_data), through its own readers."""
    from memory_pipelines.launch.materialize import _RunBars, read_run

    with dg.instance_for_test() as test_instance:
        good = dg.materialize([first, first_checked], instance=test_instance, selection=[first, first_checked])
        outcome = read_run(test_instance, good.run_id)
        pinned(outcome.success and outcome.assets == {"first": {"rows": 3}}, "a materialization's metadata")
        pinned(outcome.checks == {"first_checked": {"passed": False, "severity": "WARN"}}, "a check evaluation")
        pinned("first" in outcome.outputs, "a step output")
        bad = dg.materialize([broken], instance=test_instance, raise_on_error=False)
        failed = read_run(test_instance, bad.run_id)
        pinned(
            failed.failures == [{"step": "broken", "error": "broken on purpose", "resources": False}],
            "a failed step's error (SerializableErrorInfo.message/cls_name/cause)",
            failed.failures,
        )
        terminal = io.StringIO()
        bars = _RunBars(test_instance, [good.run_id], terminal)
        try:
            bars.update()
        finally:
            bars.close()
        task = bars.bars.tasks[bars.tasks[good.run_id]]
        pinned(task.fields["doing"] == "done" and task.completed == task.total, "get_records_for_run's event records")


# -- definitions: sensors and checks -----------------------------------------------------------


def test_backfill_request_is_a_backfill_of_each_asset_partition() -> None:
    graph = pin_defs.get_repository_def().asset_graph  # what a sensor's context.repository_def holds
    keys = [dg.AssetKey("per_tenant"), dg.AssetKey("per_tenant_derived")]
    request = internals.backfill_request(graph, keys, "t1", tags={TAG: "t1"})
    pinned(isinstance(request, dg.RunRequest), "RunRequest.for_asset_graph_subset")
    pinned(request.requires_backfill_daemon(), "a RunRequest with an asset graph subset is a backfill")
    subset = request.asset_graph_subset
    assert subset is not None
    pinned(
        {key: sorted(s.get_partition_keys()) for key, s in subset.partitions_subsets_by_asset_key.items()}
        == {key: ["t1"] for key in keys},
        "AssetGraphSubset.from_asset_partition_set",
    )
    pinned(request.tags == {TAG: "t1"}, "the backfill request's tags")


def test_check_target_is_what_a_check_evaluation_takes() -> None:
    with dg.instance_for_test() as test_instance:
        dg.materialize([first], instance=test_instance)
        [record] = test_instance.fetch_materializations(dg.AssetKey("first"), limit=1).records
        target = internals.check_target(record)
        evaluation = dg.AssetCheckEvaluation(
            asset_key=dg.AssetKey("first"),
            check_name="first_checked",
            passed=True,
            target_materialization_data=target,
            partition=None,
        )
    pinned(evaluation.target_materialization_data == target, "AssetCheckEvaluation(target_materialization_data=)")
    pinned((target.storage_id, target.run_id) == (record.storage_id, record.run_id), "the target's fields")
    pinned(
        accepts(dg.AssetCheckEvaluation, asset_key=dg.AssetKey("a"), check_name="c", passed=True, partition="t"),
        "AssetCheckEvaluation(partition=)",
    )


def test_the_code_server_client_calls_the_warm_server_makes() -> None:
    from dagster._grpc.__generated__ import dagster_api_pb2
    from dagster._grpc.client import DagsterGrpcClient
    from dagster._grpc.types import GetCurrentRunsResult

    pinned(accepts(DagsterGrpcClient, socket="/tmp/x.sock"), "DagsterGrpcClient(socket=)")
    query = DagsterGrpcClient._query
    pinned(accepts(query, None, "Heartbeat", dagster_api_pb2.PingRequest, timeout=5, echo=""), "_query's keywords")
    pinned(hasattr(dagster_api_pb2, "Empty") and hasattr(dagster_api_pb2, "PingRequest"), "the request types")
    pinned(GetCurrentRunsResult(current_runs=["r"], serializable_error_info=None).current_runs == ["r"], "runs result")
    # A server that is not there raises, as the warm server's liveness check expects.
    with pytest.raises(Exception):  # noqa: B017 - grpc's own error types
        internals.grpc_heartbeat(Path("/nonexistent/mp-test.sock"), timeout=1)


def test_a_code_server_starts_its_run_workers_from_the_context_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging
    import multiprocessing
    import threading

    from dagster._core.utils import FuturesAwareThreadPoolExecutor
    from dagster._grpc.server import DagsterApiServer

    def server() -> Any:
        with FuturesAwareThreadPoolExecutor(max_workers=1) as pool:
            made = DagsterApiServer(
                server_termination_event=threading.Event(),
                logger=logging.getLogger("test"),
                server_threadpool_executor=pool,
            )
            made._server_termination_event.set()  # ends its heartbeat and cleanup threads
            return made

    pinned(server()._mp_ctx.get_start_method() == "spawn", "DagsterApiServer._mp_ctx (spawn)")
    monkeypatch.setattr(DagsterApiServer, "__init__", DagsterApiServer.__init__)  # put back after the test
    forkserver = multiprocessing.get_context("forkserver")
    internals.start_run_workers_from(forkserver)
    pinned(server()._mp_ctx is forkserver, "DagsterApiServer._mp_ctx, set after __init__")
