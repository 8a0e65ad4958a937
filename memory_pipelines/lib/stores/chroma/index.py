"""Vector index in Chroma: one collection per tenant, embeddings + ids + scope metadata, never documents.

Record id `memory_id:version`. Only current versions are indexed; a superseded version's vector is
removed when its successor is indexed. Works with a Chroma server (`chroma run`) through
HttpClient: by default the one `ensure_services` runs on HOME/chroma, whose files we also know
(`path`) so an erasure can remove their bytes. The embedded PersistentClient (path only) is not
process-safe and stays a library option for unit tests.

`VectorStore` is assembled from one module per concern:
- locks.py: the tenant's collection name and its cross-process lock;
- client.py: the Chroma client, opening collections, reloading after another process's erasure;
- sync.py: embedding current versions with lineage, removing stale ones, the check, the reset;
- search.py: nearest-vector queries;
- erasure.py: deletes, physical erasure (rebuild, unused HNSW capacity, orphan segments, SQLite
  vacuum) and the files a byte scan reads.
"""

from __future__ import annotations

from pathlib import Path

from memory_pipelines.lib.stores.chroma.client import ERASURES, STORE, read_pages
from memory_pipelines.lib.stores.chroma.erasure import remove_orphan_segments, vacuum_sqlite
from memory_pipelines.lib.stores.chroma.hnsw_files import clear_unused_capacity, unused_capacity_holds_data
from memory_pipelines.lib.stores.chroma.locks import collection_name
from memory_pipelines.lib.stores.chroma.search import VectorSearch
from memory_pipelines.lib.stores.chroma.sync import EMBED_CHUNK, VectorSync, metadata_of

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


class VectorStore(VectorSync, VectorSearch):
    """Tenant collections in Chroma, synced from the memory store with lineage.

    `url` alone: a Chroma server whose files are not ours. `url` and `path`: a server keeping its
    files in `path` (ours, under HOME), so erasures also clear them. `path` alone: the embedded
    PersistentClient (one process only; unit tests)."""

    @staticmethod
    def _clear_unused_capacity(segment: Path) -> int:
        """Zero what no element owns in a segment's index files; bytes zeroed (see clear_unused_capacity).

        Looked up in this module, so replacing `index.clear_unused_capacity` (as
        benchmarks/erasure_loop.py --without-fix does) still reaches every scrub and erasure."""
        return clear_unused_capacity(segment)
