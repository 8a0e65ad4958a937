"""Deletion adapter of the Chroma vector index (one collection per tenant, record `memory_id:version`).

Each step opens the tenant's collection once and makes one call per page of ids: the freeze's read of
the targets' vectors (`VectorStore.stored`, shared by the paraphrase probes and the fingerprints: 2
requests where there were 4), the delete (by id, without reading first which ids are present: Chroma
ignores absent ones; 2 where there were 3), and the verification's exact-id read and probe queries on
one opening of the collection (`Context.opened`; 4 where there were 5: the probes alone are split, in
two requests asked at once, see `_probe`). The run holds the tenant's forget run lock throughout,
so no erasure replaces the collection meanwhile. Locks: the collection's (shared) is taken after any
PostgreSQL lock and never held while waiting for PostgreSQL (lineage edges are dropped after it is
released).
"""

from __future__ import annotations

import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg

from memory_pipelines.lib.stores import bytescan
from memory_pipelines.lib.stores.adapter import Context, Erasure, drop_edges
from memory_pipelines.lib.stores.chroma.client import serialized, source_of
from memory_pipelines.lib.stores.chroma.index import STORE, VectorStore, read_pages
from memory_pipelines.lib.stores.chroma.search import QUERY_BATCH
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "ChromaAdapter",
]

_OPENED = "chroma:collection"  # Context.opened keys: the collection count() or verify() opened, for the other,
_OPENING = "chroma:opening"  # and the lock of its opening
_PARALLEL_QUERIES = 2  # probe requests asked at once
_MIN_REQUEST = 16  # probes below which a request is not split
# Above this many probes (a batch run's, not one subject's) the requests go one at a time and smaller:
# each holds one of the server's threads while it searches, and two at once held both cores, so other
# tenants' recalls waited 150-450 ms behind a forget run's verification.
_PARALLEL_UP_TO = 256
_PACED_REQUEST = 128


def _collection(vectors: VectorStore, ctx: Context) -> Any | None:
    """The tenant's collection as it is now, opened once per context (its count and its probes,
    which verification asks at once from two threads)."""
    with ctx.opened.setdefault(_OPENING, threading.Lock()):
        if _OPENED not in ctx.opened:
            ctx.opened[_OPENED] = vectors.existing(ctx.tenant_id)
    return ctx.opened[_OPENED]


@serialized
def _count(vectors: VectorStore, ctx: Context) -> int:
    """Targets still in the collection, by exact id: one get per page of ids."""
    ids = ctx.ids
    with vectors.locks.tenant_lock(ctx.tenant_id, exclusive=False):
        col = _collection(vectors, ctx)
        if col is None or not ids:
            return 0
        return len(vectors.collections.call("verifying", lambda: read_pages(col, ids=ids, include=[])["ids"]))


@serialized
def _probe(vectors: VectorStore, ctx: Context, probe_vectors: list[Any]) -> int:
    """Targets among the 10 nearest vectors of each probe, on the collection as it is (no count
    first: Chroma answers a limit above it with what there is). One subject's probes (up to
    _PARALLEL_UP_TO) go in _PARALLEL_QUERIES requests asked at once when there are enough: the
    server searches each request on one core, and on this project's 2-core machine two halves of
    100 probes took 58% of the time of the whole. A batch's go one request of _PACED_REQUEST at a
    time, which leaves the server a core for everyone else."""
    with vectors.locks.tenant_lock(ctx.tenant_id, exclusive=False):
        col = _collection(vectors, ctx)
    if col is None:
        return 0
    parts = _probe_requests(probe_vectors)

    def ask(part: list[Any]) -> int:
        with vectors.locks.tenant_lock(ctx.tenant_id, exclusive=False):
            result = vectors.collections.call(
                "querying", lambda: col.query(query_embeddings=part, n_results=10, include=[])
            )
        return sum(1 for ids in result["ids"] for record_id in ids if source_of(record_id) in ctx.everything)

    # The embedded client makes one operation at a time.
    if len(probe_vectors) > _PARALLEL_UP_TO or len(parts) == 1 or vectors.url is None:
        return sum(ask(part) for part in parts)
    # This thread asks every _PARALLEL_QUERIES-th part, _PARALLEL_QUERIES - 1 others the rest.
    with ThreadPoolExecutor(max_workers=_PARALLEL_QUERIES - 1, thread_name_prefix="forget-probes") as pool:
        others = [
            pool.submit(contextvars.copy_context().run, ask, part)
            for n, part in enumerate(parts)
            if n % _PARALLEL_QUERIES
        ]
        hits = sum(ask(part) for part in parts[::_PARALLEL_QUERIES])
        return hits + sum(future.result() for future in others)


def _probe_requests(probe_vectors: list[Any]) -> list[list[Any]]:
    """`probe_vectors` cut into the requests `_probe` makes."""
    if not probe_vectors:
        return []
    if len(probe_vectors) > _PARALLEL_UP_TO:
        size = min(_PACED_REQUEST, QUERY_BATCH)
    else:
        size = -(-len(probe_vectors) // max(1, min(_PARALLEL_QUERIES, len(probe_vectors) // _MIN_REQUEST)))
    return [probe_vectors[start : start + size] for start in range(0, len(probe_vectors), size)]


class ChromaAdapter:
    name = STORE

    def find(self, conn: psycopg.Connection, ctx: Context) -> set[str]:
        return ctx.linked(conn, STORE)

    def _ids(self, ctx: Context) -> list[str]:
        return sorted(ctx.records | set(ctx.ids))

    def delete(self, ctx: Context) -> None:
        vectors = ctx.derived.vectors
        if ctx.tenant_scope:
            vectors.drop(ctx.tenant_id)
            return
        ids = self._ids(ctx)
        if ctx.versions.get(STORE) == "chroma-v1":
            # The earlier adapter: read which ids are present, then delete those (one request more).
            vectors.delete(ctx.tenant_id, ids)
        else:
            vectors.discard(ctx.tenant_id, ids)  # Chroma only flags them: see VectorStore.delete
        with ctx.store.transaction() as conn:
            drop_edges(conn, ctx.tenant_id, STORE, ids)

    def count(self, ctx: Context) -> int:
        return _count(ctx.derived.vectors, ctx)

    def verify(self, ctx: Context, probes: Any) -> int:
        return _probe(ctx.derived.vectors, ctx, probes.vectors) if probes.vectors else 0

    def fingerprints(self, conn: psycopg.Connection, ctx: Context) -> list[bytes]:
        vectors = ctx.derived.vectors
        if vectors.existing(ctx.tenant_id) is None:
            return []
        ids = sorted(ctx.records | set(ctx.ids)) if not ctx.tenant_scope else sorted(vectors.ids(ctx.tenant_id))
        stored = vectors.vectors_of(ctx.tenant_id, ids)
        return [w for vector in stored.values() for w in bytescan.vector_windows(vector)]

    def fingerprints_many(self, conn: psycopg.Connection, ctxs: list[Context]) -> list[list[bytes]]:
        """`fingerprints` of each job of a batch: vectors the run already read (its probes) are not
        read again, and the rest in one read of the collection (none when nothing is left to ask)."""
        if not ctxs:
            return []
        vectors = ctxs[0].derived.vectors
        if any(ctx.tenant_scope for ctx in ctxs):
            return [self.fingerprints(conn, ctx) for ctx in ctxs]
        wanted = [sorted(ctx.records | set(ctx.ids)) for ctx in ctxs]
        known, asked = ctxs[0].vectors, ctxs[0].vectors_asked
        needed = set().union(*wanted)
        stored = {i: known[i] for i in needed if i in known}
        unknown = needed - stored.keys() - asked
        if unknown:
            stored |= vectors.stored(ctxs[0].tenant_id, sorted(unknown)) or {}
        return [[w for i in ids if i in stored for w in bytescan.vector_windows(stored[i])] for ids in wanted]

    def erase(self, derived: DerivedStores, tenant_id: str) -> Erasure:
        written, files = derived.vectors.erase_physically(tenant_id)
        live, orphans = derived.vectors.live_windows(tenant_id)
        return Erasure(
            bytes_rewritten=written,
            files=files,
            scanned=derived.vectors.path is not None,
            live=live,
            leftovers=orphans,
            foreign=derived.vectors.foreign_segments(tenant_id),
            detail={"orphan_log_rows": orphans},
        )
