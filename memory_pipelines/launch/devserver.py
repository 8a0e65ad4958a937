"""`memory-pipelines dev`: `dg dev` under a small supervisor that ends all of it on SIGTERM or SIGINT.

Why not exec `dagster dev` as before: a shell without job control (`memory-pipelines dev &` in a
script) starts a background command with SIGINT ignored, and so does every process started from
one. Python then installs no KeyboardInterrupt handler, and Dagster's `setup_interrupt_handlers`
(dagster/_utils/interrupts.py), called by `dagster dev` and by both code server commands, copies
that SIG_IGN onto SIGTERM: those processes ignore both signals, and the webserver and daemon, whose
shutdown `dagster dev` sends through their pipe, are never told. Measured with the old exec:
SIGTERM or SIGINT to the whole process group left all five processes alive 60 s later.

So the supervisor stays (no exec) and runs `dg dev` in a process group of its own. It installs
handlers for SIGINT, SIGTERM and SIGHUP before starting it (exec resets a handled signal to its
default, while an ignored one stays ignored), so every Dagster process starts with the
dispositions it has in a foreground terminal. On a signal it does what Ctrl-C in a terminal does,
SIGINT to the whole group, then SIGKILL to whatever of the group is left after `grace` seconds.
The embedded PostgreSQL and Chroma servers run in sessions of their own and keep running. Dagster
logs to stdout; the supervisor sends that to its stderr, so stdout holds only the JSON document.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from memory_pipelines.lib.infra.children import ISOLATED
from memory_pipelines.lib.infra.processes import group_members

# SIGINT to the group, then SIGKILL after this long: everything is gone well within 10 s.
GRACE_SECONDS = 6.0
# After SIGKILL the kernel ends processes at once; this only bounds a wait on a process stuck in I/O.
KILL_WAIT_SECONDS = 3.0
POLL_SECONDS = 0.2
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def dg_dev_command(workspace: Path, host: str, port: int) -> list[str]:
    """`dg dev -w WORKSPACE -h HOST -p PORT` for this interpreter: the command Dagster recommends.

    With a workspace file `dg dev` starts Dagster's dev server directly (no dg project lookup),
    and without `dagster dev`'s SupersessionWarning."""
    dg = Path(sysconfig.get_path("scripts")) / "dg"
    entry = (
        [str(dg)] if dg.is_file() else [sys.executable, ISOLATED, "-c", "from dagster_dg_cli.cli import main; main()"]
    )
    return [*entry, "dev", "-w", str(workspace), "-h", host, "-p", str(port)]


def port_taken(host: str, port: int) -> bool:
    """Whether something already listens on host:port (where the webserver, failing to bind, would
    log the error and keep running without serving)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False  # the webserver will say what is wrong with the host
    family, kind, proto, _name, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError:
            return True
    return False


@dataclass
class Outcome:
    """How a supervised command ended."""

    returncode: int | None = None  # the command's own exit status (negative: killed by that signal)
    stop_signal: int | None = None  # the signal that asked us to stop, None when it ended by itself
    killed: bool = False  # some of its processes needed SIGKILL after the grace period
    left: list[int] = field(default_factory=list)  # pids of its group still alive at the end (none expected)
    seconds: float = 0.0  # from the stop signal (or the command's end) until its group was empty


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def _has_exited(pid: int) -> bool:
    """Whether our child `pid` has ended, without reaping it: its zombie keeps the group id reserved."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def run_supervised(
    command: Sequence[str], env: Mapping[str, str], *, grace: float = GRACE_SECONDS, on_stop: str = ""
) -> Outcome:
    """Run `command` in a process group of its own until it ends or we get SIGINT, SIGTERM or SIGHUP.

    On such a signal the whole group gets SIGINT, and SIGKILL after `grace` seconds (at once on a
    second signal). Returns when no process of the group is alive. `on_stop` is printed on stderr
    when a signal arrives. SIGHUP ignored on entry (`nohup`) stays ignored."""
    received: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)

    previous = {}
    for signum in STOP_SIGNALS:
        if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
            continue
        previous[signum] = signal.signal(signum, on_signal)
    outcome = Outcome()
    try:
        # stdin from /dev/null: a process group that is not the terminal's foreground must not read it.
        # Dagster logs to stdout (configure_loggers); ours holds one JSON document, so its output goes
        # to our stderr.
        child = subprocess.Popen(
            list(command), env=dict(env), stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(), process_group=0
        )
        pgid = child.pid
        deadline: float | None = None
        ended_at: float | None = None
        try:
            while True:
                now = time.monotonic()
                if received and outcome.stop_signal is None:
                    outcome.stop_signal = received[0]
                    if on_stop:
                        print(on_stop.format(signal=signal.Signals(received[0]).name), file=sys.stderr, flush=True)
                    # What a terminal's Ctrl-C does: Dagster's processes each shut down on SIGINT.
                    _signal_group(pgid, signal.SIGINT)
                    ended_at, deadline = now, now + grace
                if len(received) > 1 and deadline is not None:
                    deadline = min(deadline, now)  # asked twice: do not wait
                if deadline is None and _has_exited(pgid):
                    # It ended on its own: whatever it left in its group gets the same treatment.
                    _signal_group(pgid, signal.SIGINT)
                    ended_at, deadline = now, now + grace
                if deadline is None:  # running: nothing to scan /proc for
                    time.sleep(POLL_SECONDS)
                    continue
                members = group_members(pgid)
                if not members:  # the leader is a member until it ends, so this is the end of everything
                    break
                if now >= deadline:
                    if not outcome.killed:
                        outcome.killed = True
                        _signal_group(pgid, signal.SIGKILL)
                    elif now >= deadline + KILL_WAIT_SECONDS:
                        outcome.left = members
                        break
                time.sleep(POLL_SECONDS)
        except BaseException:
            _signal_group(pgid, signal.SIGKILL)  # never leave the group behind us
            raise
        outcome.returncode = child.wait()
        outcome.seconds = time.monotonic() - (ended_at or time.monotonic())
        return outcome
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
