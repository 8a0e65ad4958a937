"""The one module that uses Dagster's private API. tests/unit/test_dagster_internals.py pins each
thing used here (names, signatures, constructor keywords, and what they do where that is cheap), so
a Dagster upgrade that changes one fails there first, naming it. Checked against dagster 1.13.27.

Private, and why no public API does the job:

- `dagster._core.workspace.context.WorkspaceProcessContext` and
  `dagster._core.workspace.load_target.WorkspaceFileTarget`: load workspace.yaml's code location in
  a code server, as `dagster job launch -w workspace.yaml` does. The public ways to run a job
  (`dg.materialize`, `dg.execute_job`) run it in this process, with no code location origin and
  no run coordinator; the GraphQL client needs a running webserver.
- `dagster._core.definitions.selector.JobSubsetSelector`, with `CodeLocation.get_job` /
  `get_execution_plan` and `DagsterInstance.create_run` / `submit_run` (not public methods): create
  and submit a run of the code location's job with an asset subset, as the CLI's own `_create_run`
  (dagster/_cli/job.py) does. `dg.JobSelector` has no asset selection and the code location takes
  only a JobSubsetSelector.
- `dagster._daemon.run_coordinator.queued_run_coordinator_daemon.QueuedRunCoordinatorDaemon`, and
  `DagsterInstance.get_daemon_heartbeats` (not public) with its daemon type: run the daemon's own
  dequeue iteration (tag concurrency limits, max_concurrent_runs) from a CLI process when no
  dagster-daemon is running; nothing public dequeues a queued run.
- `dagster._core.definitions.assets.graph.asset_graph_subset.AssetGraphSubset`,
  `dagster._core.definitions.events.AssetKeyPartitionKey` and `dg.RunRequest.for_asset_graph_subset`:
  a sensor's request that the sensor daemon turns into an asset backfill. Dagster keeps that
  constructor private on purpose ("AssetGraphSubset is not part of the public API") and has no
  public backfill request.
- `dagster._grpc.client.DagsterGrpcClient`: the heartbeat that keeps the CLI's warm code server
  (code_server.py) alive between commands, and the runs whose processes it still tracks; no public
  client of a code server exists.
- `dagster._grpc.server.DagsterApiServer._mp_ctx`: the multiprocessing context the code server starts
  each run worker from. Dagster fixes it to "spawn", so every run imports Dagster and the definitions
  anew; the CLI's warm code server (serve_code.py) sets a fork server that has imported them once.
- `DagsterInstance.run_storage` and dagster-postgres' `PostgresRunStorage.postgres_url` (neither
  documented): the database a run worker takes its lease on (lib/infra/leases.py), which every
  process sharing the instance can reach; the instance exposes no connection of its own.
- `DagsterInstance.optimize_for_webserver` and the same method of each dagster-postgres storage
  (not documented): what the webserver calls so that each storage keeps a connection;
  `hold_connections` calls it for a CLI command and a run worker of any other dagster.yaml.
  dagster-postgres opens a connection per call otherwise, and no setting of `storage: postgres:` chooses.
- The `_engine` of each dagster-postgres storage, and `create_pg_engine`, `pg_url_from_config`,
  `get_token_provider_from_config` and `set_pg_statement_timeout` of `dagster_postgres.utils`:
  every instance of the shipped dagster.yaml that a process opens (a code server opens one for each
  sensor tick and run) shares one engine, made as dagster-postgres makes its own but with a pool
  (`HeldPostgresStorage`); each instance opened ten connections before. No public way gives a
  storage its engine.
- `dagster._core.storage.base_storage.DagsterStorage` and `dagster._serdes.ConfigurableClass` /
  `ConfigurableClassData`: the bases of a storage that dagster.yaml's `storage: custom:` names
  (`HeldPostgresStorage`); Dagster documents the block but exports neither base.
- `dagster._core.definitions.asset_checks.asset_check_evaluation.AssetCheckEvaluationTargetMaterializationData`:
  the `target_materialization_data` of the public `dg.AssetCheckEvaluation`. An evaluation reported
  outside the check's own step shows in the UI only when it targets the partition's latest
  materialization, and the type is not exported.

Replaced by public API: `dagster._core.run_coordinator.QueuedRunCoordinator` is `dg.QueuedRunCoordinator`;
`dagster._utils.tags.normalize_tags` was a no-op here (every tag is already a string);
`dagster.version.__version__` is `dg.__version__`. materialize.py also reads runs' event logs with
`DagsterInstance.all_logs` / `get_records_for_run` and `DagsterEvent.event_specific_data`, not marked
public but methods of public classes with no public per-run equivalent; the test pins those too.

Imports: the definition-time names are loaded by `import dagster` anyway and are imported at the top.
The workspace and daemon machinery is slow to import and is imported only inside the functions
that use it; materialize.py imports this module only where it launches runs (CLI commands that
launch nothing do not load dagster at all).
"""

from __future__ import annotations

import functools
import json
import os
import time
import weakref
from collections.abc import Iterable, Mapping
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData as AssetCheckEvaluationTargetMaterializationData,
)
from dagster._core.definitions.assets.graph.asset_graph_subset import AssetGraphSubset
from dagster._core.definitions.events import AssetKeyPartitionKey
from dagster._core.definitions.selector import JobSubsetSelector
from dagster._core.storage.base_storage import DagsterStorage
from dagster._serdes import ConfigurableClass, ConfigurableClassData

if TYPE_CHECKING:
    from dagster._core.definitions.assets.graph.base_asset_graph import BaseAssetGraph
    from dagster._core.workspace.context import WorkspaceProcessContext as WorkspaceProcessContext
    from dagster_postgres import DagsterPostgresStorage

# QueuedRunCoordinatorDaemon.daemon_type(): the key of its heartbeat (the test pins it), known here
# without importing the daemon machinery.
QUEUED_RUN_DAEMON = "QUEUED_RUN_COORDINATOR"


# -- runs launched through the workspace (materialize.py) --------------------------------------


def grpc_heartbeat(socket: Path, timeout: int = 5) -> None:
    """Send a code server on a Unix socket the heartbeat that keeps it alive (code_server.py);
    raises when it does not answer within `timeout` seconds. `DagsterGrpcClient` is private; the
    public API has no client of a code server."""
    from dagster._grpc.__generated__ import dagster_api_pb2
    from dagster._grpc.client import DagsterGrpcClient

    DagsterGrpcClient(socket=str(socket))._query("Heartbeat", dagster_api_pb2.PingRequest, timeout=timeout, echo="")


def grpc_current_runs(socket: Path, timeout: int = 5) -> set[str]:
    """The runs whose processes a code server on a Unix socket still tracks (it forgets one once its
    process has exited)."""
    from dagster._grpc.__generated__ import dagster_api_pb2
    from dagster._grpc.client import DagsterGrpcClient
    from dagster._grpc.types import GetCurrentRunsResult
    from dagster_shared.serdes import deserialize_value

    reply = DagsterGrpcClient(socket=str(socket))._query("GetCurrentRuns", dagster_api_pb2.Empty, timeout=timeout)
    return set(deserialize_value(reply.serialized_current_runs, GetCurrentRunsResult).current_runs)


class CodeLocationLoadError(Exception):
    """The code location failed to load; `error` is Dagster's SerializableErrorInfo (message,
    cls_name, cause)."""

    def __init__(self, location_name: str, error: Any) -> None:
        super().__init__(f"{location_name} failed to load")
        self.location_name = location_name
        self.error = error


def open_workspace(
    instance: dg.DagsterInstance, workspace_file: Path, code_server_log_level: str = "WARNING"
) -> WorkspaceProcessContext:
    """The workspace of workspace.yaml (its code locations in code servers it starts); enter it
    with `with`, and leaving it shuts them down."""
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import WorkspaceFileTarget

    return WorkspaceProcessContext(
        instance=instance,
        version=dg.__version__,
        read_only=False,
        workspace_load_target=WorkspaceFileTarget(paths=[str(workspace_file)]),
        code_server_log_level=code_server_log_level,
    )


def submit_job_run(
    instance: dg.DagsterInstance,
    context: WorkspaceProcessContext,
    *,
    location_name: str,
    job_name: str,
    run_config: Mapping[str, Any],
    tags: Mapping[str, str],
    asset_keys: Iterable[dg.AssetKey] = (),
) -> str:
    """Create a run of the location's job as `dagster job launch` does (dagster/_cli/job.py
    `_create_run`), with `tags` over the job's own and optionally a subset of its assets, and
    submit it to the instance's run coordinator. Returns its run id.

    Raises CodeLocationLoadError when the location failed to load."""
    workspace = context.create_request_context()
    error = workspace.get_code_location_error(location_name)
    if error is not None:
        raise CodeLocationLoadError(location_name, error)
    location = workspace.get_code_location(location_name)
    repository = next(iter(location.get_repositories().values()))
    keys = frozenset(asset_keys) or None
    selector = JobSubsetSelector(
        location_name=location.name,
        repository_name=repository.name,
        job_name=job_name,
        op_selection=None,
        asset_selection=keys,
    )
    remote_job = location.get_job(selector)
    plan = location.get_execution_plan(
        remote_job, run_config, step_keys_to_execute=None, known_state=None, instance=instance
    ).execution_plan_snapshot
    run = instance.create_run(
        job_name=job_name,
        run_id=None,
        run_config=run_config,
        resolved_op_selection=remote_job.resolved_op_selection,
        step_keys_to_execute=plan.step_keys_to_execute,
        op_selection=None,
        status=None,
        root_run_id=None,
        parent_run_id=None,
        tags={**remote_job.tags, **tags},
        job_snapshot=remote_job.job_snapshot,
        execution_plan_snapshot=plan,
        parent_job_snapshot=remote_job.parent_job_snapshot,
        remote_job_origin=remote_job.get_remote_origin(),
        job_code_origin=remote_job.get_python_origin(),
        asset_selection=keys,
        asset_check_selection=remote_job.asset_check_selection if keys else None,
        asset_graph=repository.asset_graph,
    )
    instance.submit_run(run.run_id, workspace)
    return run.run_id


def queued_run_daemon_heartbeat(instance: dg.DagsterInstance) -> float | None:
    """When a dagster-daemon's run queue last said it was alive (a timestamp), or None: never."""
    heartbeat = instance.get_daemon_heartbeats().get(QUEUED_RUN_DAEMON)
    return None if heartbeat is None else float(heartbeat.timestamp)


def instance_conninfo(instance: dg.DagsterInstance) -> str | None:
    """A libpq URL of the instance's PostgreSQL run storage, or None for any other storage (the
    in-memory instance of `execute_in_process`, a SQLite one)."""
    from memory_pipelines.lib.infra.leases import libpq_url

    url = getattr(instance.run_storage, "postgres_url", None)
    return libpq_url(url) if isinstance(url, str) else None


# Connections beyond those kept (one per storage by `hold_connections`, HELD_POOL by a
# `HeldPostgresStorage`'s engine), while that many calls use them at once (far more than a command
# or run worker makes; each is closed when returned). A kept one is replaced after an hour.
HELD_OVERFLOW = 32
HELD_RECYCLE_SECONDS = 3600
# What the engine of a `HeldPostgresStorage` keeps: a connection for each of its parts in use at once.
HELD_POOL = 3
RETURNED = "memory_pipelines.returned"  # the key of that moment in a pool record's `info`
# Storages of this process that keep their connections already (`hold_connections` leaves them).
HELD_STORAGES: weakref.WeakSet[Any] = weakref.WeakSet()
# The engine every instance of one storage config shares (`held_engine`), by process: a forked
# child never uses its parent's connections. A code server opens an instance for each sensor tick.
HELD_ENGINES: dict[tuple[int, str], Any] = {}
# In milliseconds; the server's value for this role and database.
TIMEOUT_SETTING = "SELECT setting::int FROM pg_catalog.pg_settings WHERE name = %s"


def hold_connections(instance: dg.DagsterInstance) -> None:
    """Each of the instance's PostgreSQL storages keeps one connection open for this process,
    instead of opening one per call (dagster-postgres' default: about 110 for a CLI's small
    `materialize` and 200 for its run worker, each a new server process). Dagster sets a statement
    timeout on each connection it pools: the one the server gives this role and database, as before.
    Nothing changes for any other storage, nor for storages that hold them already (an instance of
    the dagster.yaml we ship, `HeldPostgresStorage`)."""
    conninfo = instance_conninfo(instance)
    if conninfo is None or instance.run_storage in HELD_STORAGES:
        return
    instance.optimize_for_webserver(
        statement_timeout=server_statement_timeout(conninfo),
        pool_recycle=HELD_RECYCLE_SECONDS,
        max_overflow=HELD_OVERFLOW,
    )


def held_engine(config_value: Mapping[str, Any]) -> Any:
    """The engine the three parts of a dagster-postgres storage of this config share in this
    process: it keeps up to HELD_POOL connections and sets on each the statement timeout the server
    gives this role and database, as the webserver's pool does. A process keeps it for its life and
    the server may restart meanwhile, so a connection idle for IDLE_PING_SECONDS (the memory store's
    pool's too) is pinged before it is handed out, and replaced if the ping fails (a ping before
    every call cost a third more)."""
    from dagster_postgres.utils import (
        create_pg_engine,
        get_token_provider_from_config,
        pg_url_from_config,
        set_pg_statement_timeout,
    )
    from sqlalchemy import event
    from sqlalchemy.engine import make_url

    from memory_pipelines.lib.infra.leases import libpq_url

    url = pg_url_from_config(config_value)
    timeout_ms = server_statement_timeout(libpq_url(url))
    options = make_url(url).query.get("options")
    engine = create_pg_engine(
        url,
        get_token_provider_from_config(config_value),
        isolation_level="AUTOCOMMIT",
        pool_size=HELD_POOL,
        max_overflow=HELD_OVERFLOW,
        pool_recycle=HELD_RECYCLE_SECONDS,
        **({"connect_args": {"options": options}} if options else {}),
    )
    event.listen(engine, "connect", lambda connection, _: set_pg_statement_timeout(connection, timeout_ms))
    event.listen(engine, "checkin", returned)
    event.listen(engine, "checkout", ping_if_idle)
    return engine


def returned(connection: Any, record: Any) -> None:
    """When a held connection went back to its pool (a pool event)."""
    record.info[RETURNED] = time.monotonic()


def ping_if_idle(connection: Any, record: Any, proxy: Any) -> None:
    """Ping a held connection idle for IDLE_PING_SECONDS as the pool hands it out; a failed ping
    makes the pool replace it (SQLAlchemy's DisconnectionError, a pool event)."""
    from sqlalchemy.exc import DisconnectionError

    from memory_pipelines.lib.memories.connections import IDLE_PING_SECONDS

    since = record.info.get(RETURNED)
    if since is None or time.monotonic() - since < IDLE_PING_SECONDS:
        return
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # whatever the driver raises for a connection the server closed
        raise DisconnectionError(str(exc)) from exc


def server_statement_timeout(conninfo: str) -> int:
    """The statement timeout the server gives this role and database, in milliseconds."""
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(TIMEOUT_SETTING, ("statement_timeout",)).fetchone()
    return int(row[0]) if row else 0


class HeldPostgresStorage(DagsterStorage, ConfigurableClass):
    """The storage of the dagster.yaml we ship (`storage: custom:`, with the config of `storage:
    postgres:`): dagster-postgres' own storage, whose three parts keep their connections in every
    process that opens the instance (the daemon, its code servers and run workers, `dagster`
    commands and ours), in one engine that every instance of the config in the process shares
    (`held_engine`). A forked child makes its own, so each pool is its own process's."""

    def __init__(self, postgres: DagsterPostgresStorage, *, inst_data: ConfigurableClassData | None = None) -> None:
        self.postgres = postgres
        self.config_data = inst_data
        super().__init__()

    @property
    def inst_data(self) -> ConfigurableClassData | None:
        return self.config_data

    @classmethod
    def config_type(cls) -> Any:
        from dagster_postgres import DagsterPostgresStorage

        return DagsterPostgresStorage.config_type()

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData | None, config_value: Any) -> HeldPostgresStorage:
        from dagster_postgres import DagsterPostgresStorage

        key = (os.getpid(), json.dumps(config_value, sort_keys=True, default=str))
        engine = HELD_ENGINES.get(key)
        # Only the process's first instance of this config looks for the tables (or makes them).
        config: Any = config_value if engine is None else {**config_value, "should_autocreate_tables": False}
        postgres = DagsterPostgresStorage.from_config_value(None, config)
        if engine is None:  # two threads may both make one and the first kept wins: no lock a fork could inherit held
            engine = HELD_ENGINES.setdefault(key, held_engine(config_value))
        parts: tuple[Any, ...] = (postgres.run_storage, postgres.event_log_storage, postgres.schedule_storage)
        for part in parts:
            part._engine = engine
            HELD_STORAGES.add(part)
        return cls(postgres, inst_data=inst_data)

    @property
    def event_log_storage(self) -> Any:
        return self.postgres.event_log_storage

    @property
    def run_storage(self) -> Any:
        return self.postgres.run_storage

    @property
    def schedule_storage(self) -> Any:
        return self.postgres.schedule_storage


class RunDequeuer:
    """The dagster-daemon's QueuedRunCoordinatorDaemon, for its dequeue iteration run from this
    process: it launches the queued runs the instance's limits allow. It assumes it is the only
    dequeuer; the caller makes sure of that."""

    def __init__(self) -> None:
        from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon

        self._daemon = QueuedRunCoordinatorDaemon(interval_seconds=1)

    def run_iteration(self, context: WorkspaceProcessContext) -> None:
        for _ in self._daemon.run_iteration(context):
            pass

    def close(self) -> None:
        self._daemon.__exit__(None, None, None)


# -- the warm code server's run workers (serve_code.py) ---------------------------------------


def start_run_workers_from(context: BaseContext) -> None:
    """Every code server made in this process starts its run workers from `context`.

    Dagster's gRPC server starts each run in a fresh interpreter (`multiprocessing.get_context("spawn")`,
    kept as `DagsterApiServer._mp_ctx`), which imports Dagster and the definitions again for every
    run; no public setting chooses another start method."""
    from dagster._grpc.server import DagsterApiServer

    made = DagsterApiServer.__init__

    @functools.wraps(made)
    def __init__(self: DagsterApiServer, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        self._mp_ctx = context  # type: ignore[assignment]  # typed as spawn's; forkserver's has the same Process, Queue, Event

    DagsterApiServer.__init__ = __init__  # type: ignore[method-assign]


# -- definitions: sensors and checks -----------------------------------------------------------


def backfill_request(
    asset_graph: BaseAssetGraph, asset_keys: Iterable[dg.AssetKey], partition_key: str, tags: Mapping[str, str]
) -> dg.RunRequest:
    """A sensor's RunRequest that the sensor daemon launches as one asset backfill (listed under
    Backfills) of `partition_key` of each asset, in the tick that stores the sensor's cursor."""
    wanted = {AssetKeyPartitionKey(key, partition_key) for key in asset_keys}
    subset = AssetGraphSubset.from_asset_partition_set(wanted, asset_graph)
    return dg.RunRequest.for_asset_graph_subset(subset, tags=tags)


def check_target(record: dg.EventLogRecord) -> AssetCheckEvaluationTargetMaterializationData:
    """A materialization's record, as the `target_materialization_data` of a dg.AssetCheckEvaluation."""
    return AssetCheckEvaluationTargetMaterializationData(
        storage_id=record.storage_id, run_id=record.run_id, timestamp=record.timestamp
    )
