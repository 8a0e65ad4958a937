"""Nearest-vector queries of a tenant's collection: by text, by a vector embedded already, in batches.

Reads never create a collection (a forgotten tenant stays gone) and share the tenant's lock, so
none reads a collection an erasure is replacing.
"""

from __future__ import annotations

from typing import Any

from memory_pipelines.lib.stores.chroma.client import ChromaCollections, serialized, source_of
from memory_pipelines.lib.stores.chroma.locks import collection_name
from memory_pipelines.lib.stores.embedding import comparable_models

__all__ = [
    "QUERY_BATCH",
    "VectorSearch",
]

QUERY_BATCH = 256  # query vectors in one Chroma call (a server refuses ~10,000: "Payload too large")


class VectorSearch:
    """Queries of the tenant collections."""

    def __init__(self, collections: ChromaCollections) -> None:
        self.collections = collections
        self.locks = collections.locks

    def _searchable(self, tenant_id: str) -> Any | None:
        """The tenant's collection, when its vectors are of a model our queries can be compared with: one of
        another model (the embedder was changed, the rebuild has not run yet) answers nothing rather than
        nonsense, and hybrid recall falls back to its keyword part."""
        col = self.collections.existing(tenant_id)
        return col if col is not None and self._comparable(col.metadata) else None

    def _comparable(self, metadata: dict[str, Any] | None) -> bool:
        """A collection of this metadata holds vectors our embedder's queries can be compared with."""
        stored = (metadata or {}).get("embedding_model", self.collections.embedder.name)
        return comparable_models(str(stored), self.collections.embedder.name)

    def query(
        self, *, tenant_id: str, text: str, limit: int, where: dict[str, Any] | None
    ) -> list[tuple[tuple[str, int], float]]:
        """(memory_id, version) and cosine similarity of the nearest vectors, best first."""
        if self._searchable(tenant_id) is None:
            return []
        vector = self.collections.embedder.embed([text])
        with self.locks.tenant_lock(tenant_id, exclusive=False):
            col = self._searchable(tenant_id)
            if col is None:
                return []
            count = self.collections.call("counting", col.count)
            if count == 0:
                return []
            result = self.collections.call(
                "querying",
                lambda: col.query(
                    query_embeddings=vector,
                    n_results=min(limit, count),
                    where=where,
                    include=["metadatas", "distances"],
                ),
            )
        out = []
        for meta, distance in zip(result["metadatas"][0], result["distances"][0], strict=True):
            if not meta:
                continue  # a record caught mid-write or mid-erasure by another process: not an answer
            out.append(((str(meta["memory_id"]), int(meta["version"])), 1.0 - float(distance)))
        return out

    def nearest(
        self, *, tenant_id: str, vector: Any, limit: int, where: dict[str, Any] | None = None
    ) -> list[tuple[tuple[str, int], float]]:
        """Like `query`, for a query vector embedded already (recall may ask twice: it embeds once);
        ids and distances only, every hit is confirmed by the memory store anyway. No count first:
        Chroma 1.x answers a limit above it with what there is, and counting 100,000 took 18 ms.
        On a server, over its REST API (no chromadb import: see rest.py)."""
        if self.collections.url is not None:
            return self._nearest_rest(tenant_id, vector, limit, where)
        with self.locks.tenant_lock(tenant_id, exclusive=False):
            col = self._searchable(tenant_id)
            if col is None:
                return []
            result = self.collections.call(
                "querying",
                lambda: col.query(query_embeddings=[vector], n_results=limit, where=where, include=["distances"]),
            )
        return [(source_of(i), 1.0 - float(d)) for i, d in zip(result["ids"][0], result["distances"][0], strict=True)]

    def _nearest_rest(
        self, tenant_id: str, vector: Any, limit: int, where: dict[str, Any] | None
    ) -> list[tuple[tuple[str, int], float]]:
        rest = self.collections.rest()
        with self.locks.tenant_lock(tenant_id, exclusive=False):
            found = rest.collection(collection_name(tenant_id))
            if found is None or not self._comparable(found["metadata"]):
                return []
            hits = rest.nearest(found["id"], [float(x) for x in vector], limit=limit, where=where)
        return [(source_of(record_id), 1.0 - float(distance)) for record_id, distance in hits]

    @serialized
    def query_many(self, *, tenant_id: str, texts: list[str], limit: int) -> list[list[tuple[str, int]]]:
        """Nearest (memory_id, version) for many texts: one embedding batch, one Chroma call."""
        if not texts or self._searchable(tenant_id) is None:
            return [[] for _ in texts]
        return self.query_vectors(
            tenant_id=tenant_id, vectors=list(self.collections.embedder.embed(texts)), limit=limit
        )

    @serialized
    def query_vectors(self, *, tenant_id: str, vectors: list[Any], limit: int) -> list[list[tuple[str, int]]]:
        """Nearest (memory_id, version) for query vectors already computed, a few hundred a Chroma call."""
        with self.locks.tenant_lock(tenant_id, exclusive=False):
            # Vectors given (a forget's probes are the collection's own), so any model's collection is searched.
            col = self.collections.existing(tenant_id)
            if col is None or not vectors:
                return [[] for _ in vectors]
            count = self.collections.call("counting", col.count)
            if count == 0:
                return [[] for _ in vectors]
            found: list[list[tuple[str, int]]] = []
            for start in range(0, len(vectors), QUERY_BATCH):
                part = vectors[start : start + QUERY_BATCH]
                result = self.collections.call(
                    "querying",
                    lambda: col.query(query_embeddings=part, n_results=min(limit, count), include=[]),  # noqa: B023
                )
                found += [[source_of(record_id) for record_id in ids] for ids in result["ids"]]
        return found
