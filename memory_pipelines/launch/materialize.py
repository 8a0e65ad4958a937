"""Submits the CLI's and the demo's runs through the Dagster instance, as `dagster job launch -w
workspace.yaml` does: the job comes from the project's code location, so every run carries its
origin (job pages list it, re-execution works) and goes through the instance's run coordinator.

With a QueuedRunCoordinator the run waits in the queue under the instance's tag concurrency limits
(one run per tenant and per partition). A running dagster-daemon dequeues it; without one (plain
CLI use) this process runs the daemon's own dequeue iteration while it waits, one process at a
time, so the limits hold across CLI processes too. Results are read back from the instance's event
log: materialization metadata per asset, asset check evaluations, and the failed steps' root causes.

Output: the code server and run workers print Dagster's event log. With --verbose (ENV_VERBOSE) it
goes to stderr; otherwise to HOME/logs/cli-runs.log, and when stderr is a terminal this process
draws a progress bar per run from the run's event log (steps done, and the library's `progress:`
lines of the step running).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import psycopg

from memory_pipelines.launch.code_server import LOCATION, launch_variables, run_log
from memory_pipelines.lib.infra import progress
from memory_pipelines.lib.infra.children import children_isolated
from memory_pipelines.lib.infra.errors import (
    MemoryPipelinesError,
    ServiceError,
    ValidationError,
    exhausted,
    names_exhaustion,
)
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores import registry

if TYPE_CHECKING:
    from dagster import DagsterInstance, DagsterRun

    from memory_pipelines.launch.code_server import WarmServer
    from memory_pipelines.launch.dagster_internals import WorkspaceProcessContext
    from memory_pipelines.lib.infra.processes import Proc

# `memories` and every registered store's asset (stores/<store>/spec.py).
ALL_ASSETS = ("memories", *(spec.asset for spec in registry.stores() if spec.asset))
PARTITION_TAG = "dagster/partition"
TENANT_TAG = "memory_pipelines/tenant"
# The asset jobs' default executor starts a process per step, each loading the code location and
# the embedding model again; one tenant's steps run in the run worker instead (5x faster here).
IN_PROCESS: dict[str, Any] = {"execution": {"config": {"in_process": {}}}}
# A daemon heartbeats every 30 s; older than this and nobody else will dequeue our run.
DAEMON_FRESH_SECONDS = 60.0
POLL_SECONDS = 0.25
# Well inside the warm code server's idle time (code_server.py), so it never ends under a waiting command.
HEARTBEAT_SECONDS = 10.0
# A closed workspace's code server ends within a second or two of its last run's process.
CODE_SERVER_EXIT_SECONDS = 30.0
# Any constant: it only has to be the same in every CLI process dequeuing runs of this database.
DEQUEUE_LOCK = 7_150_433_211


@dataclass
class RunOutcome:
    """What one finished run left in the instance's event log (counts and ids only, no text)."""

    run_id: str
    status: str
    partition: str | None
    assets: dict[str, dict[str, Any]] = field(default_factory=dict)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def success(self) -> bool:
        return self.status == "SUCCESS"


@dataclass(frozen=True)
class Launch:
    """One run to submit: job, partition ("" for an unpartitioned job), run config, and optionally a
    subset of its assets."""

    job_name: str
    partition: str
    run_config: dict[str, Any] = field(default_factory=dict)
    assets: tuple[str, ...] = ()
    tenant: str | None = None
    tags: tuple[tuple[str, str], ...] = ()


# -- the workspace and the run queue -----------------------------------------------------------


_run_log: Path | None = None


def verbose() -> bool:
    """--verbose: Dagster's event log and library warnings on stderr, no progress bar."""
    return os.environ.get(progress.ENV_VERBOSE) == "1"


@contextmanager
def _children_output(settings: Settings) -> Iterator[tuple[TextIO, bool]]:
    """The code server and run workers inherit fds 1 and 2 and log to them; the CLI's stdout is one
    JSON document. For as long as they may start, fd 1 is stderr (--verbose) or both are the run log
    under HOME. Yields a copy of the real stderr, for this command's own notes, and whether it is a
    terminal to draw progress on."""
    global _run_log
    sys.stdout.flush()
    sys.stderr.flush()
    if verbose():
        saved = os.dup(1)
        os.dup2(2, 1)
        try:
            yield sys.stderr, False
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        return
    log = run_log(settings)
    terminal = os.isatty(2)
    saved_out, saved_err = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _run_log = log
    stream = os.fdopen(os.dup(saved_err), "w", encoding="utf-8", errors="replace", buffering=1)
    try:
        yield stream, terminal
    finally:
        stream.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)


@dataclass
class _Workspace:
    instance: DagsterInstance
    context: WorkspaceProcessContext
    conninfo: str
    stderr: TextIO  # the command's own stderr, whatever the children's output became
    terminal: bool  # whether progress bars are drawn on it
    server: WarmServer | None  # None: a code server of this command's own


@contextmanager
def _workspace(settings: Settings) -> Iterator[_Workspace]:
    """The instance, the project's code location (in the HOME's warm code server, code_server.py), the
    store's conninfo and the terminal to draw progress on.

    With --verbose, or where no warm server can be had, the code location gets a code server of its
    own, whose output is this command's; then this returns only once that server has ended, and the
    run workers with it."""
    import dagster as dg

    from memory_pipelines.launch.code_server import module_workspace, warm_server
    from memory_pipelines.launch.dagster_internals import hold_connections, open_workspace
    from memory_pipelines.lib.infra.services import ensure_services

    endpoints = ensure_services(settings)  # the embedded server and dagster.yaml, on a fresh HOME too
    os.environ.update(launch_variables(settings))
    with _children_output(settings) as (stderr, terminal), dg.DagsterInstance.get() as instance:
        hold_connections(instance)  # it reads the run's state every POLL_SECONDS while it waits
        warm = None if verbose() else warm_server(settings, log=run_log(settings))
        if warm is not None:
            with open_workspace(instance, warm.workspace_file, code_server_log_level="WARNING") as context:
                yield _Workspace(instance, context, endpoints.store_conninfo, stderr, terminal, warm)
            return
        before = {proc.pid for proc in _code_servers()}
        owned: list[Proc] = []
        try:
            # The code server starts in here, from our working directory; its run workers inherit its environment.
            with _sigint_not_ignored(), children_isolated():
                workspace = open_workspace(instance, module_workspace(settings), code_server_log_level="WARNING")
            with workspace as context:
                owned = [proc for proc in _code_servers() if proc.pid not in before]
                try:
                    yield _Workspace(instance, context, endpoints.store_conninfo, stderr, terminal, None)
                finally:
                    owned = _with_descendants(owned)  # the run workers, while they are still the server's children
        finally:
            if not owned:  # the workspace failed to open: a server that did start is ours all the same
                owned = _with_descendants([proc for proc in _code_servers() if proc.pid not in before])
            _await_code_servers(owned)


@contextmanager
def _sigint_not_ignored() -> Iterator[None]:
    """Python's own SIGINT handling meanwhile, when this process ignores SIGINT (a shell's background
    job does). A Dagster code server gives SIGTERM SIGINT's disposition (dagster/_utils/interrupts.py),
    and an ignored one survives exec: started now, it ends on SIGTERM instead of ignoring it."""
    if (
        signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _code_servers() -> list[Proc]:
    """This process's children that are Dagster code servers (`dagster api grpc`: the workspace starts them)."""
    from memory_pipelines.lib.infra.processes import is_dagster_process, processes

    mine = (proc for proc in processes() if proc.ppid == os.getpid() and is_dagster_process(proc))
    return [proc for proc in mine if "grpc" in proc.args]


def _with_descendants(procs: Sequence[Proc]) -> list[Proc]:
    from memory_pipelines.lib.infra.processes import descendants, processes

    table = processes()
    return [*procs, *(child for proc in procs for child in descendants(proc.pid, table))]


def _await_code_servers(procs: Sequence[Proc]) -> None:
    """Wait for the closed workspace's code servers and their run workers to end.

    Closing the workspace asks each server to shut down, and it does once its runs' processes
    have ended, after reading their runs from the instance's database; Dagster does not wait for
    that. A `stop` right after this command would end PostgreSQL under it, and a code server
    that cannot reach the database then never exits, SIGTERM included (its cleanup thread dies).
    So this process returns only once they have ended, ending them itself after a timeout."""
    from memory_pipelines.lib.infra.processes import end_processes, wait_for_exit

    left = wait_for_exit(procs, CODE_SERVER_EXIT_SECONDS)
    if left:  # said in the run log (stderr is the log here), where the servers' own errors are
        pids = [proc.pid for proc in left]
        sys.stderr.write(f"code server processes {pids} still ran {CODE_SERVER_EXIT_SECONDS:.0f}s on; ending them\n")
        end_processes(left, timeout=5.0)


def _create_run(instance: DagsterInstance, context: WorkspaceProcessContext, launch: Launch) -> str:
    """Create and submit the run as `dagster job launch` does, plus an asset subset and the
    partition and tenant tags the coordinator's concurrency limits key on."""
    import dagster as dg

    from memory_pipelines.launch.dagster_internals import CodeLocationLoadError, submit_job_run

    tags = dict(launch.tags)
    if launch.partition:  # an unpartitioned job (the canary drill) gets no partition tag at all
        tags[PARTITION_TAG] = launch.partition
    if launch.tenant is not None:
        tags[TENANT_TAG] = launch.tenant
    try:
        return submit_job_run(
            instance,
            context,
            location_name=LOCATION,
            job_name=launch.job_name,
            run_config=launch.run_config,
            tags=tags,
            asset_keys=[dg.AssetKey(name) for name in launch.assets],
        )
    except CodeLocationLoadError as failed:  # the definitions failed to import: say why in one line, not a traceback
        raise ServiceError("code_location", f"{LOCATION} failed to load: {_root_cause(failed.error)}") from None


def _daemon_dequeues(instance: DagsterInstance) -> bool:
    from memory_pipelines.launch.dagster_internals import queued_run_daemon_heartbeat

    heartbeat = queued_run_daemon_heartbeat(instance)
    return heartbeat is not None and time.time() - heartbeat < DAEMON_FRESH_SECONDS


class _Dequeuer:
    """The daemon's own dequeue iteration (tag limits, max_concurrent_runs), run from this process.

    The daemon assumes it is alone; two CLI processes dequeuing at once could both start a run of
    one tenant. A PostgreSQL advisory lock makes the iterations of every process one at a time, and
    each launches its runs (status STARTING) before releasing it, so the next one counts them."""

    def __init__(self, context: WorkspaceProcessContext, conninfo: str) -> None:
        import dagster as dg

        from memory_pipelines.launch.dagster_internals import RunDequeuer

        self.context = context
        self.conninfo = conninfo
        self.queued = isinstance(context.instance.run_coordinator, dg.QueuedRunCoordinator)
        self.daemon = RunDequeuer() if self.queued else None

    def step(self) -> None:
        if self.daemon is None or _daemon_dequeues(self.context.instance):
            return
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (DEQUEUE_LOCK,))
            try:
                if _daemon_dequeues(self.context.instance):
                    return  # a daemon started while we waited for the lock: never two dequeuers at once
                self.daemon.run_iteration(self.context)
            finally:
                conn.execute("SELECT pg_advisory_unlock(%s)", (DEQUEUE_LOCK,))

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.close()


# DagsterEventType member names (their values are older names: RUN_SUCCESS is "PIPELINE_SUCCESS").
_STEP_ENDS = {"STEP_SUCCESS", "STEP_FAILURE", "STEP_SKIPPED", "STEP_UP_FOR_RETRY"}
_RUN_ENDS = {"RUN_SUCCESS": "done", "RUN_FAILURE": "failed", "RUN_CANCELED": "canceled"}


class _RunBars:
    """One progress bar per run on the terminal, read from the runs' event logs: steps finished of
    the run's steps, and the step running, or its latest library `progress:` line."""

    def __init__(self, instance: DagsterInstance, run_ids: Sequence[str], terminal: TextIO) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.table import Column

        self.instance = instance
        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=20),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            # The step running (a check's step key is long): cut on a narrow terminal, never wrapped.
            TextColumn("{task.fields[doing]}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
            console=Console(file=terminal, stderr=False),
            expand=True,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.cursors: dict[str, str | None] = {}
        self.tasks: dict[str, Any] = {}
        for run_id in run_ids:
            run = instance.get_run_by_id(run_id)
            if run is None:
                continue
            name = f"{run.job_name} {run.tags.get(PARTITION_TAG, '')}".strip()
            steps = len(run.step_keys_to_execute or []) or None
            self.tasks[run_id] = self.bars.add_task(name, total=steps, doing="queued")
            self.cursors[run_id] = None
        self.bars.start()

    def update(self) -> None:
        for run_id, task in self.tasks.items():
            page = self.instance.get_records_for_run(run_id, cursor=self.cursors[run_id], limit=500)
            self.cursors[run_id] = page.cursor
            for record in page.records:
                self._apply(task, record.event_log_entry)

    def _apply(self, task: Any, entry: Any) -> None:
        event = entry.dagster_event
        if event is None:  # a log line: the library's progress of the step running
            said = progress.parse(entry.user_message or "")
            if said is not None:
                what, done, total = said
                self.bars.update(task, doing=f"{what} {done}/{'?' if total is None else total}")
            return
        kind = event.event_type.name
        if kind == "STEP_START":
            self.bars.update(task, doing=str(event.step_key))
        elif kind in _STEP_ENDS:
            self.bars.advance(task)
        elif kind in _RUN_ENDS:
            total = self.bars.tasks[task].total
            done = kind == "RUN_SUCCESS" and total is not None
            self.bars.update(task, doing=_RUN_ENDS[kind], **({"completed": total} if done else {}))
        elif kind == "RUN_START":
            self.bars.update(task, doing="starting")

    def close(self) -> None:
        try:
            self.update()  # the last events, so every bar ends on its run's outcome
        finally:
            self.bars.stop()


# How often a waiting command looks for runs whose worker died (defs/runs/sensors.py) and for the
# runs its own wait behind.
REAP_SECONDS = 5.0
# A wait behind another run is said again after this long.
SAY_AGAIN_SECONDS = 60.0


class _Ahead:
    """What a waiting command tells its user: the runs holding its tenant's slot, each when first
    seen and again every SAY_AGAIN_SECONDS; and the runs it found dead and marked failed."""

    def __init__(self, instance: DagsterInstance, say: Callable[[str], None]) -> None:
        self.instance = instance
        self.say = say
        self.said: dict[str, float] = {}
        self.reaped = 0.0

    def look(self, queued: Sequence[DagsterRun]) -> None:
        """Every REAP_SECONDS: mark dead runs failed, then say which runs `queued` (ours) wait behind."""
        from memory_pipelines.defs.runs.sensors import reap

        if time.monotonic() - self.reaped <= REAP_SECONDS:
            return
        self.reaped = time.monotonic()
        for dead in reap(self.instance, by=f"memory-pipelines (pid {os.getpid()})"):
            self.say(f"run {dead.run_id} ({dead.job_name} {dead.partition}) marked failed: {dead.reason}")
        for run in queued:
            self._ahead_of(run)

    def _ahead_of(self, run: DagsterRun) -> None:
        import dagster as dg

        from memory_pipelines.defs.runs.sensors import CONFIRM_SECONDS, JUDGED

        for key in (PARTITION_TAG, TENANT_TAG):
            value = run.tags.get(key)
            if not value:
                continue
            for record in self.instance.get_run_records(dg.RunsFilter(statuses=JUDGED, tags={key: value}), limit=5):
                other = record.dagster_run
                if time.monotonic() - self.said.get(other.run_id, -SAY_AGAIN_SECONDS) < SAY_AGAIN_SECONDS:
                    continue
                self.said[other.run_id] = time.monotonic()
                since = time.time() - (record.start_time or record.create_timestamp.timestamp())
                began = "started" if record.start_time else "created"
                self.say(
                    f"waiting for run {other.run_id} ({other.job_name} {value}, {other.status.value}, {began} "
                    f"{round(since)} s ago): one run per tenant at a time. A run whose worker died is marked failed "
                    f"within {round(REAP_SECONDS + 2 * POLL_SECONDS + CONFIRM_SECONDS)} s of its lease ending, or "
                    f"{self.instance.run_monitoring_start_timeout_seconds} s after its launch if it never started."
                )


def _wait(
    instance: DagsterInstance,
    dequeuer: _Dequeuer,
    run_ids: Sequence[str],
    stderr: TextIO | None = None,
    terminal: bool = False,
    heartbeat: Callable[[], None] = lambda: None,
) -> None:
    """Until every run has finished; the runs' subprocesses outlive nothing they depend on. With a
    terminal, a progress bar per run is drawn on stderr meanwhile."""
    from dagster import DagsterRunStatus

    pending = set(run_ids)
    bars = _RunBars(instance, run_ids, stderr) if stderr is not None and terminal else None
    ahead = _Ahead(
        instance, bars.bars.console.print if bars is not None else lambda line: print(line, file=stderr or sys.stderr)
    )
    beaten = 0.0
    try:
        while pending:
            if time.monotonic() - beaten > HEARTBEAT_SECONDS:
                heartbeat()
                beaten = time.monotonic()
            if bars is not None:
                bars.update()
            queued = []
            for run_id in sorted(pending):
                run = instance.get_run_by_id(run_id)
                if run is None or run.is_finished:
                    pending.discard(run_id)
                elif run.status == DagsterRunStatus.QUEUED:
                    queued.append(run)
            if pending:  # ours too: a worker of ours may die with its code server
                ahead.look(queued)
            if queued:  # only while ours wait: other processes' runs are theirs (or the daemon's) to start
                dequeuer.step()
            if pending:
                time.sleep(POLL_SECONDS)
    except KeyboardInterrupt:
        for run_id in pending:  # an interrupted CLI leaves no run behind in the queue or running
            instance.run_coordinator.cancel_run(run_id)
        raise
    finally:
        if bars is not None:
            bars.close()


def _root_cause(error: Any) -> str:
    """The deepest of our errors in the chain (they name their field), else the innermost error's
    message: not Dagster's wrapper, nor the library error ours was raised from."""
    chain = [error]
    while chain[-1].cause is not None:
        chain.append(chain[-1].cause)
    ours = [e for e in chain if _message_line(e)[0].startswith("memory_pipelines.")]
    chosen = ours[-1] if ours else chain[-1]
    qualified, text = _message_line(chosen)
    return text if qualified.endswith(str(chosen.cls_name)) and text else f"{qualified}: {text}".strip(": ")


def _exhausted(error: Any) -> bool:
    """Whether a serialized error, or one in its chain, is a resource running out."""
    while error is not None:
        if names_exhaustion(str(error.cls_name), str(error.message)):
            return True
        error = error.cause
    return False


def _message_line(error: Any) -> tuple[str, str]:
    """("module.Class", "message") from the last line of a serialized error's message."""
    lines = str(error.message).strip().splitlines()
    qualified, _, text = (lines[-1] if lines else str(error.cls_name)).partition(": ")
    return qualified, text


def _values(metadata: Any, leave_out: Sequence[str] = ()) -> dict[str, Any]:
    return {name: _plain(value) for name, value in metadata.items() if name not in leave_out}


def _plain(value: Any) -> Any:
    """A metadata value as JSON can hold it: a table's rows as dicts (a table's `.value` is itself)."""
    import dagster as dg

    if isinstance(value, dg.TableMetadataValue):
        return [dict(record.data) for record in value.records]
    return getattr(value, "value", None)


def read_run(instance: DagsterInstance, run_id: str, leave_out: Sequence[str] = ()) -> RunOutcome:
    """A finished run's results from the instance: the one reader every command uses."""
    import dagster as dg

    run = instance.get_run_by_id(run_id)
    if run is None:
        raise ValidationError("run", f"no run {run_id} in the instance")
    outcome = RunOutcome(run_id=run_id, status=run.status.value, partition=run.tags.get(PARTITION_TAG))
    wanted = {
        dg.DagsterEventType.ASSET_MATERIALIZATION,
        dg.DagsterEventType.ASSET_CHECK_EVALUATION,
        dg.DagsterEventType.STEP_OUTPUT,
        dg.DagsterEventType.STEP_FAILURE,
        dg.DagsterEventType.RUN_FAILURE,
    }
    run_failure = None
    for entry in instance.all_logs(run_id, of_type=wanted):
        event = entry.dagster_event
        if event is None:
            continue
        data = event.event_specific_data
        if event.event_type == dg.DagsterEventType.ASSET_MATERIALIZATION:
            materialization = data.materialization  # type: ignore[union-attr]
            key = materialization.asset_key.to_user_string()
            outcome.assets[key] = _values(materialization.metadata, leave_out)
        elif event.event_type == dg.DagsterEventType.ASSET_CHECK_EVALUATION:
            outcome.checks[data.check_name] = {"passed": data.passed, "severity": data.severity.value}  # type: ignore[union-attr]
        elif event.event_type == dg.DagsterEventType.STEP_OUTPUT:
            outcome.outputs[str(event.step_key)] = _values(data.metadata)  # type: ignore[union-attr]
        elif event.event_type == dg.DagsterEventType.STEP_FAILURE and data.error is not None:  # type: ignore[union-attr]
            failed = data.error  # type: ignore[union-attr]
            outcome.failures.append(
                {"step": event.step_key, "error": _root_cause(failed), "resources": _exhausted(failed)}
            )
        elif event.event_type == dg.DagsterEventType.RUN_FAILURE:
            error = getattr(data, "error", None)
            run_failure = _root_cause(error) if error is not None else event.message
    if not outcome.success and not outcome.failures:
        # Failed before any step (launch, config, code server): the run-level reason.
        outcome.failures.append({"step": None, "error": run_failure or f"run ended {outcome.status}"})
    return outcome


def launch_and_wait(settings: Settings, launches: Sequence[Launch], leave_out: Sequence[str] = ()) -> list[RunOutcome]:
    """Submit every run, wait for all of them, read their results; one workspace for the lot."""
    with _workspace(settings) as ws:
        instance, context = ws.instance, ws.context
        for launch in launches:
            if launch.job_name in _TENANT_JOBS and not instance.has_dynamic_partition("tenants", launch.partition):
                instance.add_dynamic_partitions("tenants", [launch.partition])
        run_ids = [_create_run(instance, context, launch) for launch in launches]
        dequeuer = _Dequeuer(context, ws.conninfo)
        try:
            _wait(
                instance, dequeuer, run_ids, ws.stderr, ws.terminal, ws.server.heartbeat if ws.server else lambda: None
            )
        finally:
            dequeuer.close()
            if ws.server is not None:
                ws.server.await_runs(set(run_ids))
        return [read_run(instance, run_id, leave_out) for run_id in run_ids]


# Jobs partitioned by tenant: their partition must exist before a run of it is created.
_TENANT_JOBS = {"tenant_refresh", "backup", "restore", "forget", "retention", "memories_snapshot", "erase"}


def _one(settings: Settings, launch: Launch, leave_out: Sequence[str] = ()) -> RunOutcome:
    return launch_and_wait(settings, [launch], leave_out)[0]


def failure_message(failures: list[dict[str, Any]]) -> str:
    """The failed steps' root causes (our errors name their field), for a CLI error line, and where
    the runs' full output went when it was not shown."""
    message = "; ".join(f["error"] for f in failures) or "run failed"
    return f"{message} (run output: {_run_log})" if _run_log is not None and not verbose() else message


def run_failed(field: str, failures: list[dict[str, Any]], *, prefix: str = "") -> MemoryPipelinesError:
    """The error a command reports for a failed run: exit 9 (ResourceExhaustedError) when a step ran out
    of disk, memory, descriptors or connections, else 1."""
    message = prefix + failure_message(failures)
    if any(f.get("resources") for f in failures):
        return exhausted(field, message)
    return MemoryPipelinesError(field, message)


def _job_name(job: Any) -> str:
    return job if isinstance(job, str) else str(job.name)


# -- the commands' runs ------------------------------------------------------------------------


def run_forget(settings: Settings, tenant_id: str, job_ids: Sequence[str]) -> dict[str, Any]:
    """Run the `forget` job for one tenant now, through the instance, and wait for it."""
    from memory_pipelines.defs.forget.jobs import FORGET_JOB, forget_run_config

    run = _one(
        settings,
        Launch(_job_name(FORGET_JOB), tenant_id, forget_run_config(job_ids=list(job_ids)), tenant=tenant_id),
    )
    return {"run_id": run.run_id, "success": run.success, "failures": run.failures}


def run_erasure(settings: Settings, tenant_id: str) -> dict[str, Any]:
    """Run the tenant's `physical_erasure` now (rewrite, byte scan, ERASED) and wait for it."""
    from memory_pipelines.defs.erasure.jobs import ERASURE_JOB

    run = _one(settings, Launch(_job_name(ERASURE_JOB), tenant_id, {}, tenant=tenant_id))
    figures = run.assets.get("physical_erasure", {})
    return {**figures, "run_id": run.run_id, "success": run.success, "failures": run.failures}


def run_backup(settings: Settings, tenant_id: str) -> dict[str, Any]:
    """Materialize `tenant_backups` for one tenant now; returns the backup's figures and the run."""
    run = _one(settings, Launch("backup", tenant_id, IN_PROCESS, tenant=tenant_id))
    figures = run.assets.get("tenant_backups", {})
    return {**figures, "run_id": run.run_id, "success": run.success, "failures": run.failures}


def run_restore(settings: Settings, tenant_id: str, backup_id: str, restore_id: str | None = None) -> dict[str, Any]:
    """Run the `restore` job for one tenant now; returns the restore report (from control.restores,
    where the restore itself records it) and the run."""
    import secrets

    from memory_pipelines.lib.backups.service import restore_report

    restore_id = restore_id or "r_" + secrets.token_hex(8)  # ours, so the report can be found after
    config = {"ops": {"restore_tenant": {"config": {"backup_id": backup_id, "restore_id": restore_id}}}}
    run = _one(settings, Launch("restore", tenant_id, config, tenant=tenant_id))
    store = open_store(settings)
    try:
        report = restore_report(store, restore_id=restore_id) if run.success else None
    finally:
        store.close()
    return {"report": report, "run_id": run.run_id, "success": run.success, "failures": run.failures}


def run_retention(settings: Settings, day: str, tenants: Sequence[str]) -> dict[str, Any]:
    """One `retention` run per tenant for `day`, all submitted at once (the queue orders them);
    the figures are summed over every run's materialization metadata."""
    from memory_pipelines.defs.retention.jobs import DAY_TAG, RETENTION_JOB, retention_run_config

    config = retention_run_config(day=day)
    launches = [
        Launch(_job_name(RETENTION_JOB), tenant, config, tenant=tenant, tags=((DAY_TAG, day),)) for tenant in tenants
    ]
    runs = launch_and_wait(settings, launches)
    totals: dict[str, int | float] = {}
    for run in runs:
        # The sweep step's output carries its figures (a sweep that removed nothing materializes nothing).
        for metric, value in run.outputs.get("retention_sweep", {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                totals[metric] = totals.get(metric, 0) + value
    return {
        "date": day,
        "tenants": len(runs),
        "totals": totals,
        "runs": [
            {"tenant": run.partition, "run_id": run.run_id, "success": run.success, "failures": run.failures}
            for run in runs
        ],
        "success": all(run.success for run in runs),
        "failures": [failure for run in runs for failure in run.failures],
    }


def run_evaluation(settings: Settings, month: str) -> dict[str, Any]:
    """Materialize `memory_eval` and `memory_drift` for one month partition (YYYY-MM-01) now."""
    # The trend is Markdown with an embedded PNG: too big for a JSON answer.
    run = _one(settings, Launch("memory_evaluation", month, IN_PROCESS), leave_out=("trend",))
    return {
        "month": month[:7],
        "run_id": run.run_id,
        "success": run.success,
        "assets": run.assets,
        "checks": run.checks,
        "failures": run.failures,
    }


def materialize(settings: Settings, tenant_id: str, select: Sequence[str] | None = None) -> dict[str, Any]:
    """Materialize `select` (default: every asset) for one tenant; returns counts and check results."""
    chosen = list(select or ALL_ASSETS)
    unknown = sorted(set(chosen) - set(ALL_ASSETS))
    if unknown:
        raise ValidationError("select", f"unknown asset(s) {', '.join(unknown)}; choose from {', '.join(ALL_ASSETS)}")
    store = open_store(settings)
    try:
        store.require_tenant(tenant_id=tenant_id)
    finally:
        store.close()
    assets = () if set(chosen) == set(ALL_ASSETS) else tuple(chosen)
    run = _one(settings, Launch("tenant_refresh", tenant_id, IN_PROCESS, assets=assets, tenant=tenant_id))
    return {
        "tenant": tenant_id,
        "run_id": run.run_id,
        "success": run.success,
        "assets": run.assets,
        "checks": {name: check["passed"] for name, check in run.checks.items()},
        "failures": run.failures,
    }
