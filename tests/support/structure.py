"""Measures of the package's structure, for the layering test and for anyone to rerun:

    python -m tests.support.structure

- the largest class counted with its in-project bases (lines and methods, each base once);
- `_private` names of this package used outside the module that defines them (imported, or reached
  through an object: `store._bump(...)`, or through `self` in a class whose own module never defines
  the name: a mixin using its sibling's); other libraries' (`os._exit`) are listed apart;
- import circles among the package's modules, function-level imports included (type-checking ones not);
- upward imports: a `lib` domain importing one above it (LIB_ORDER), function-level included.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "memory_pipelines"
ROOT = PACKAGE.name
LIB_ORDER = ["infra", "memories", "stores", "backups", "forget", "notify", "agent_runs", "retention", "evaluation"]


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


@dataclass
class ClassInfo:
    module: str
    name: str
    lines: int
    methods: int
    bases: list[str] = field(default_factory=list)  # names as written


def _trees() -> Iterator[tuple[str, ast.Module]]:
    for name, path in MODULES.items():
        yield name, ast.parse(path.read_text(encoding="utf-8"))


def _not_type_checking(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node of the module except those under `if TYPE_CHECKING:`."""
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def imports(tree: ast.Module) -> set[str]:
    """Modules of the package this module imports anywhere (a name imported from a package counts as
    its module when it is one)."""
    found: set[str] = set()
    for node in _not_type_checking(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in MODULES)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                if candidate in MODULES:
                    found.add(candidate)
                elif node.module in MODULES:
                    found.add(node.module)
    return found


def classes() -> dict[str, ClassInfo]:
    found: dict[str, ClassInfo] = {}
    for module, tree in _trees():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in node.body)
                bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found[f"{module}.{node.name}"] = ClassInfo(module, node.name, lines, methods, bases)
    return found


def with_bases(all_classes: dict[str, ClassInfo]) -> list[tuple[str, int, int]]:
    """(class, lines, methods) counted with every in-project base once, largest first."""
    by_name: dict[str, list[str]] = {}
    for key, info in all_classes.items():
        by_name.setdefault(info.name, []).append(key)

    def closure(key: str, seen: set[str]) -> set[str]:
        if key in seen:
            return seen
        seen.add(key)
        for base in all_classes[key].bases:
            for candidate in by_name.get(base, []):
                closure(candidate, seen)
        return seen

    measured = []
    for key in all_classes:
        family = closure(key, set())
        measured.append((key, sum(all_classes[k].lines for k in family), sum(all_classes[k].methods for k in family)))
    return sorted(measured, key=lambda m: -m[1])


def _defined_names(tree: ast.Module) -> set[str]:
    """Names a module defines: functions, classes, methods, module and `self.` attributes it assigns."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _all_private_uses() -> list[tuple[str, str, str]]:
    """(module, name, expression) for each `_private` name used in a module that does not define it."""
    found = []
    for module, tree in _trees():
        defined = _defined_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(ROOT):
                found += [(module, a.name, a.name) for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in defined:
                found.append((module, node.attr, ast.unparse(node)))
    return found


def _ours() -> set[str]:
    names: set[str] = set()
    for _, tree in _trees():
        names |= _defined_names(tree)
    return names


def private_uses() -> list[str]:
    """`module: expression` for each `_private` name of this package used in a module that does not
    define it."""
    ours = _ours()
    return [f"{module}: {expr}" for module, name, expr in _all_private_uses() if name in ours]


def foreign_private_uses() -> list[str]:
    """`_private` names of other libraries reached (`os._exit`, `DagsterGrpcClient._query`): not ours to
    make public; `launch/dagster_internals.py` is where Dagster's are meant to live."""
    ours = _ours()
    return [f"{module}: {expr}" for module, name, expr in _all_private_uses() if name not in ours]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def circles() -> list[list[str]]:
    graph = {name: imports(tree) - {name} for name, tree in _trees()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _domain(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "lib" and parts[2] in LIB_ORDER else None


def upward_imports() -> list[str]:
    found = []
    for module, tree in _trees():
        here = _domain(module)
        if here is None:
            continue
        for imported in sorted(imports(tree)):
            there = _domain(imported)
            if there is not None and LIB_ORDER.index(there) > LIB_ORDER.index(here):
                found.append(f"{module} -> {imported}")
    return found


def summary() -> dict[str, object]:
    largest = with_bases(classes())[0]
    privates = private_uses()
    return {
        "largest_class_with_bases": {"class": largest[0], "lines": largest[1], "methods": largest[2]},
        "cross_module_private_uses": len(privates),
        "other_libraries_private_uses": foreign_private_uses(),
        "circles": circles(),
        "upward_imports": upward_imports(),
    }


if __name__ == "__main__":
    print(json.dumps(summary(), indent=2))
