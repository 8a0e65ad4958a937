"""Tenant collections' names, and their cross-process locks for a Chroma server whose files are ours.

One collection per tenant, named by a digest of the tenant id. With a server whose files are ours
(url and path), an erasure replaces a tenant's collection (a new one under the same name) holding its lock
exclusively; writes and reads of the collection share it. Files under `path/.locks`, one per
collection name, locked with fcntl; reentrant per thread.
"""

from __future__ import annotations

import fcntl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from memory_pipelines.lib.infra.paths import tenant_hash

__all__ = [
    "CollectionLocks",
    "collection_name",
    "holds_any",
]

# Tenant collection locks this thread holds (see CollectionLocks.tenant_lock): taken once per thread.
_HELD = threading.local()


def collection_name(tenant_id: str) -> str:
    # Chroma names allow fewer characters than tenant ids; a digest is always valid and stable
    # (the same one names the tenant in other places that must not show its id).
    return "mem-" + tenant_hash(tenant_id)


class CollectionLocks:
    """The locks of the collections of one Chroma location (see the module docstring)."""

    def __init__(self, *, path: Path | None, url: str | None) -> None:
        self.path = path
        self.url = url

    @contextmanager
    def tenant_lock(self, tenant_id: str, *, exclusive: bool) -> Iterator[None]:
        """Across processes, for a server whose files are ours (url and path): an erasure rebuilds
        the tenant's collection (a new one under the same name) exclusively, while writes and
        reads of it share the lock, so none writes into or reads the collection being replaced.

        Always taken last, after any PostgreSQL lock, and never held while waiting for one.
        Reentrant per thread. Without a local path (an external server, maybe shared by many
        machines) there is no lock: writes still reopen the collection by name first (ChromaCollections.current),
        but an erasure there can race another process's sync or query."""
        with self.collection_lock(collection_name(tenant_id), exclusive=exclusive):
            yield

    @contextmanager
    def collection_lock(self, name: str, *, exclusive: bool, timeout: float | None = None) -> Iterator[bool]:
        """The lock of collection `name` (see tenant_lock); yields whether it is held: always
        without `timeout`, else False when another process kept it for `timeout` seconds."""
        if self.url is None or self.path is None:
            yield True
            return
        held: set[str] = getattr(_HELD, "names", None) or set()
        _HELD.names = held
        key = f"{self.path}|{name}"
        if key in held:
            yield True
            return
        lock_dir = self.path / ".locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        with open(lock_dir / f"{name}.lock", "a+") as fh:
            mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            if timeout is None:
                fcntl.flock(fh.fileno(), mode)
            else:
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        fcntl.flock(fh.fileno(), mode | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            yield False
                            return
                        time.sleep(0.05)
            held.add(key)
            try:
                yield True
            finally:
                held.discard(key)
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def holds(self, tenant_id: str) -> bool:
        """Whether this thread holds the tenant's collection lock."""
        return f"{self.path}|{collection_name(tenant_id)}" in (getattr(_HELD, "names", None) or set())


def holds_any() -> bool:
    """Whether this thread holds any collection's lock."""
    return bool(getattr(_HELD, "names", None))
