"""Deletion adapter of the blind keyword index (postings keyed by tenant, memory_id, version; MACed
under the tenant key, or an author-only version's under its author's subject key)."""

from __future__ import annotations

from typing import Any

import psycopg

from memory_pipelines.lib.stores import lineage
from memory_pipelines.lib.stores.adapter import Context, Erasure, compact, drop_edges, run_count
from memory_pipelines.lib.stores.derived import DerivedStores
from memory_pipelines.lib.stores.keyword.index import STORE

__all__ = [
    "TABLES",
    "KeywordIndexAdapter",
]

TABLES = ("derived.keyword_postings",)


class KeywordIndexAdapter:
    name = STORE

    def find(self, conn: psycopg.Connection, ctx: Context) -> set[str]:
        return ctx.linked(conn, STORE)

    def delete(self, ctx: Context) -> None:
        with ctx.store.transaction() as conn:
            conn.execute(
                "DELETE FROM derived.keyword_postings p USING unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
                " WHERE p.tenant_id = %s AND p.memory_id = w.memory_id AND p.version = w.version",
                (*lineage.pair_arrays(sorted(ctx.everything)), ctx.tenant_id),
            )
            drop_edges(conn, ctx.tenant_id, STORE, ctx.records)

    def count_sql(self, ctx: Context) -> tuple[str, tuple[Any, ...]]:
        return (
            "SELECT count(*) FROM derived.keyword_postings x JOIN unnest(%s::text[], %s::int[])"
            " AS w(memory_id, version) ON x.memory_id = w.memory_id AND x.version = w.version"
            " WHERE x.tenant_id = %s",
            (*lineage.pair_arrays(sorted(ctx.everything)), ctx.tenant_id),
        )

    def count(self, ctx: Context) -> int:
        return run_count(ctx, self.count_sql(ctx))

    def verify(self, ctx: Context, probes: Any) -> int:
        # An author-only version's postings are MACed under its author's key: probed with it while it lives.
        subjects = ctx.subjects()
        return ctx.derived.keywords.probe_hits(
            tenant_id=ctx.tenant_id, texts=probes.texts, sources=ctx.everything, subjects=subjects
        )

    def fingerprints(self, conn: psycopg.Connection, ctx: Context) -> list[bytes]:
        # A token's MAC is shared by every memory holding the token, so no window is one version's;
        # the compaction of the tenant's partition removes the dead postings all the same.
        return []

    def erase(self, derived: DerivedStores, tenant_id: str) -> Erasure:
        return compact(derived, tenant_id, TABLES)
