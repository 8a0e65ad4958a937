"""A warm code server per HOME, shared by the CLI's commands that launch runs.

Starting the project's code server (`dagster api grpc`: import Dagster, load the definitions) took
about 2 s of every `materialize`, `forget --wait`, `backup` or `restore --wait`, and waiting for it to
exit after the run 2 s more (benchmarks/cli_latency.py). The first such command of a HOME now
starts one in a session of its own and leaves it running; the next commands reuse it. It ends by
itself once no command has sent it a heartbeat for MEMORY_PIPELINES_CODE_SERVER_IDLE_SECONDS (after
its runs finish), and `memory-pipelines stop` ends it with the HOME's other Dagster processes.

A server serves the code and environment it was started with, and a run worker inherits its
environment: a server is reused only by commands with the same code (every file's size and mtime),
interpreter and settings (every MEMORY_PIPELINES_*, DAGSTER_*, AWS_* and PYTHON* variable); others
start their own. It listens on a Unix socket in a directory only its user can enter (a TCP port on
127.0.0.1 would let any local user launch runs), named by a hash of HOME and that identity.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket as sockets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from memory_pipelines.lib.infra.children import ISOLATED, isolated_env
from memory_pipelines.lib.infra.code_runtime import forker_ready, runtime_dir, scratch_of, sweep_records
from memory_pipelines.lib.infra.errors import ServiceError
from memory_pipelines.lib.infra.owner_only import private_dir, replace_private_file
from memory_pipelines.lib.infra.paths import PROJECT_ROOT
from memory_pipelines.lib.infra.settings import ENV_HOME, Settings, positive_int

__all__ = [
    "ENV_IDLE_SECONDS",
    "LOCATION",
    "RUN_LOG",
    "WarmServer",
    "code_stamp",
    "command",
    "launch_variables",
    "module_workspace",
    "run_log",
    "start_for_commands",
    "warm_server",
]

ENV_IDLE_SECONDS = "MEMORY_PIPELINES_CODE_SERVER_IDLE_SECONDS"
DEFAULT_IDLE_SECONDS = 300
START_SECONDS = 120.0
# How long after a server started a command waits for its command forker (its fork server imports
# meanwhile); past it the command runs in its own process and uses the server.
FORKER_SECONDS = 30.0
# Where the CLI's children (code servers, run workers) write without --verbose, under HOME.
RUN_LOG = Path("logs") / "cli-runs.log"
RUN_LOG_MAX_BYTES = 20_000_000  # then it becomes cli-runs.log.1 (replacing the one before)
LOCATION = "memory_pipelines"  # the code location's name: workspaces, runs' origins, the UI
_ENV_PREFIXES = ("MEMORY_PIPELINES_", "DAGSTER_", "AWS_", "PYTHON")
_ENV_NAMES = ("PATH", "HOME", "TZ", "LANG", "LC_ALL", "VIRTUAL_ENV")


@dataclass(frozen=True)
class WarmServer:
    """A running code server: its socket, pid, and the workspace file that names it."""

    socket: Path
    pid: int
    workspace_file: Path

    def heartbeat(self) -> None:
        """Tell the server a command still uses it (it ends once none has for the idle time)."""
        from memory_pipelines.launch.dagster_internals import grpc_heartbeat

        with contextlib.suppress(Exception):  # a missed heartbeat only shortens its life
            grpc_heartbeat(self.socket)

    def await_runs(self, run_ids: set[str], timeout: float = 30.0) -> None:
        """Until the processes of these runs have exited (a run is finished in the event log a moment
        before its process ends): a command returns with no run worker of its own left behind."""
        from memory_pipelines.launch.dagster_internals import grpc_current_runs

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if not run_ids & grpc_current_runs(self.socket):
                    return
            except Exception:  # grpc's own types: a server that is gone has no run processes left
                return
            time.sleep(0.1)


def code_stamp() -> str:
    """A hash of the project's code and assets as they are now: every file's path, size and mtime."""
    digest = hashlib.sha256()
    for root in (PROJECT_ROOT / "memory_pipelines", PROJECT_ROOT / "assets"):
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                info = path.stat()
                digest.update(f"{path.relative_to(PROJECT_ROOT)}\0{info.st_size}\0{info.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def launch_variables(settings: Settings) -> dict[str, str]:
    """What a launching command sets in its environment before it finds its server: the code server
    and the run workers inherit them, and must see the same HOME and instance."""
    return {"DAGSTER_HOME": str(settings.dagster_home), ENV_HOME: str(settings.home)}


def run_log(settings: Settings) -> Path:
    """HOME's log of the CLI's children, its directory private, the log rotated once it is too big."""
    log = settings.home / RUN_LOG
    private_dir(log.parent)
    if log.exists() and log.stat().st_size > RUN_LOG_MAX_BYTES:
        log.replace(log.with_name(log.name + ".1"))
    return log


def _identity(settings: Settings, environ: Mapping[str, str]) -> str:
    """A hash of HOME, the interpreter, the code and the environment a server would serve."""
    digest = hashlib.sha256()
    digest.update(f"{settings.home}\0{sys.executable}\0".encode())
    env = sorted((k, v) for k, v in environ.items() if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES)
    digest.update(json.dumps(env).encode())
    digest.update(code_stamp().encode())
    return digest.hexdigest()[:20]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _alive(socket: Path, pid: int) -> bool:
    from memory_pipelines.launch.dagster_internals import grpc_heartbeat

    if not _running(pid):
        return False
    try:
        grpc_heartbeat(socket)
    except Exception:  # grpc raises its own types: a server that does not answer is not warm
        return False
    return True


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _listening(socket: Path) -> bool:
    """Whether a server accepts connections on `socket` (Dagster's server binds once its code is
    loaded); the check that needs no gRPC, for a process that has not imported Dagster."""
    probe = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    with probe:
        try:
            probe.connect(str(socket))
        except OSError:
            return False
    return True


def module_workspace(settings: Settings) -> Path:
    """A workspace file loading the code location from its module, with the project as its working
    directory (an absolute path): Dagster puts that directory first on the code server's path, and a
    relative one, as workspace.yaml would give, is the working directory of whoever starts the server,
    which may be one other users can write."""
    workspace = settings.dagster_home / "workspace.yaml"
    replace_private_file(
        workspace,
        "load_from:\n  - python_module:\n"
        f"      module_name: memory_pipelines.definitions\n      location_name: {LOCATION}\n"
        f"      working_directory: {json.dumps(str(PROJECT_ROOT))}\n",
    )
    return workspace


def warm_server(settings: Settings, *, log: Path) -> WarmServer | None:
    """The HOME's warm code server for this code and environment, started when none answers; None
    when no private runtime directory can be had (the caller then starts a server of its own)."""
    runtime = runtime_dir()
    if runtime is None:
        return None
    socket, record, workspace = _paths(runtime, _identity(settings, os.environ))
    with _locked(record.with_suffix(".lock")):
        _write_workspace(workspace, socket)
        pid, _ = _recorded(record)
        if pid is None or not _alive(socket, pid):
            pid = _start_and_record(settings, record, log, os.environ, lambda pid: _alive(socket, pid))
        return WarmServer(socket=socket, pid=pid, workspace_file=workspace)


def start_for_commands(settings: Settings) -> bool:
    """For a command that launches runs and found no command forker: start the HOME's warm code
    server as that command would have (the embedded services first, the same environment, so the
    same server), without importing Dagster here, and wait for its command forker. Whether a server
    of this identity and its forker answer now; then the command is forked warm from it, as the
    ones after it are (warm_commands.py), instead of importing Dagster in its own process."""
    from memory_pipelines.lib.infra.services import ensure_services

    runtime = runtime_dir()
    if runtime is None:
        return False
    ensure_services(settings)  # the instance's dagster.yaml and database, which the server serves
    environ = {**os.environ, **launch_variables(settings)}
    socket, record, workspace = _paths(runtime, _identity(settings, environ))
    with _locked(record.with_suffix(".lock")):
        _write_workspace(workspace, socket)
        pid, started = _recorded(record)
        if pid is None or not (_running(pid) and _listening(socket)):
            _start_and_record(settings, record, run_log(settings), environ, lambda _: _listening(socket))
            started = time.time()
    # Its fork server imports while the server loads the code: the forker may come a little later.
    while not forker_ready(settings.home, runtime, socket):
        if time.time() > started + FORKER_SECONDS:
            return False
        time.sleep(0.05)
    return True


def _paths(runtime: Path, name: str) -> tuple[Path, Path, Path]:
    """The socket, record and workspace file of server `name`."""
    return runtime / f"{name}.sock", runtime / f"{name}.json", runtime / f"{name}.yaml"


def _write_workspace(workspace: Path, socket: Path) -> None:
    # Written every time (a sweep may have taken it with a server that died since), and whole: a
    # command that got this server a moment ago may be reading it now.
    replace_private_file(
        workspace,
        f"load_from:\n  - grpc_server:\n      socket: {json.dumps(str(socket))}\n      location_name: {LOCATION}\n",
    )


def _recorded(record: Path) -> tuple[int | None, float]:
    """The pid a server's record names and when it started, if it can be read."""
    with contextlib.suppress(ValueError, OSError, KeyError, TypeError):
        said = json.loads(record.read_text())
        return int(said["pid"]), float(said.get("started", 0.0))
    return None, 0.0


def _start_and_record(
    settings: Settings, record: Path, log: Path, environ: Mapping[str, str], ready: Callable[[int], bool]
) -> int:
    """Under the server's lock: remove what a dead server left, start a new one, record it."""
    socket = record.with_suffix(".sock")
    for stale in (socket, record):
        stale.unlink(missing_ok=True)
    shutil.rmtree(scratch_of(socket), ignore_errors=True)  # a killed server's fork-server socket
    sweep_records(record.parent, keep=record)
    pid = _start(socket, log, environ, ready)
    replace_private_file(record, json.dumps({"pid": pid, "home": str(settings.home), "started": time.time()}))
    return pid


def command(socket: Path, idle: int) -> list[str]:
    """The warm code server's command line (`stop` and `home_processes` know it as Dagster's)."""
    return [
        sys.executable,
        ISOLATED,
        "-m",
        "memory_pipelines.launch.serve_code",  # `dagster api grpc`, run workers forked warm
        "api",
        "grpc",
        "--socket",
        str(socket),
        "--module-name",
        "memory_pipelines.definitions",
        "--location-name",
        LOCATION,
        "--working-directory",  # Dagster puts it first on the path: ours, not the caller's
        str(PROJECT_ROOT),
        "--heartbeat",
        "--heartbeat-timeout",
        str(idle),
        "--log-level",
        "warning",
    ]


def _start(socket: Path, log: Path, environ: Mapping[str, str], ready: Callable[[int], bool]) -> int:
    """Start the server with `environ`; its pid once `ready` says it answers."""
    idle = positive_int(ENV_IDLE_SECONDS, environ.get(ENV_IDLE_SECONDS), DEFAULT_IDLE_SECONDS, unit="seconds")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        # A session of its own: the terminal's Ctrl-C ends the command, not the server other commands share.
        proc = subprocess.Popen(
            command(socket, idle),
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            start_new_session=True,
            cwd=PROJECT_ROOT,
            env=isolated_env(environ),  # for its run workers, which it starts without -I
        )
    finally:
        os.close(fd)
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError("code_server", f"exited with {proc.returncode} while starting (see {log})")
        if socket.exists() and ready(proc.pid):
            return proc.pid
        time.sleep(0.1)
    proc.kill()
    raise ServiceError("code_server", f"did not answer on {socket} within {START_SECONDS:.0f}s (see {log})")
