"""Processes as /proc shows them: the ones of a HOME (`stop` ends them), the ones a process started
(the CLI waits for its code servers, the test run's guard names survivors), a process group (`dev`
ends all of it) and who holds a port. Linux /proc; elsewhere nothing is found.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from memory_pipelines.lib.infra.settings import ENV_HOME

__all__ = [
    "COMMAND_WIDTH",
    "HOME_VARIABLES",
    "STOP_SECONDS",
    "Proc",
    "ancestry",
    "descendants",
    "end_processes",
    "group_members",
    "home_processes",
    "is_dagster_process",
    "names_home",
    "names_path",
    "process_environ",
    "processes",
    "read_proc",
    "wait_for_exit",
]

# `stop`: how long Dagster processes get to end on SIGTERM before SIGKILL.
STOP_SECONDS = 10.0
COMMAND_WIDTH = 200
# Variables that name the HOME a process works on.
HOME_VARIABLES = (ENV_HOME, "DAGSTER_HOME")


@dataclass(frozen=True)
class Proc:
    """A live process as /proc shows it; `started` (clock ticks after boot) tells a recycled pid apart."""

    pid: int
    ppid: int
    pgrp: int
    started: int
    args: tuple[str, ...]

    @property
    def command(self) -> str:
        return " ".join(self.args)

    def describe(self, width: int = COMMAND_WIDTH) -> dict[str, object]:
        """pid and command line (cut at `width`: a code server's carries its instance as JSON)."""
        command = self.command
        return {"pid": self.pid, "command": command if len(command) <= width else command[: width - 3] + "..."}

    def alive(self) -> bool:
        """Still running, and still this process (not a new one on the same pid)."""
        _reap(self.pid)
        now = read_proc(self.pid)
        return now is not None and now.started == self.started


def _reap(pid: int) -> None:
    """Collect `pid` if it is an exited child of ours, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except OSError:
        pass


def read_proc(pid: int) -> Proc | None:
    """`pid` from /proc, or None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    # comm (the second field) may hold spaces and parentheses: the fields after it follow the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    args = tuple(arg.decode(errors="replace") for arg in raw.split(b"\0") if arg)
    return Proc(pid=pid, ppid=int(fields[1]), pgrp=int(fields[2]), started=int(fields[19]), args=args)


def processes() -> list[Proc]:
    """Every live process this one can see."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = (read_proc(int(name)) for name in names if name.isdigit())
    return [proc for proc in found if proc is not None]


def descendants(pid: int, table: Sequence[Proc] | None = None) -> list[Proc]:
    """The children of `pid`, theirs, and so on (from `table`, else from /proc now)."""
    children: dict[int, list[Proc]] = {}
    for proc in processes() if table is None else table:
        children.setdefault(proc.ppid, []).append(proc)
    found: list[Proc] = []
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child.pid)
    return found


def ancestry(pid: int, table: Sequence[Proc] | None = None) -> set[int]:
    """`pid` and its parents up to init: processes a sweep must never signal."""
    parents = {proc.pid: proc.ppid for proc in (processes() if table is None else table)}
    chain = {pid}
    while pid in parents and parents[pid] not in chain and parents[pid] > 0:
        pid = parents[pid]
        chain.add(pid)
    return chain


def process_environ(pid: int) -> dict[str, str]:
    """The environment `pid` was started with ({} when it is not ours to read)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {name: value for name, _, value in pairs}


def names_path(text: str, path: Path) -> bool:
    """`text` names `path` or a file under it (not a sibling whose name merely starts the same)."""
    return re.search(re.escape(str(path)) + r"(?![\w.\-])", text) is not None


def is_dagster_process(proc: Proc) -> bool:
    """A Dagster program (code server, daemon, webserver, `dagster dev`, `dg dev`), or a
    multiprocessing child such as a run worker or a resource tracker."""
    head = proc.args[:4]  # the interpreter, its flags, then the program, `-m module` or `-c code`
    for index, arg in enumerate(head):
        if Path(arg).name in _DAGSTER_PROGRAMS:
            return True
        module = proc.args[index + 1] if arg == "-m" and index + 1 < len(proc.args) else ""
        if module.split(".")[0] in _DAGSTER_MODULES or module in _DAGSTER_ENTRIES:
            return True
    return any("multiprocessing" in arg for arg in head)


_DAGSTER_PROGRAMS = {"dagster", "dagster-daemon", "dagster-webserver", "dagster-graphql", "dg"}
_DAGSTER_MODULES = {"dagster", "dagster_webserver", "dagster_graphql", "dagster_dg_cli"}
# Our own entries that run a Dagster program: the CLI's warm code server (`dagster api grpc`).
_DAGSTER_ENTRIES = {"memory_pipelines.launch.serve_code"}


def names_home(proc: Proc, home: Path) -> bool:
    """`proc` works on `home`: its MEMORY_PIPELINES_HOME is `home`, or its DAGSTER_HOME, or a path
    on its command line, is `home`/dagster. Exact paths only: a HOME that holds other projects (a
    user's ~) must not claim their Dagster processes because their paths lie under it."""
    dagster_home = home / "dagster"
    env = process_environ(proc.pid)
    return (
        _same_path(env.get(ENV_HOME), home)
        or _same_path(env.get("DAGSTER_HOME"), dagster_home)
        or names_path(proc.command, dagster_home)
    )


def _same_path(value: str | None, path: Path) -> bool:
    return bool(value) and os.path.realpath(str(value)) == os.path.realpath(path)


def home_processes(home: Path) -> list[Proc]:
    """The Dagster processes of `home` (see names_home) and the Dagster processes they started;
    never this process or one of its parents. Other programs naming HOME are not ours to end."""
    table = processes()
    spared = ancestry(os.getpid(), table)
    found = {
        proc.pid: proc
        for proc in table
        if proc.pid not in spared and is_dagster_process(proc) and names_home(proc, home)
    }
    for proc in list(found.values()):
        found.update((child.pid, child) for child in descendants(proc.pid, table) if is_dagster_process(child))
    return [found[pid] for pid in sorted(found) if pid not in spared]


def end_processes(procs: Sequence[Proc], timeout: float = STOP_SECONDS) -> list[dict[str, object]]:
    """SIGTERM each process, SIGKILL the ones still running `timeout` seconds later. One entry per
    process: pid, command, the last signal sent, and whether it ended."""
    report = {proc.pid: {**proc.describe(), "signal": None, "ended": False} for proc in procs}
    pending = [proc for proc in procs if proc.alive()]
    for signum, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        for proc in pending:
            try:
                os.kill(proc.pid, signum)
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once resumed
            except OSError:
                continue
            report[proc.pid]["signal"] = signal.Signals(signum).name
        pending = wait_for_exit(pending, wait)
        if not pending:
            break
    for proc in procs:
        report[proc.pid]["ended"] = not proc.alive()
    return list(report.values())


def wait_for_exit(procs: Sequence[Proc], timeout: float) -> list[Proc]:
    """Wait up to `timeout` seconds for every process to end; the ones still running."""
    deadline = time.monotonic() + timeout
    pending = [proc for proc in procs if proc.alive()]
    while pending and time.monotonic() < deadline:
        time.sleep(0.1)
        pending = [proc for proc in pending if proc.alive()]
    return pending


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    if not Path("/proc").is_dir():  # not Linux: ask ps
        out = subprocess.run(["ps", "-A", "-o", "pid=,pgid=,stat="], capture_output=True, text=True).stdout
        rows = (line.split() for line in out.splitlines())
        return [int(r[0]) for r in rows if len(r) >= 3 and int(r[1]) == pgid and not r[2].startswith("Z")]
    return [proc.pid for proc in processes() if proc.pgrp == pgid]
