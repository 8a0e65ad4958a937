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
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from memory_pipelines.lib.infra.children import ISOLATED, isolated_env
from memory_pipelines.lib.infra.code_runtime import runtime_dir, scratch_of, sweep_records
from memory_pipelines.lib.infra.errors import ServiceError
from memory_pipelines.lib.infra.owner_only import replace_private_file
from memory_pipelines.lib.infra.paths import PROJECT_ROOT
from memory_pipelines.lib.infra.settings import Settings, positive_int

__all__ = [
    "ENV_IDLE_SECONDS",
    "LOCATION",
    "WarmServer",
    "code_stamp",
    "command",
    "module_workspace",
    "warm_server",
]

ENV_IDLE_SECONDS = "MEMORY_PIPELINES_CODE_SERVER_IDLE_SECONDS"
DEFAULT_IDLE_SECONDS = 300
START_SECONDS = 120.0
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


def _identity(settings: Settings) -> str:
    """A hash of HOME, the interpreter, the code and the environment a server would serve."""
    digest = hashlib.sha256()
    digest.update(f"{settings.home}\0{sys.executable}\0".encode())
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES)
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

    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        grpc_heartbeat(socket)
    except Exception:  # grpc raises its own types: a server that does not answer is not warm
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
    idle = positive_int(ENV_IDLE_SECONDS, os.environ.get(ENV_IDLE_SECONDS), DEFAULT_IDLE_SECONDS, unit="seconds")
    name = _identity(settings)
    socket, record = runtime / f"{name}.sock", runtime / f"{name}.json"
    workspace = runtime / f"{name}.yaml"
    with _locked(runtime / f"{name}.lock"):
        # Written every time (a sweep may have taken it with a server that died since), and whole:
        # a command that got this server a moment ago may be reading it now.
        replace_private_file(
            workspace,
            f"load_from:\n  - grpc_server:\n      socket: {json.dumps(str(socket))}\n      location_name: {LOCATION}\n",
        )
        if record.exists():
            with contextlib.suppress(ValueError, OSError, KeyError):
                pid = int(json.loads(record.read_text())["pid"])
                if _alive(socket, pid):
                    return WarmServer(socket=socket, pid=pid, workspace_file=workspace)
        for stale in (socket, record):
            stale.unlink(missing_ok=True)
        shutil.rmtree(scratch_of(socket), ignore_errors=True)  # a killed server's fork-server socket
        sweep_records(runtime, keep=record)
        pid = _start(socket, idle, log)
        replace_private_file(record, json.dumps({"pid": pid, "home": str(settings.home), "started": time.time()}))
        return WarmServer(socket=socket, pid=pid, workspace_file=workspace)


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


def _start(socket: Path, idle: int, log: Path) -> int:
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
            env=isolated_env(os.environ),  # for its run workers, which it starts without -I
        )
    finally:
        os.close(fd)
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError("code_server", f"exited with {proc.returncode} while starting (see {log})")
        if socket.exists() and _alive(socket, proc.pid):
            return proc.pid
        time.sleep(0.1)
    proc.kill()
    raise ServiceError("code_server", f"did not answer on {socket} within {START_SECONDS:.0f}s (see {log})")
