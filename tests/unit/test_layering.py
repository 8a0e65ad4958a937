"""The package's layering, read from the source: `lib` never imports dagster nor anything above it,
no import cycle and each domain of `lib` imports only the domains below it (function-level imports
included, measured by tests/support/structure.py), classes and functions of a readable size."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "memory_pipelines"
ROOT = "memory_pipelines"
# Domains of lib, each importing only those before it, lazily or not.
LIB_ORDER = ["infra", "memories", "stores", "backups", "forget", "notify", "agent_runs", "retention", "evaluation"]
ABOVE_LIB = ("defs", "resources", "cli", "platform", "launch", "demo", "definitions")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path, *, module_level: bool) -> set[str]:
    """Modules `path` imports (resolved to modules of this package where it names one)."""
    tree = ast.parse(path.read_text())
    nodes: list[ast.AST] = []
    if module_level:
        for node in tree.body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue  # hints only
            nodes.extend(ast.walk(node) if isinstance(node, ast.If | ast.Try) else [node])
    else:
        nodes = list(ast.walk(tree))
    found: set[str] = set()
    for each in nodes:
        if isinstance(each, ast.Import):
            found.update(alias.name for alias in each.names)
        elif isinstance(each, ast.ImportFrom) and each.module and each.level == 0:
            for alias in each.names:
                candidate = f"{each.module}.{alias.name}"
                found.add(candidate if candidate in MODULES else each.module)
    return found


def test_lib_never_imports_dagster_nor_anything_above_it():
    offenders = []
    for name, path in MODULES.items():
        if not name.startswith(f"{ROOT}.lib"):
            continue
        for imported in _imports(path, module_level=False):
            top = imported.split(".")
            if top[0] == "dagster" or top[0].startswith("dagster_"):
                offenders.append((name, imported))
            elif top[0] == ROOT and len(top) > 1 and top[1] in ABOVE_LIB:
                offenders.append((name, imported))
    assert offenders == []


def test_every_lib_package_is_a_known_domain():
    domains = {p.name for p in (PACKAGE / "lib").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert domains == set(LIB_ORDER)
    # Beside the domains only the composition root (`runtime`: everything opened from Settings) and
    # the typed results that leave the library (`results`).
    modules = {p.stem for p in (PACKAGE / "lib").glob("*.py")} - {"__init__"}
    assert modules == {"runtime", "results"}


# Larger ones need a written reason here (none today): a class reads in one sitting, a function on a screen.
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 80
LONGER_BY_DESIGN: dict[str, str] = {}


def test_no_class_over_400_lines_and_no_function_over_80():
    """A class is measured with every in-project base it inherits (a mixin lattice is one class to
    read), as `tests/support/structure.py` counts it."""
    from tests.support import structure

    too_long = [
        (name, lines)
        for name, lines, _ in structure.with_bases(structure.classes())
        if lines > MAX_CLASS_LINES and name not in LONGER_BY_DESIGN
    ]
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES and f"{name}.{node.name}" not in LONGER_BY_DESIGN:
                    too_long.append((f"{name}.{node.name}", lines))
    assert too_long == []


def test_no_import_circle_and_no_upward_import_even_inside_functions():
    """A function-level import is still a dependency: `tests/support/structure.py` counts them too."""
    from tests.support import structure

    assert structure.LIB_ORDER == LIB_ORDER
    assert structure.circles() == []
    assert structure.upward_imports() == []


# `_private` names of this package used outside their module (a mixin reaching into its sibling,
# `store._bump(...)`): 149 when counted first (2026-12-05), 0 once the stores, backups and services
# held their parts instead of inheriting them. Other libraries' (`os._exit`) are not counted.
def test_no_private_name_is_used_outside_its_module():
    from tests.support import structure

    assert structure.private_uses() == []
