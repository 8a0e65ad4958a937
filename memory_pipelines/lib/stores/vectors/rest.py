"""Nearest-vector queries straight over a Chroma server's REST API (v2), for recall.

Importing chromadb's client took about 0.5 s and making an HttpClient another 0.15 s (it asks the
server for its tenant and database first): a third of a CLI `recall` on a warm HOME. A query needs
two requests, the collection by name and its query, made here with httpx (which chromadb's own
client uses). Everything else (writes, erasures, reads of whole collections) stays on chromadb.
"""

from __future__ import annotations

import threading
from typing import Any
from urllib.parse import quote

from memory_pipelines.lib.infra.errors import ServiceError

__all__ = [
    "ChromaRest",
]

_DATABASE_PATH = "/api/v2/tenants/default_tenant/databases/default_database"


class ChromaRest:
    """The two read requests of a nearest-vector query, on one keep-alive connection."""

    def __init__(self, url: str, *, headers: dict[str, str], timeout: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self._headers = headers
        self._timeout = timeout
        self._client: Any = None
        self._lock = threading.Lock()

    def _http(self) -> Any:
        with self._lock:
            if self._client is None:
                import httpx

                self._client = httpx.Client(
                    base_url=self.url + _DATABASE_PATH, headers=self._headers, timeout=self._timeout
                )
            return self._client

    def _request(self, what: str, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http().request(method, path, **kwargs)
        except Exception as exc:  # httpx's transport errors: the server is not answering
            raise ServiceError("chroma", f"{what} failed against {self.url}: {type(exc).__name__}: {exc}") from exc
        return response

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
