"""Dagster instances a test entered and never left.

`DagsterInstance.__enter__` makes the instance's defs-state storage the current one (a ContextVar),
and its `__exit__` puts back the one that was current before. An instance entered and never left
(`dg.build_schedule_context(instance=...)` reopens the instance from its ref on the context's exit
stack, so using that context without `with` does it) is left only when the garbage collector frees
it: at any later moment, in whatever test then runs. That test's next definitions load then finds a
disposed instance's storage ("Attempted to resolve undefined DagsterInstance weakref") or one whose
temporary files are gone ("unable to open database file"), as two CI runs did. The suite watches each
test's call instead (tests/conftest.py), leaves what it left open, and fails that test by name.

Also: how many sessions an instance's database has had, to count the connections its storages open.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["database_sessions", "entered", "entered_at", "leave"]

TESTS = Path(__file__).resolve().parents[1]


@contextmanager
def entered() -> Iterator[list[Any]]:
    """While open, the DagsterInstances entered and not yet left (with where), in the order entered."""
    from dagster import DagsterInstance

    open_now: list[Any] = []
    enter, exit_ = DagsterInstance.__enter__, DagsterInstance.__exit__

    def __enter__(self: DagsterInstance) -> DagsterInstance:
        result = enter(self)
        open_now.append((self, entered_at(traceback.extract_stack())))
        return result

    def __exit__(self: DagsterInstance, *exc: Any) -> None:
        open_now[:] = [(instance, at) for instance, at in open_now if instance is not self]
        exit_(self, *exc)

    DagsterInstance.__enter__ = __enter__  # type: ignore[method-assign,assignment]
    DagsterInstance.__exit__ = __exit__  # type: ignore[method-assign]
    try:
        yield open_now
    finally:
        DagsterInstance.__enter__ = enter  # type: ignore[method-assign]
        DagsterInstance.__exit__ = exit_  # type: ignore[method-assign]


def entered_at(stack: traceback.StackSummary) -> str:
    """The innermost line of a test that led to the entry."""
    ours = [f for f in stack if f.filename.startswith(str(TESTS)) and f.filename != __file__]
    return f"{Path(ours[-1].filename).relative_to(TESTS.parent)}:{ours[-1].lineno}" if ours else "outside the tests"


def leave(open_now: list[Any]) -> list[str]:
    """Leave the instances still open, latest first (as nested `with` blocks would); where each was entered."""
    left = []
    for instance, at in reversed(list(open_now)):  # a copy: leaving one takes it out of `open_now`
        left.append(f"the instance of {instance.root_directory}, entered at {at}")
        instance.__exit__(None, None, None)
    open_now.clear()
    return left


def database_sessions(conninfo: str) -> int:
    """Sessions the database of `conninfo` has had (`pg_stat_database.sessions`, client backends
    only), once those that just ended are counted; reading it is one more."""
    import psycopg

    time.sleep(1.5)  # a backend that ended reports its session within a second
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute("SELECT sessions FROM pg_stat_database WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row[0])
