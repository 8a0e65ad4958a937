"""Vector index in Chroma: one collection per tenant, embeddings + ids + scope metadata, never documents.

Record id `memory_id:version`. Only current versions are indexed; a superseded version's vector is
removed when its successor is indexed. Works with a Chroma server (`chroma run`) through
HttpClient: by default the one `ensure_services` runs on HOME/chroma, whose files we also know
(`path`) so an erasure can remove their bytes. The embedded PersistentClient (path only) is not
process-safe and stays a library option for unit tests.

`VectorStore` is a facade over parts, one module each, every part usable alone:
- locks.py: the tenant's collection name and its cross-process lock (`locks`);
- client.py: the Chroma client, opening collections, reloading after another process's erasure
  (`collections`, which holds the locks);
- sync.py: embedding current versions with lineage, removing stale ones, the check, the reset (`syncer`);
- search.py: nearest-vector queries (`search`);
- erasure.py: deletes, physical erasure (rebuild, unused HNSW capacity, orphan segments, SQLite
  vacuum) and the files a byte scan reads (`erasure`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.stores.chroma.client import ERASURES, STORE, ChromaCollections, read_pages
from memory_pipelines.lib.stores.chroma.erasure import VectorErasure, remove_orphan_segments, vacuum_sqlite
from memory_pipelines.lib.stores.chroma.hnsw_files import clear_unused_capacity, unused_capacity_holds_data
from memory_pipelines.lib.stores.chroma.locks import collection_name
from memory_pipelines.lib.stores.chroma.rest import ChromaRest
from memory_pipelines.lib.stores.chroma.search import VectorSearch
from memory_pipelines.lib.stores.chroma.sync import EMBED_CHUNK, VectorSync, metadata_of
from memory_pipelines.lib.stores.embedding import Embedder

__all__ = [
    "EMBED_CHUNK",
    "ERASURES",
    "STORE",
    "VectorStore",
    "clear_unused_capacity",
    "collection_name",
    "metadata_of",
    "read_pages",
    "remove_orphan_segments",
    "unused_capacity_holds_data",
    "vacuum_sqlite",
]


def _clear_unused_capacity(segment: Path) -> int:
    """Zero what no element owns in a segment's index files; bytes zeroed (see clear_unused_capacity).

    Looked up in this module, so replacing `index.clear_unused_capacity` (as
    benchmarks/erasure_loop.py --without-fix does) still reaches every scrub and erasure."""
    return clear_unused_capacity(segment)


class VectorStore:
    """Tenant collections in Chroma, synced from the memory store with lineage.

    `url` alone: a Chroma server whose files are not ours. `url` and `path`: a server keeping its
    files in `path` (ours, under HOME), so erasures also clear them. `path` alone: the embedded
    PersistentClient (one process only; unit tests). Its parts are public: `collections`, `locks`,
    `erasure`, `syncer`, `search`; each method here is theirs."""

    def __init__(
        self,
        *,
        embedder: Embedder,
        path: Path | None = None,
        url: str | None = None,
        revive: Callable[[], object] | None = None,
    ) -> None:
        self.collections = ChromaCollections(embedder=embedder, path=path, url=url, revive=revive)
        self.locks = self.collections.locks
        self.erasure = VectorErasure(self.collections, clear=_clear_unused_capacity)
        self.syncer = VectorSync(self.collections, self.erasure)
        self.search = VectorSearch(self.collections)
        self.embedder = embedder
        self.path = path
        self.url = url
        self.revive = revive

    # The collections.

    @property
    def location(self) -> str:
        return self.collections.location

    @property
    def embedded(self) -> bool:
        return self.collections.embedded

    def client(self) -> Any:
        """The Chroma client (see ChromaCollections.client)."""
        return self.collections.client()

    def rest(self) -> ChromaRest:
        """The server's REST reader; only with a `url`."""
        return self.collections.rest()

    def collection(self, tenant_id: str) -> Any:
        """The tenant's collection, created if missing (writes only: reads use `existing`)."""
        return self.collections.collection(tenant_id)

    def existing(self, tenant_id: str) -> Any | None:
        """The tenant's collection if it exists; reads never create one."""
        return self.collections.existing(tenant_id)

    def ids(self, tenant_id: str) -> set[str]:
        """The record ids (`memory_id:version`) in the tenant's collection."""
        return self.collections.ids(tenant_id)

    # Sync.

    def reset(self, *, store: MemoryStore, tenant_id: str) -> None:
        """Drop the tenant's collection and its lineage (see VectorSync.reset)."""
        self.syncer.reset(store=store, tenant_id=tenant_id)

    def sync(self, *, store: MemoryStore, tenant_id: str, progress: Progress = no_progress) -> dict[str, int]:
        """Embed missing current versions, remove stale vectors (see VectorSync.sync)."""
        return self.syncer.sync(store=store, tenant_id=tenant_id, progress=progress)

    def check(self, *, store: MemoryStore, tenant_id: str) -> dict[str, int]:
        """Counts that must be zero (see VectorSync.check)."""
        return self.syncer.check(store=store, tenant_id=tenant_id)

    # Search.

    def query(
        self, *, tenant_id: str, text: str, limit: int, where: dict[str, Any] | None
    ) -> list[tuple[tuple[str, int], float]]:
        """(memory_id, version) and cosine similarity of the nearest vectors, best first."""
        return self.search.query(tenant_id=tenant_id, text=text, limit=limit, where=where)

    def nearest(
        self, *, tenant_id: str, vector: Any, limit: int, where: dict[str, Any] | None = None
    ) -> list[tuple[tuple[str, int], float]]:
        """Like `query`, for a query vector embedded already (see VectorSearch.nearest)."""
        return self.search.nearest(tenant_id=tenant_id, vector=vector, limit=limit, where=where)

    def query_many(self, *, tenant_id: str, texts: list[str], limit: int) -> list[list[tuple[str, int]]]:
        """Nearest (memory_id, version) for many texts: one embedding batch, one Chroma call."""
        return self.search.query_many(tenant_id=tenant_id, texts=texts, limit=limit)

    def query_vectors(self, *, tenant_id: str, vectors: list[Any], limit: int) -> list[list[tuple[str, int]]]:
        """Nearest (memory_id, version) for query vectors already computed."""
        return self.search.query_vectors(tenant_id=tenant_id, vectors=vectors, limit=limit)

    # Deletion and erasure.

    def scrub(self, tenant_id: str) -> int:
        """Clear the unused index capacity of the tenant's collection (see VectorErasure.scrub)."""
        return self.erasure.scrub(tenant_id)

    def drop(self, tenant_id: str) -> bool:
        """Delete the tenant's collection (its files go with it); True when one existed."""
        return self.erasure.drop(tenant_id)

    def rebuild(self, tenant_id: str) -> int:
        """Copy the remaining vectors into a fresh collection: deleted vectors leave the HNSW files."""
        return self.erasure.rebuild(tenant_id)

    def vectors_of(self, tenant_id: str, record_ids: Sequence[str]) -> dict[str, Any]:
        """Stored vectors of the given records; records without one are left out."""
        return self.erasure.vectors_of(tenant_id, record_ids)

    def stored(self, tenant_id: str, record_ids: Sequence[str]) -> dict[str, Any] | None:
        """Stored vectors of the given records; None when the tenant has no collection."""
        return self.erasure.stored(tenant_id, record_ids)

    def delete(self, tenant_id: str, record_ids: Sequence[str]) -> int:
        """Delete vectors through Chroma's API (it only flags them); returns how many were present."""
        return self.erasure.delete(tenant_id, record_ids)

    def discard(self, tenant_id: str, record_ids: Sequence[str]) -> None:
        """`delete` without reading which ids are present first, and without a count."""
        self.erasure.discard(tenant_id, record_ids)

    def erase_physically(self, tenant_id: str) -> tuple[int, list[Path]]:
        """Rewrite the tenant's collection so deleted vectors leave every file (see VectorErasure)."""
        return self.erasure.erase_physically(tenant_id)

    def live_windows(self, tenant_id: str) -> tuple[set[bytes], int]:
        """Windows of vectors still live in the files an erasure scans, and orphan log rows."""
        return self.erasure.live_windows(tenant_id)

    def foreign_segments(self, tenant_id: str) -> list[Path]:
        """Segment directories of every other collection."""
        return self.erasure.foreign_segments(tenant_id)

    def segments(self, tenant_id: str) -> list[Path]:
        """Directories of the tenant's collection's segments."""
        return self.erasure.segments(tenant_id)

    def files(self, tenant_id: str) -> list[Path]:
        """The files holding the tenant's vectors: its collection's segment directories and SQLite."""
        return self.erasure.files(tenant_id)
