"""Deletion adapter of the Chroma vector index (one collection per tenant, record `memory_id:version`)."""

from __future__ import annotations

from typing import Any

import psycopg

from memory_pipelines.lib.stores import bytescan
from memory_pipelines.lib.stores.adapter import Context, Erasure, drop_edges, linked
from memory_pipelines.lib.stores.derived import DerivedStores
from memory_pipelines.lib.stores.vectors.index import STORE, read_pages

__all__ = [
    "ChromaAdapter",
]


class ChromaAdapter:
    name = STORE

    def find(self, conn: psycopg.Connection, ctx: Context) -> set[str]:
        return linked(conn, ctx.tenant_id, STORE, ctx.everything)

    def _ids(self, ctx: Context) -> list[str]:
        return sorted(ctx.records | set(ctx.ids))

    def delete(self, ctx: Context) -> None:
        vectors = ctx.derived.vectors
        if ctx.tenant_scope:
            vectors.drop(ctx.tenant_id)
            return
        ids = self._ids(ctx)
        vectors.delete(ctx.tenant_id, ids)
        with ctx.store.transaction() as conn:
            drop_edges(conn, ctx.tenant_id, STORE, ids)

    def count(self, ctx: Context) -> int:
        vectors = ctx.derived.vectors
        col = vectors.existing(ctx.tenant_id)
        ids = ctx.ids
        if col is None or not ids:
            return 0
        return len(vectors._call("verifying", lambda: read_pages(col, ids=ids, include=[])["ids"]))

    def verify(self, ctx: Context, probes: Any) -> int:
        return sum(
            1
            for hits in ctx.derived.vectors.query_vectors(tenant_id=ctx.tenant_id, vectors=probes.vectors, limit=10)
            for source in hits
            if source in ctx.everything
        )

    def fingerprints(self, conn: psycopg.Connection, ctx: Context) -> list[bytes]:
        vectors = ctx.derived.vectors
        if vectors.existing(ctx.tenant_id) is None:
            return []
        ids = sorted(ctx.records | set(ctx.ids)) if not ctx.tenant_scope else sorted(vectors.ids(ctx.tenant_id))
        stored = vectors.vectors_of(ctx.tenant_id, ids)
        return [w for vector in stored.values() for w in bytescan.vector_windows(vector)]

    def fingerprints_many(self, conn: psycopg.Connection, ctxs: list[Context]) -> list[list[bytes]]:
        """`fingerprints` of each job of a batch from one read of the collection."""
        if not ctxs:
            return []
        vectors = ctxs[0].derived.vectors
        if any(ctx.tenant_scope for ctx in ctxs) or vectors.existing(ctxs[0].tenant_id) is None:
            return [self.fingerprints(conn, ctx) for ctx in ctxs]
        wanted = [sorted(ctx.records | set(ctx.ids)) for ctx in ctxs]
        known = ctxs[0].vectors
        needed = set().union(*wanted)
        stored = {i: known[i] for i in needed if i in known}
        if needed - stored.keys():
            stored |= vectors.vectors_of(ctxs[0].tenant_id, sorted(needed - stored.keys()))
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
            detail={"orphan_log_rows": orphans},
        )
