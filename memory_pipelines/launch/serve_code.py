"""`dagster api grpc` whose run workers start warm: the CLI's code server (code_server.py) runs this.

Dagster starts each run of a code server in a new interpreter ("spawn"), which imports Dagster,
dagster-postgres and the definitions again before the run's first step, in every `materialize`,
`forget --wait`, `backup` or `restore` (docs/performance.md, "Run workers forked warm", has the
figures). Here the server starts them from multiprocessing's fork server instead: a process, started
by the code server with its interpreter flags, environment and path, that imports those modules once
and forks a child per run. It imports modules only: no connection or model exists in it when it
forks, and a fork copies only the thread that forks (pyarrow's allocator keeps a background thread,
which its fork handlers leave to the parent).
"""

from __future__ import annotations

import multiprocessing
import pkgutil
import runpy
import sys
import tempfile
from pathlib import Path

from memory_pipelines.lib.infra.code_runtime import scratch_of

# What every run worker would import first; an import the fork server fails is left to the worker.
# With the modules of the defs folder (`preload`) and chromadb, which the Chroma store's client
# imports, they were about half of a small run's CPU in its worker (docs/performance.md).
PRELOAD = (
    "dagster._cli",
    "dagster._grpc.impl",
    "dagster_postgres",
    "memory_pipelines.definitions",
    "onnxruntime",
    "tokenizers",
    "chromadb",
)


# The program whose commands the server's command forker runs (warm_commands.py): pyproject's script.
COMMANDS = "memory_pipelines.cli:main"


# Imported last: it builds the definitions from the modules above.
BUILT = "memory_pipelines.launch.built_definitions"


def preload() -> list[str]:
    """PRELOAD, every module under memory_pipelines/defs/ (what loading the definitions imports), then
    BUILT."""
    import memory_pipelines.defs as folder

    modules = (found.name for found in pkgutil.walk_packages(folder.__path__, f"{folder.__name__}."))
    return [*PRELOAD, *modules, BUILT]


def main() -> None:
    from memory_pipelines.launch.dagster_internals import start_run_workers_from
    from memory_pipelines.launch.warm_commands import start_forker

    # The fork server's socket directory beside the server's own files, not in /tmp: a server killed
    # before it could remove it leaves it where the next command's sweep (code_runtime.py) finds it.
    socket = Path(sys.argv[sys.argv.index("--socket") + 1])
    scratch = scratch_of(socket)
    scratch.mkdir(mode=0o700, exist_ok=True)
    tempfile.tempdir = str(scratch)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload())
    start_run_workers_from(context)
    start_forker(context, socket, entry=COMMANDS)
    runpy.run_module("dagster", run_name="__main__", alter_sys=True)  # `python -m dagster`, with our arguments


if __name__ == "__main__":
    main()
