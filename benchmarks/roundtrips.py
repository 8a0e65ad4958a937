"""Round trips a benchmark's code makes, counted in this process: PostgreSQL statements and Chroma
HTTP requests. For benchmarks only (it patches psycopg and httpx classes while it counts).

psycopg has no global hook, so `RoundTrips.counting()` wraps, for its block:
- `psycopg.Cursor.execute`, `executemany` and `copy` (a `Connection.execute` goes through its
  cursor's, so it counts once): statements;
- `psycopg.Connection._exec_command`: BEGIN, COMMIT, ROLLBACK and SAVEPOINT of `conn.transaction()`,
  each a round trip of its own (counted apart, as `tx`);
- `psycopg.Connection.connect`: new connections (each a few round trips of the handshake);
- `httpx.Client.send`: every request to the Chroma server (chromadb's client and our REST reader).

A block of code is attributed to a label (`with rt.label("verify"): ...`, a context variable, so
the cascade's worker threads, which run in a copy of their caller's context, count under their
caller's label); code under no label counts under "". `RoundTrips.label_methods` labels an object's
methods for a block.
"""

from __future__ import annotations

import contextvars
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

__all__ = ["KINDS", "RoundTrips"]

KINDS = ("pg", "tx", "connect", "chroma")


class RoundTrips:
    """Counts of round trips by (label, kind); kinds are KINDS (see the module docstring)."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._label: contextvars.ContextVar[str] = contextvars.ContextVar(f"round-trips-{id(self)}", default="")

    def _add(self, kind: str) -> None:
        with self._lock:
            self.counts[(self._label.get(), kind)] += 1

    @contextmanager
    def label(self, name: str) -> Iterator[None]:
        token = self._label.set(name)
        try:
            yield
        finally:
            self._label.reset(token)

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()

    def total(self, kind: str) -> int:
        return sum(n for (_, k), n in self.counts.items() if k == kind)

    def by_label(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (label, kind), n in sorted(self.counts.items()):
            out.setdefault(label, dict.fromkeys(KINDS, 0))[kind] += n
        return out

    def snapshot(self) -> dict[str, Any]:
        return {"total": {kind: self.total(kind) for kind in KINDS}, "steps": self.by_label()}

    @contextmanager
    def label_methods(self, obj: Any, labels: dict[str, Callable[..., str]]) -> Iterator[None]:
        """While the block runs, each named method of `obj` runs under the label its function gives
        (called with the method's arguments); an instance attribute shadows the class's method."""
        originals = {name: getattr(obj, name) for name in labels}

        def wrap(name: str) -> Callable[..., Any]:
            method, naming = originals[name], labels[name]

            def labelled(*args: Any, **kwargs: Any) -> Any:
                with self.label(naming(*args, **kwargs)):
                    return method(*args, **kwargs)

            return labelled

        for name in labels:
            setattr(obj, name, wrap(name))
        try:
            yield
        finally:
            for name in labels:
                delattr(obj, name)

    @contextmanager
    def counting(self) -> Iterator[RoundTrips]:
        import httpx
        import psycopg

        def counted(cls: Any, attr: str, kind: str) -> Any:
            original = getattr(cls, attr)

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self._add(kind)
                return original(*args, **kwargs)

            wrapper.__wrapped__ = original  # type: ignore[attr-defined]
            return original, wrapper

        patches = [
            (psycopg.Cursor, "execute", "pg"),
            (psycopg.Cursor, "executemany", "pg"),
            (psycopg.Cursor, "copy", "pg"),
            (psycopg.Connection, "_exec_command", "tx"),
            (httpx.Client, "send", "chroma"),
        ]
        with ExitStack() as stack:
            for cls, attr, kind in patches:
                original, wrapper = counted(cls, attr, kind)
                own = attr in cls.__dict__  # else inherited: deleted again, not set on the subclass
                setattr(cls, attr, wrapper)
                if own:
                    stack.callback(setattr, cls, attr, original)
                else:
                    stack.callback(delattr, cls, attr)
            # `psycopg.connect` is Connection.connect bound at import: the module's name is replaced.
            connect = psycopg.connect

            def connecting(*args: Any, **kwargs: Any) -> Any:
                self._add("connect")
                return connect(*args, **kwargs)

            psycopg.connect = connecting
            stack.callback(setattr, psycopg, "connect", connect)
            yield self
