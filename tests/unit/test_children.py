"""Children isolated from the working directory while they start, and the caller's environment as it
was afterwards: a test process that launched a run must still run `python -m tests...` from the repo."""

from __future__ import annotations

import sys
from pathlib import Path

from memory_pipelines.launch import code_server
from memory_pipelines.lib.infra import processes
from memory_pipelines.lib.infra.children import children_isolated, isolated_env


def test_children_are_isolated_meanwhile_and_the_environment_is_restored_after() -> None:
    environ = {"PYTHONPATH": "/somewhere", "PYTHONSAFEPATH": "", "KEEP": "1"}
    with children_isolated(environ):
        assert environ == {"PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1", "KEEP": "1"}
    assert environ == {"PYTHONPATH": "/somewhere", "PYTHONSAFEPATH": "", "KEEP": "1"}


def test_an_isolated_env_is_a_copy_without_import_paths() -> None:
    environ = {"PYTHONPATH": "/somewhere", "PYTHONUSERBASE": "/u", "PATH": "/bin"}
    assert isolated_env(environ) == {"PATH": "/bin", "PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1"}
    assert environ["PYTHONPATH"] == "/somewhere"


def test_the_warm_code_server_and_its_fork_server_are_known_as_dagster_processes(tmp_path: Path) -> None:
    """`stop`, `home_processes` and the suite's leak check find a process by its command line: the warm
    code server runs our entry, not `-m dagster`, and its run workers fork from multiprocessing's server."""
    server = code_server.command(tmp_path / "code.sock", 300)
    assert server[server.index("-m") + 1 : server.index("-m") + 4] == [
        "memory_pipelines.launch.serve_code",
        "api",
        "grpc",
    ]
    forkserver = [sys.executable, "-I", "-c", "from multiprocessing.forkserver import main; main(7, 8, ['__main__'])"]
    unrelated = [sys.executable, "-m", "memory_pipelines.cli", "status"]
    known = [
        processes.is_dagster_process(processes.Proc(1, 0, 1, 0, tuple(args)))
        for args in (server, forkserver, unrelated)
    ]
    assert known == [True, True, False]
