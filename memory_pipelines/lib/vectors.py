"""Vector index in Chroma: one collection per tenant, embeddings + ids + scope metadata, never documents.

Record id `memory_id:version`. Only current versions are indexed; a superseded version's vector is
removed when its successor is indexed. Works with an embedded PersistentClient under HOME or a
Chroma server (`chroma run`) through HttpClient.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from memory_pipelines.lib import lineage
from memory_pipelines.lib.embedding import Embedder
from memory_pipelines.lib.errors import MemoryPipelinesError, ServiceError
from memory_pipelines.lib.store import CurrentVersion, MemoryStore

STORE = "chroma"
EMBED_CHUNK = 512
T = TypeVar("T")


def collection_name(tenant_id: str) -> str:
    # Chroma names allow fewer characters than tenant ids; a digest is always valid and stable.
    return "mem-" + hashlib.sha256(tenant_id.encode()).hexdigest()[:32]


def metadata_of(cv: CurrentVersion) -> dict[str, Any]:
    return {
        "memory_id": cv.memory_id,
        "version": cv.version,
        "user_id": cv.user_id,
        "team_id": cv.team_id or "",
        "shareable": cv.shareable,
        "category": cv.category,
        "epoch": cv.epoch,
    }


class VectorStore:
    """Tenant collections in Chroma, synced from the memory store with lineage."""

    def __init__(self, *, embedder: Embedder, path: Path | None = None, url: str | None = None) -> None:
        if (path is None) == (url is None):
            raise ValueError("give exactly one of path (embedded Chroma) or url (Chroma server)")
        self.embedder = embedder
        self.path = path
        self.url = url
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        return self.url or str(self.path)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except MemoryPipelinesError:
            raise
        except Exception as exc:  # chromadb raises many types; all mean the vector store failed us
            raise ServiceError("chroma", f"{what} failed against {self.location}: {type(exc).__name__}: {exc}") from exc

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                import chromadb
                from chromadb.config import Settings as ChromaSettings

                settings = ChromaSettings(anonymized_telemetry=False)
                if self.url is not None:
                    parts = urlsplit(self.url)
                    self._client = self._call(
                        "connecting",
                        lambda: chromadb.HttpClient(
                            host=parts.hostname or "localhost",
                            port=parts.port or (443 if parts.scheme == "https" else 8000),
                            ssl=parts.scheme == "https",
                            settings=settings,
                        ),
                    )
                else:
                    assert self.path is not None
                    self.path.mkdir(parents=True, exist_ok=True)
                    self._client = chromadb.PersistentClient(path=str(self.path), settings=settings)
            return self._client

    def collection(self, tenant_id: str) -> Any:
        client = self.client()
        return self._call(
            "opening the collection",
            lambda: client.get_or_create_collection(
                name=collection_name(tenant_id),
                metadata={"tenant_id": tenant_id, "hnsw:space": "cosine", "embedding_model": self.embedder.name},
                embedding_function=None,
            ),
        )

    def reset(self, *, store: MemoryStore, tenant_id: str) -> None:
        """Drop the tenant's collection and its lineage; the next sync re-embeds everything."""
        client = self.client()
        name = collection_name(tenant_id)
        existing = self._call("listing collections", lambda: [c.name for c in client.list_collections()])
        if name in existing:
            self._call("deleting the collection", lambda: client.delete_collection(name=name))
        with store.transaction() as conn:
            conn.execute("DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s", (tenant_id, STORE))

    def existing(self, tenant_id: str) -> Any | None:
        """The tenant's collection if it exists; reads must never create one (a forgotten tenant stays gone)."""
        client = self.client()
        name = collection_name(tenant_id)
        names = self._call("listing collections", lambda: [c.name for c in client.list_collections()])
        return self._call("opening the collection", lambda: client.get_collection(name=name)) if name in names else None

    def drop(self, tenant_id: str) -> bool:
        """Delete the tenant's collection (its files go with it); True when one existed."""
        client = self.client()
        name = collection_name(tenant_id)
        existing = self._call("listing collections", lambda: [c.name for c in client.list_collections()])
        if name not in existing:
            return False
        self._call("deleting the collection", lambda: client.delete_collection(name=name))
        return True

    def rebuild(self, tenant_id: str) -> int:
        """Copy the remaining vectors into a fresh collection: deleted vectors leave the HNSW files."""
        client = self.client()
        col = self.collection(tenant_id)
        kept = self._call("reading vectors", lambda: col.get(include=["embeddings", "metadatas"]))
        metadata = dict(col.metadata or {})
        self.drop(tenant_id)
        fresh = self._call(
            "recreating the collection",
            lambda: client.get_or_create_collection(
                name=collection_name(tenant_id), metadata=metadata, embedding_function=None
            ),
        )
        ids = list(kept["ids"])
        for start in range(0, len(ids), 1000):
            end = start + 1000
            self._call(
                "restoring vectors",
                lambda start=start, end=end: fresh.add(  # type: ignore[misc]
                    ids=ids[start:end],
                    embeddings=kept["embeddings"][start:end],
                    metadatas=kept["metadatas"][start:end],
                ),
            )
        return len(ids)

    def ids(self, tenant_id: str) -> set[str]:
        col = self.collection(tenant_id)
        return set(self._call("listing ids", lambda: col.get(include=[])["ids"]))

    def sync(self, *, store: MemoryStore, tenant_id: str) -> dict[str, int]:
        """Embed current versions that are missing, remove vectors of versions no longer current."""
        current = {cv.record_id: cv for cv in store.current_versions(tenant_id=tenant_id)}
        col = self.collection(tenant_id)
        if (col.metadata or {}).get("embedding_model") != self.embedder.name:
            # Vectors of two models are not comparable: a model change re-embeds the tenant.
            self.reset(store=store, tenant_id=tenant_id)
            col = self.collection(tenant_id)
        existing = self.ids(tenant_id)
        stale = sorted(existing - set(current))
        new = [cv for record_id, cv in current.items() if record_id not in existing]
        # Sequential on purpose: overlapping upserts with embedding made both slower on 2 cores
        # (ONNX already uses every core); measured with benchmarks/ingest.py.
        for start in range(0, len(new), EMBED_CHUNK):
            chunk = new[start : start + EMBED_CHUNK]
            texts = store.open_texts(tenant_id=tenant_id, sources=[cv.source for cv in chunk])
            vectors = self.embedder.embed([texts[cv.source] for cv in chunk])
            del texts
            self._write_chunk(store, tenant_id, col, chunk, vectors)
        if stale:
            self._call("deleting vectors", lambda: col.delete(ids=stale))
            with store.transaction() as conn:
                lineage.remove_records(conn, tenant_id=tenant_id, store=STORE, record_ids=stale)
        return {"records": len(current), "embedded": len(new), "removed": len(stale)}

    def _write_chunk(
        self, store: MemoryStore, tenant_id: str, col: Any, chunk: list[CurrentVersion], vectors: Any
    ) -> None:
        # Lineage first: a vector is never in Chroma without its edge (a crash leaves an edge
        # without a vector, which the next sync fills).
        with store.transaction() as conn:
            lineage.insert_edges(
                conn, tenant_id=tenant_id, store=STORE, records=[(cv.record_id, cv.source) for cv in chunk]
            )
        self._call(
            "upserting vectors",
            lambda: col.upsert(
                ids=[cv.record_id for cv in chunk], embeddings=vectors, metadatas=[metadata_of(cv) for cv in chunk]
            ),
        )

    def query(
        self, *, tenant_id: str, text: str, limit: int, where: dict[str, Any] | None
    ) -> list[tuple[tuple[str, int], float]]:
        """(memory_id, version) and cosine similarity of the nearest vectors, best first."""
        col = self.existing(tenant_id)
        if col is None:
            return []
        count = self._call("counting", col.count)
        if count == 0:
            return []
        vector = self.embedder.embed([text])
        result = self._call(
            "querying",
            lambda: col.query(
                query_embeddings=vector, n_results=min(limit, count), where=where, include=["metadatas", "distances"]
            ),
        )
        out = []
        for meta, distance in zip(result["metadatas"][0], result["distances"][0], strict=True):
            out.append(((str(meta["memory_id"]), int(meta["version"])), 1.0 - float(distance)))
        return out

    def query_many(self, *, tenant_id: str, texts: list[str], limit: int) -> list[list[tuple[str, int]]]:
        """Nearest (memory_id, version) for many texts: one embedding batch, one Chroma call."""
        col = self.existing(tenant_id)
        if col is None or not texts:
            return [[] for _ in texts]
        count = self._call("counting", col.count)
        if count == 0:
            return [[] for _ in texts]
        vectors = self.embedder.embed(texts)
        result = self._call(
            "querying", lambda: col.query(query_embeddings=vectors, n_results=min(limit, count), include=["metadatas"])
        )
        return [[(str(m["memory_id"]), int(m["version"])) for m in metas] for metas in result["metadatas"]]

    def check(self, *, store: MemoryStore, tenant_id: str) -> dict[str, int]:
        """Counts that must be zero: documents stored, vectors without lineage, vectors not current."""
        col = self.collection(tenant_id)
        got = self._call("reading", lambda: col.get(include=["documents"]))
        ids = set(got["ids"])
        documents = sum(1 for doc in (got.get("documents") or []) if doc)
        current = {cv.record_id for cv in store.current_versions(tenant_id=tenant_id)}
        with store.transaction() as conn:
            edges = lineage.records_of_store(conn, tenant_id=tenant_id, store=STORE)
        return {
            "records": len(ids),
            "documents": documents,
            "without_lineage": len(ids - set(edges)),
            "not_current": len(ids - current),
        }
