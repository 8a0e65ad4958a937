"""One front door: the CLI does everything through `MemoryPlatform`, whose answers are typed.

No service is needed: the CLI's source is read with `ast`, and commands run in-process against a
stand-in platform that records which `MemoryPlatform` method each command called, with what.
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from memory_pipelines import cli
from memory_pipelines.lib import results
from memory_pipelines.platform import MemoryPlatform

PACKAGE = Path(cli.__file__).resolve().parent
CLI_SOURCE = PACKAGE / "cli.py"

# What the CLI may take from the library itself, and why; everything else goes through MemoryPlatform.
ALLOWED_FROM_LIB: dict[str, str] = {
    # errors, settings and process hygiene: the CLI's own contract (exit codes, --home, umask)
    "memory_pipelines.lib.infra.errors": "exceptions the CLI maps to exit codes, or raises for its arguments",
    "memory_pipelines.lib.memories.crypto.DecryptionError": "an exception the CLI maps to exit code 7",
    "memory_pipelines.lib.forget.ledger.DeletionBlocked": "a run that left its job BLOCKED: exit code 8",
    "memory_pipelines.lib.infra.children.isolated_env": "`dev`: nothing imported from the working directory",
    "memory_pipelines.lib.infra.settings": "--home, and the Settings a Dagster launch takes",
    "memory_pipelines.lib.infra.owner_only.restrict_umask": "what the command writes is the owner's alone",
    "memory_pipelines.lib.infra.progress.ENV_VERBOSE": "--verbose, read by the runs the command launches",
    "memory_pipelines.lib.infra.paths.PROJECT_ROOT": "`dev` names the workspace file",
    # input checks: they run before any service starts (tests/unit/test_cli_errors.py)
    "memory_pipelines.lib.infra.validation": "UTF-8 of arguments and stdin, reserved tenants",
    "memory_pipelines.lib.stores.analytics.store.parse_select": "analytics: the SQL, checked first",
    "memory_pipelines.lib.evaluation.evaluator.check_mode": "eval report: the mode, checked first",
    "memory_pipelines.lib.retention.rules": "retention: the day and the policy file, checked first",
    # managing HOME's services and processes: a MemoryPlatform would start what `stop` ends
    "memory_pipelines.lib.infra.services.stop_services": "stop",
    "memory_pipelines.lib.infra.services.ensure_services": "dev and env (the endpoints, not a store)",
    "memory_pipelines.lib.infra.services.ENV_DAGSTER_PG_URL_EXPORTED": "env",
}
# Commands that launch Dagster runs or manage processes only; every other command calls `_platform`.
DIRECT = {"cmd_materialize", "cmd_stop", "cmd_dev", "cmd_env", "cmd_demo"}


def _imports(tree: ast.Module) -> list[tuple[str, str | None, int]]:
    """(module, name, line) of every import, at any depth, except under `if TYPE_CHECKING:`."""
    found: list[tuple[str, str | None, int]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        if isinstance(node, ast.ImportFrom) and node.module:
            found.extend((node.module, alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend((alias.name, None, node.lineno) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _allowed(module: str, name: str | None) -> bool:
    return module in ALLOWED_FROM_LIB or f"{module}.{name}" in ALLOWED_FROM_LIB


def test_the_cli_takes_from_the_library_only_errors_settings_and_input_checks():
    tree = ast.parse(CLI_SOURCE.read_text(encoding="utf-8"))
    lib = [(m, n, line) for m, n, line in _imports(tree) if m.startswith("memory_pipelines.lib")]
    assert lib, "the walk found no import at all: is it reading cli.py?"
    refused = [f"cli.py:{line}: from {m} import {n}" for m, n, line in lib if not _allowed(m, n)]
    assert not refused, "call a MemoryPlatform method instead (or justify it in ALLOWED_FROM_LIB):\n" + "\n".join(
        refused
    )
    # `from memory_pipelines.lib.x import module` is covered by the same list, as `x.module`.
    assert not [m for m, n, _ in lib if n is None], "plain `import memory_pipelines.lib...` hides what is used"


def test_every_command_calls_the_platform_unless_it_only_launches_runs_or_manages_processes():
    tree = ast.parse(CLI_SOURCE.read_text(encoding="utf-8"))
    commands = {
        node.name: node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("cmd_")
    }
    parser = cli.build_parser()
    (sub,) = [action for action in parser._actions if action.dest == "command"]
    handlers = {command.get_default("handler").__name__ for command in sub.choices.values()}
    assert set(commands) == handlers and len(handlers) == 29
    for name, node in commands.items():
        called = {
            call.func.id for call in ast.walk(node) if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
        }
        assert not called & {"_store", "_derived"}, f"{name} reaches a part, not the platform"
        if name in DIRECT:
            assert "_platform" not in called, f"{name} calls the platform: take it off DIRECT"
        else:
            assert "_platform" in called, f"{name} bypasses MemoryPlatform"


def test_results_import_nothing_outside_lib_and_export_what_they_define():
    source = Path(results.__file__).read_text(encoding="utf-8")
    imported = {m for m, _, _ in _imports(ast.parse(source))}
    assert imported <= {"__future__", "typing"}, imported
    defined = [name for name, value in vars(results).items() if getattr(value, "__module__", None) == results.__name__]
    assert sorted(results.__all__) == sorted([*defined, "SyncCounts"])
    assert cli.__all__ == ["main"]


def _public_methods() -> dict[str, Any]:
    return {
        name: member
        for name, member in inspect.getmembers(MemoryPlatform, inspect.isfunction)
        if not name.startswith("_") and name != "close"
    }


def test_platform_methods_take_keyword_arguments_and_return_typed_answers():
    methods = _public_methods()
    assert len(methods) >= 45
    for name, method in methods.items():
        signature = inspect.signature(method)
        positional = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        assert [p.name for p in positional] == ["self"], f"{name}: keyword-only arguments"
        assert method.__doc__, f"{name}: a docstring"
        returned = str(signature.return_annotation)
        assert returned != "Row" and "Any" not in returned and "dict[" not in returned, f"{name} -> {returned}"


class _Recorder:
    """Stands in for the command's MemoryPlatform: records the method called, answers `answer`."""

    def __init__(self, answer: Any) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.answer = answer

    def __getattr__(self, name: str) -> Any:
        real = getattr(MemoryPlatform, name)  # only what MemoryPlatform has

        def call(**kwargs: Any) -> Any:
            inspect.signature(real).bind(None, **kwargs)  # the arguments the real method takes
            self.calls.append((name, kwargs))
            return self.answer

        return call


@pytest.mark.parametrize(
    ("argv", "method", "kwargs"),
    [
        (["tenants"], "tenants", {}),
        (["tenant", "create", "--tenant", "t1"], "create_tenant", {"tenant_id": "t1", "sharing_mode": "strict"}),
        (
            ["team", "add-member", "--tenant", "t1", "--team", "core", "--user", "ann"],
            "add_team_member",
            {"tenant_id": "t1", "team_id": "core", "user_id": "ann"},
        ),
        (
            ["do-not-sell", "--tenant", "t1", "--user", "ann", "--subject", "ann", "--off"],
            "set_do_not_sell",
            {"tenant_id": "t1", "memory_id": None, "subject": "ann", "value": False, "user_id": "ann"},
        ),
        (
            ["lineage", "--tenant", "t1", "--record", "chroma:x"],
            "lineage",
            {"tenant_id": "t1", "memory_id": None, "record": "chroma:x"},
        ),
        (["summary", "--tenant", "t1", "--team", "core"], "summary", {"tenant_id": "t1", "team_id": "core"}),
        (["analytics", "--tenant", "t1", "--sql", "SELECT 1"], "analytics", {"tenant_id": "t1", "sql": "SELECT 1"}),
        (["deletion", "status", "del_1"], "deletion_status", {"job_id": "del_1"}),
        (["deletion", "list", "--state", "BLOCKED"], "deletion_jobs", {"state": "BLOCKED", "tenant_id": None}),
        (["backup", "list", "--tenant", "t1"], "list_backups", {"tenant_id": "t1"}),
        (["backup", "sweep"], "sweep_backups", {}),
        (["restore", "--tenant", "t1", "--reopen"], "reopen_tenant", {"tenant_id": "t1"}),
        (
            ["keys", "shred", "--tenant", "t1", "--subject", "ann"],
            "shred_keys",
            {"tenant_id": "t1", "subject": "ann", "confirm": None},
        ),
        (["retention", "preview", "--date", "2025-01-01"], "retention_preview", {"day": "2025-01-01"}),
        (
            ["retention", "sweep", "--date", "2025-01-01"],
            "sweep_retention",
            {"day": "2025-01-01", "run": False},
        ),
        (["run", "revoke", "--lease", "lease_1"], "revoke_lease", {"lease_id": "lease_1"}),
        (
            ["run", "open", "--tenant", "t1", "--user", "ann", "--run", "r1"],
            "open_run",
            {"tenant_id": "t1", "subject_id": "ann", "run_id": "r1", "ttl_seconds": 300},
        ),
        (["explain", "--tenant", "t1", "--run", "r1"], "explain", {"tenant_id": "t1", "run_id": "r1"}),
    ],
)
def test_commands_call_the_platform_method_and_print_its_answer(monkeypatch, capsys, argv, method, kwargs):
    recorder = _Recorder({"answer": method})
    monkeypatch.setattr(cli, "_platform", lambda args: recorder)
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert recorder.calls == [(method, kwargs)]
    assert json.loads(capsys.readouterr().out) == {"answer": method}
