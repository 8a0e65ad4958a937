"""Nearest-vector queries straight over a Chroma server's REST API (v2), for recall.

Importing chromadb's client took about 0.5 s and making an HttpClient another 0.15 s (it asks the
server for its tenant and database first): a third of a CLI `recall` on a warm HOME. A query needs
two requests, the collection by name and its query, made here with httpx (which chromadb's own
client uses). Everything else (writes, erasures, reads of whole collections) stays on chromadb.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote

from memory_pipelines.lib.infra import unix_http
from memory_pipelines.lib.infra.errors import MemoryPipelinesError, ServiceError

__all__ = [
    "ChromaRest",
    "call_chroma",
    "unreachable",
]

T = TypeVar("T")

_DATABASE_PATH = "/api/v2/tenants/default_tenant/databases/default_database"


def unreachable(exc: BaseException) -> bool:
    """`exc` says no server listens there (refused, or no socket file), so no request was sent. A
    door that is only busy (its backlog full: EAGAIN) is not that: its pair must not be restarted."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError | FileNotFoundError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def call_chroma(what: str, fn: Callable[[], T], *, location: str, revive: Callable[[], object] | None) -> T:
    """`fn()`, its failure a ServiceError naming `what` and `location`. When nothing answered and
    `revive` is given, the server is started again (by another process's rules: ensure_chroma) and
    `fn` tried once more: a request that never left cannot have been applied."""
    for attempt in (1, 2):
        try:
            return fn()
        except MemoryPipelinesError:
            raise
        except Exception as exc:  # chromadb raises many types; all mean the vector store failed us
            if attempt == 1 and revive is not None and unreachable(exc):
                revive()
                continue
            raise ServiceError("chroma", f"{what} failed against {location}: {type(exc).__name__}: {exc}") from exc
    raise AssertionError("unreachable")


class ChromaRest:
    """The two read requests of a nearest-vector query, on one keep-alive connection."""

    def __init__(
        self,
        url: str,
        *,
        headers: dict[str, str],
        timeout: float = 60.0,
        revive: Callable[[], object] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._headers = headers
        self._timeout = timeout
        self.revive = revive  # see ChromaCollections.revive
        self._client: Any = None
        self._lock = threading.Lock()

    def _http(self) -> Any:
        with self._lock:
            if self._client is None:
                import httpx

                transport = unix_http.httpx_transport(self.url)  # HOME's own server: its door's socket
                base = unix_http.BASE_URL if transport is not None else self.url
                self._client = httpx.Client(
                    base_url=base + _DATABASE_PATH, headers=self._headers, timeout=self._timeout, transport=transport
                )
            return self._client

    def _request(self, what: str, method: str, path: str, **kwargs: Any) -> Any:
        return call_chroma(
            what, lambda: self._http().request(method, path, **kwargs), location=self.url, revive=self.revive
        )

    def collection(self, name: str) -> dict[str, Any] | None:
        """The collection's id and metadata, or None when there is no such collection."""
        response = self._request("opening the collection", "GET", f"/collections/{quote(name, safe='')}")
        if response.status_code == 404:
            return None
        body = _json(response, "opening the collection", self.url)
        return {"id": str(body["id"]), "metadata": body.get("metadata") or {}}

    def nearest(
        self, collection_id: str, vector: list[float], *, limit: int, where: dict[str, Any] | None
    ) -> list[tuple[str, float]]:
        """(record id, cosine distance) of the nearest vectors, nearest first."""
        response = self._request(
            "querying",
            "POST",
            f"/collections/{quote(collection_id, safe='')}/query",
            json={"query_embeddings": [vector], "n_results": limit, "where": where, "include": ["distances"]},
        )
        body = _json(response, "querying", self.url)
        return list(zip(body["ids"][0], body["distances"][0], strict=True))

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _json(response: Any, what: str, url: str) -> Any:
    if response.status_code != 200:
        try:
            detail = response.json()
            message = f"{detail.get('error')}: {detail.get('message')}"
        except ValueError:
            message = response.text[:200]
        raise ServiceError("chroma", f"{what} failed against {url}: HTTP {response.status_code} {message}")
    return response.json()
