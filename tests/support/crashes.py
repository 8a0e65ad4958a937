"""The crash tests' harness: a step of a lifecycle operation run in a child process on a HOME and
killed (SIGKILL) at a named point of our code (memory_pipelines/lib/infra/faults.py), as the OOM
killer or a power cut would end it; then what the next command finds is checked.

`run_killed` insists the child died at the point: a point renamed or never reached fails the test
instead of passing it without a crash. The steps before it run in the test's process (`run_here`);
what follows it runs in a new process (`run_ok`, the CLI), as the next command would.

Each child is forked from a fork server (multiprocessing's, one per test process) that has imported
the modules every child imports (CHILDREN_IMPORT) and nothing else: no connection, thread or model,
as the warm code server's fork server does for run workers (memory_pipelines/launch/serve_code.py).
A child started as `python -c` spent most of its CPU importing them (docs/development.md).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import traceback
from pathlib import Path
from typing import Any

from memory_pipelines.lib.infra.faults import ENV_CRASH_AT

# What each child runs first: the Python API on the HOME it is given.
PRELUDE = "from memory_pipelines import MemoryPlatform\nmp = MemoryPlatform.from_env()\n"


# What every child imports before or while its code runs (chromadb with the first Chroma request).
CHILDREN_IMPORT = [
    "memory_pipelines.platform",
    "memory_pipelines.lib.forget.erasure",
    "memory_pipelines.lib.stores.derived",
    "chromadb",
    "onnxruntime",
    "tokenizers",
]
FORKS = multiprocessing.get_context("forkserver")


def child_main(code: str, env: dict[str, str], out: str, err: str) -> None:
    """A child's body: `code` as `python -c` would run it, with exactly `env`, printing to `out`/`err`."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        with open(path, "w") as target:
            os.dup2(target.fileno(), fd)
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()


def _run(home: Path, code: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    FORKS.set_forkserver_preload(CHILDREN_IMPORT)
    with tempfile.TemporaryDirectory(prefix="crash-child-") as scratch:
        out, err = os.path.join(scratch, "out"), os.path.join(scratch, "err")
        full_env = {**os.environ, "MEMORY_PIPELINES_HOME": str(home), **env}
        child = FORKS.Process(target=child_main, args=(PRELUDE + textwrap.dedent(code), full_env, out, err))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(f"child of {home}", timeout)
        read = [Path(path).read_text(errors="replace") if os.path.exists(path) else "" for path in (out, err)]
        exitcode = child.exitcode
        child.close()
    return subprocess.CompletedProcess([code], exitcode, read[0], read[1])


def run_killed(home: Path, point: str, code: str, *, env: dict[str, str] | None = None, timeout: float = 300) -> None:
    """Run `code` (after PRELUDE, `mp` in scope) in a child killed at `point` (`name` or `name#n`)."""
    proc = _run(home, code, {**(env or {}), ENV_CRASH_AT: point}, timeout)
    assert proc.returncode == -signal.SIGKILL, (
        f"the child was not killed at {point} (exit {proc.returncode}):\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    )


def cli_lost_with_its_host(home: Path, point: str, *args: str, timeout: float = 300) -> None:
    """Run the CLI command `args` with a code server of its own (--verbose), in a session of its own,
    and kill its whole process group at `point` of a run worker: the command, its code server and the
    worker die together, as when their host is lost. Nobody is left to record how the run ended."""
    from tests.conftest import CLI

    proc = subprocess.run(
        [str(CLI), "--verbose", *args],
        env={**os.environ, "MEMORY_PIPELINES_HOME": str(home), ENV_CRASH_AT: f"{point}@group"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        start_new_session=True,
    )
    assert proc.returncode == -signal.SIGKILL, (
        f"{args} was not killed at {point} (exit {proc.returncode}):\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    )


def run_ok(home: Path, code: str, *, env: dict[str, str] | None = None, timeout: float = 300) -> str:
    """Run `code` (after PRELUDE) in a child that must succeed; returns its stdout."""
    proc = _run(home, code, env or {}, timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def run_here(home: Path, code: str) -> str:
    """Run `code` (after PRELUDE) in this process on `home`, for the steps before the one killed, where
    a process of its own proves nothing more (the killed step and the next command get theirs);
    returns what it printed. `mp` is closed afterwards, and the environment is as it was."""
    saved = os.environ.get("MEMORY_PIPELINES_HOME")
    os.environ["MEMORY_PIPELINES_HOME"] = str(home)
    scope: dict[str, Any] = {}
    try:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                exec(PRELUDE + textwrap.dedent(code), scope)
            finally:
                mp = scope.get("mp")
                if mp is not None:
                    mp.close()
    finally:
        if saved is None:
            os.environ.pop("MEMORY_PIPELINES_HOME", None)
        else:
            os.environ["MEMORY_PIPELINES_HOME"] = saved
    return out.getvalue()


def artifacts_under(root: Path) -> list[Path]:
    """Every announced artifact's lock file under `root` (lib/infra/artifacts.py), and anything named
    like a scratch directory or a partial upload: what a crash leaves if nobody sweeps."""
    found = []
    for path in root.rglob("*"):
        name = path.name
        if name.endswith(".artifact") or name.startswith("scratch-") or ".part" in name:
            found.append(path)
    return sorted(found)
