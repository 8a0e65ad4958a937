"""The Chroma client and the tenant's collection: connecting, opening, and reloading after an erasure.

A Chroma server (`chroma run`) is reached through HttpClient (`http_client`: over http(s), or HOME's
own server's door on a Unix socket); the embedded PersistentClient (path
only) is one per path for the whole process, and its operations are serialized (`serialized`).
Every Chroma failure becomes a ServiceError (`ChromaCollections.call`).
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import numpy as np

from memory_pipelines.lib.infra import unix_http
from memory_pipelines.lib.infra.errors import ServiceError
from memory_pipelines.lib.stores.chroma.locks import CollectionLocks, collection_name
from memory_pipelines.lib.stores.chroma.rest import ChromaRest, call_chroma
from memory_pipelines.lib.stores.embedding import Embedder

__all__ = [
    "ERASURES",
    "SPACE",
    "STORE",
    "ChromaCollections",
    "F",
    "HoldsCollections",
    "T",
    "http_client",
    "read_pages",
    "reopen_embedded",
    "require_unit",
    "serialized",
    "source_of",
]

STORE = "chroma"
T = TypeVar("T")

# One embedded client per path for the whole process. Chroma caches a loaded HNSW index per
# client system, and a stale copy held by a second client would write erased vectors back into
# the index files at its next persist (measured: see VectorStore.erase).
_EMBEDDED: dict[str, Any] = {}
_EMBEDDED_LOCK = threading.RLock()
# Collection metadata key counting erasures; another process that loaded the index before an
# erasure sees the count change and reloads from disk (see ChromaCollections._fresh).
ERASURES = "erasures"
# Inner product on our unit vectors ranks and scores as cosine does, but the index keeps the bytes it
# was sent: under "cosine" hnswlib re-normalises them, so about one vector in four sat in the log and
# in the index as two different byte strings, and a byte scan built from the one Chroma returns missed
# the other (measured 2026-12-06: 3 of 12 under cosine, 0 of 30 under "ip"; docs/forgetting.md).
SPACE = "ip"
_SEEN: dict[tuple[str, str], int] = {}
_REBUILD_PAGE = 5000  # vectors a get() carries


def require_unit(vectors: Any, *, model: str) -> None:
    """Refuse vectors that are not of unit length: inner product (SPACE) ranks as cosine only on those."""
    norms = np.linalg.norm(np.asarray(vectors, dtype=np.float64), axis=1)
    if norms.size and float(np.max(np.abs(norms - 1.0))) > 1e-3:
        raise ValueError(
            f"embedding model {model!r} gave vectors of length {float(norms.min()):.4g} to {float(norms.max()):.4g}:"
            " an Embedder must give unit vectors"
        )


def _embedded_client(path: Path) -> Any:
    with _EMBEDDED_LOCK:
        key = str(path.resolve())
        if key not in _EMBEDDED:
            import chromadb
            from chromadb.config import Settings as ChromaSettings

            path.mkdir(parents=True, exist_ok=True)
            _EMBEDDED[key] = chromadb.PersistentClient(path=key, settings=ChromaSettings(anonymized_telemetry=False))
        return _EMBEDDED[key]


F = TypeVar("F", bound=Callable[..., Any])


class HoldsCollections(Protocol):
    """What `serialized` decorates the methods (or first-argument functions) of: a holder of collections."""

    @property
    def collections(self) -> ChromaCollections: ...


def serialized(method: F) -> F:
    """Embedded Chroma: one operation at a time per process (see ChromaCollections.one_at_a_time),
    for a method of an object holding `collections`, or a function taking one first."""

    @functools.wraps(method)
    def wrapper(self: HoldsCollections, *args: Any, **kwargs: Any) -> Any:
        with self.collections.one_at_a_time():
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _serialized(method: F) -> F:
    """`serialized`, for ChromaCollections' own methods."""

    @functools.wraps(method)
    def wrapper(self: ChromaCollections, *args: Any, **kwargs: Any) -> Any:
        with self.one_at_a_time():
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def reopen_embedded() -> None:
    """Drop every loaded index in this process; the next call loads them from disk afresh."""
    from chromadb.api.shared_system_client import SharedSystemClient

    with _EMBEDDED_LOCK:
        for client in _EMBEDDED.values():
            # Stop the old system so no stale index survives in memory (clearing the cache alone
            # leaves it running for whoever still holds one of its collections).
            try:
                client._system.stop()
            except Exception:  # a system that cannot stop is being dropped anyway
                pass
        SharedSystemClient.clear_system_cache()
        _EMBEDDED.clear()
        _SEEN.clear()


def read_pages(col: Any, *, include: list[str], ids: Sequence[str] | None = None) -> dict[str, list[Any]]:
    """`col.get` in pages of _REBUILD_PAGE: one get() past ~32,000 vectors (or ids) fails in Chroma
    with "too many SQL variables". Returns ids and the included fields, concatenated."""
    out: dict[str, list[Any]] = {"ids": [], **{field: [] for field in include}}
    offset = 0
    while True:
        if ids is not None:
            part = list(ids[offset : offset + _REBUILD_PAGE])
            if not part:
                break
            page = col.get(ids=part, include=include)
        else:
            page = col.get(include=include, limit=_REBUILD_PAGE, offset=offset)
            if not page["ids"]:
                break
        out["ids"] += list(page["ids"])
        for field in include:
            out[field] += list(page[field] if page[field] is not None else [])
        offset += _REBUILD_PAGE
    return out


_ROUTING = threading.Lock()


def http_client(url: str, *, headers: dict[str, str]) -> Any:
    """chromadb's HttpClient for the server at `url`: http(s), or a `unix://` door (lib/infra/unix_http.py).

    chromadb makes its httpx.Client inside its constructor, which also sends the first requests, and
    takes no transport: for a door, the httpx its module sees makes clients on the door's transport
    while the constructor runs, and is httpx itself again before anyone else's constructor starts."""
    import chromadb
    import chromadb.api.fastapi as fastapi
    import httpx
    from chromadb.config import Settings as ChromaSettings

    settings = ChromaSettings(anonymized_telemetry=False)
    transport = unix_http.httpx_transport(url)
    with _ROUTING:  # every constructor waits, or one for an http URL could see the door's httpx
        if transport is None:
            parts = urlsplit(url)
            return chromadb.HttpClient(
                host=parts.hostname or "localhost",
                port=parts.port or (443 if parts.scheme == "https" else 8000),
                ssl=parts.scheme == "https",
                headers=headers,
                settings=settings,
            )
        routed = types.SimpleNamespace(**vars(httpx))
        routed.Client = functools.partial(httpx.Client, transport=transport)
        fastapi.httpx = routed  # type: ignore[assignment]
        try:
            return chromadb.HttpClient(host="localhost", port=80, headers=headers, settings=settings)
        finally:
            fastapi.httpx = httpx


def source_of(record_id: str) -> tuple[str, int]:
    """The (memory_id, version) a record id `memory_id:version` names."""
    memory_id, _, version = record_id.rpartition(":")
    return memory_id, int(version)


class ChromaCollections:
    """The client of one Chroma location and the tenants' collections in it.

    `url` alone: a Chroma server whose files are not ours. `url` and `path`: a server keeping its
    files in `path` (ours, under HOME), so erasures also clear them. `path` alone: the embedded
    PersistentClient (one process only; unit tests). Holds the `locks` of the same location."""

    def __init__(
        self,
        *,
        embedder: Embedder,
        path: Path | None = None,
        url: str | None = None,
        revive: Callable[[], object] | None = None,
    ) -> None:
        if path is None and url is None:
            raise ValueError("give url (Chroma server, with path when its files are local) or path (embedded)")
        self.embedder = embedder
        self.path = path
        self.url = url
        # Starts the server again when nothing answers at `url` (HOME's own, whose door keeps its path).
        self.revive = revive
        self.locks = CollectionLocks(path=path, url=url)
        self._client: Any = None
        self._rest: ChromaRest | None = None
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        return self.url or str(self.path)

    @property
    def embedded(self) -> bool:
        return self.url is None

    def one_at_a_time(self) -> AbstractContextManager[object]:
        """Embedded Chroma: one operation at a time per process, so an erasure's reload of the index
        never races another thread holding a collection of the old one. A server needs no such lock."""
        if self.url is not None:
            return nullcontext()
        return _EMBEDDED_LOCK

    def current(self, tenant_id: str, col: Any) -> Any:
        """A server's collection as it is now (an erasure elsewhere may have replaced the one we hold)."""
        if self.url is None:
            return col
        client = self.client()
        return self.call("opening the collection", lambda: client.get_collection(name=collection_name(tenant_id)))

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()`, its failure a ServiceError naming `what` (see call_chroma: a dead own server is revived)."""
        return call_chroma(what, fn, location=self.location, revive=self.revive)

    def client(self) -> Any:
        """The Chroma client: the process's embedded one for `path`, or an HttpClient made once."""
        if self.url is None:
            assert self.path is not None
            return _embedded_client(self.path)
        with self._lock:
            if self._client is None:
                from memory_pipelines.lib.infra.services import chroma_headers

                url = self.url
                assert url is not None
                # The token of HOME's own server (its door refuses requests without it), or
                # MEMORY_PIPELINES_CHROMA_TOKEN for an external one.
                headers = chroma_headers(url)
                self._client = self.call("connecting", lambda: http_client(url, headers=headers))
            return self._client

    def rest(self) -> ChromaRest:
        """The server's REST reader (recall's queries: no chromadb import); only with a `url`."""
        assert self.url is not None
        with self._lock:
            if self._rest is None:
                from memory_pipelines.lib.infra.services import chroma_headers

                self._rest = ChromaRest(self.url, headers=chroma_headers(self.url), revive=self.revive)
            return self._rest

    @_serialized
    def collection(self, tenant_id: str) -> Any:
        """The tenant's collection, created if missing (writes only: reads use `existing`)."""

        def open_it() -> Any:
            client = self.client()
            return self.call(
                "opening the collection",
                lambda: client.get_or_create_collection(
                    name=collection_name(tenant_id),
                    metadata={"tenant_id": tenant_id, "hnsw:space": SPACE, "embedding_model": self.embedder.name},
                    embedding_function=None,
                ),
            )

        return self._fresh(open_it)

    def _fresh(self, open_it: Callable[[], Any]) -> Any:
        """The collection, reloaded from disk first if another process erased vectors since we loaded it."""
        col = open_it()
        if self.url is not None or self.path is None or col is None:
            return col
        key = (str(self.path.resolve()), col.name)
        generation = int((col.metadata or {}).get(ERASURES, 0))
        with _EMBEDDED_LOCK:
            seen = _SEEN.setdefault(key, generation)
            if seen == generation:
                return col
            reopen_embedded()
            _SEEN[key] = generation
        return open_it()

    @_serialized
    def existing(self, tenant_id: str) -> Any | None:
        """The tenant's collection if it exists; reads must never create one (a forgotten tenant stays gone)."""
        name = collection_name(tenant_id)

        def open_it() -> Any:
            from chromadb.errors import NotFoundError as CollectionMissing

            client = self.client()
            # One call: listing collections first cost 0.1 s a read on a server holding many tenants.
            try:
                return self.call("opening the collection", lambda: client.get_collection(name=name))
            except ServiceError as exc:
                if isinstance(exc.__cause__, CollectionMissing):
                    return None
                raise

        return self._fresh(open_it)

    @_serialized
    def ids(self, tenant_id: str) -> set[str]:
        """The record ids (`memory_id:version`) in the tenant's collection."""
        with self.locks.tenant_lock(tenant_id, exclusive=False):
            col = self.collection(tenant_id)
            return set(self.call("listing ids", lambda: read_pages(col, include=[])["ids"]))
