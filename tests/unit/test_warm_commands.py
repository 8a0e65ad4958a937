"""What the command forker (memory_pipelines/launch/warm_commands.py) is told to run, and how a HOME
names its forker."""

from __future__ import annotations

import importlib
import os
import tomllib
from pathlib import Path

from memory_pipelines.launch import serve_code
from memory_pipelines.launch.warm_commands import process_facts
from memory_pipelines.lib.infra.code_runtime import link_of
from memory_pipelines.lib.infra.paths import PROJECT_ROOT


def test_the_forker_runs_the_programs_own_main() -> None:
    scripts = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["memory-pipelines"] == serve_code.COMMANDS


def test_a_home_reached_through_a_link_names_the_same_forker(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "alias").symlink_to(home)
    assert link_of(tmp_path / "alias", tmp_path) == link_of(home, tmp_path) != link_of(tmp_path, tmp_path)


def test_a_caller_niced_otherwise_differs_in_its_facts() -> None:
    before = process_facts(os.environ)
    pid = os.fork()
    if pid == 0:  # the child reports by its exit code whether its facts still matched
        os.nice(1)
        os._exit(0 if process_facts(os.environ) == before else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1
    assert process_facts(os.environ) == before


def test_the_fork_server_builds_the_definitions_its_run_workers_start_with() -> None:
    assert serve_code.preload()[-1] == serve_code.BUILT  # after the modules the build imports
    pid = os.fork()
    if pid == 0:  # a process as the fork server is once it has imported BUILT; reports by its exit code
        from memory_pipelines.definitions import build_for

        build_for.cache_clear()
        importlib.reload(importlib.import_module(serve_code.BUILT))  # an import alone may find it imported
        os._exit(0 if build_for.cache_info().currsize == 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
