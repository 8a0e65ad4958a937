"""Children isolated from the working directory while they start, and the caller's environment as it
was afterwards: a test process that launched a run must still run `python -m tests...` from the repo."""

from __future__ import annotations

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
