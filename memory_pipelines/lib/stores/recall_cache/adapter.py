"""Deletion adapter of the recall cache: cached answers (ids and scores only) that named a target."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from memory_pipelines.lib.stores.adapter import Context, Erasure, drop_edges, edges_left, linked
from memory_pipelines.lib.stores.derived import DerivedStores
from memory_pipelines.lib.stores.recall.recall import CACHE_STORE

__all__ = [
    "RecallCacheAdapter",
    "asked_by",
    "naming",
]


def naming(conn: psycopg.Connection, tenant_id: str, sources: set[tuple[str, int]]) -> set[str]:
    """Cache keys (hex) whose cached answer names any of `sources`: one GIN probe per source."""
    if not sources:
        return set()
    patterns = [json.dumps([[m, v]]) for m, v in sorted(sources)]
    return {
        str(r[0])
        for r in conn.execute(
            "SELECT DISTINCT encode(c.cache_key, 'hex') FROM unnest(%s::jsonb[]) AS w(pattern)"
            " CROSS JOIN LATERAL (SELECT c.cache_key FROM derived.recall_cache c"
            "  WHERE c.tenant_id = %s AND c.results @> w.pattern OFFSET 0) c",
            (patterns, tenant_id),
        )
    }


def asked_by(conn: psycopg.Connection, ctx: Context) -> set[str]:
    """Cache keys (hex) of answers to the queries of the batch's forgotten subjects (a TENANT scope:
    everyone's). Whatever they name, even nothing, they say what that subject asked."""
    subjects = sorted({str(scope["subject"]) for scope in ctx.scopes("SUBJECT")})
    if not subjects and not ctx.tenant_scope:
        return set()
    return {
        str(r[0])
        for r in conn.execute(
            "SELECT encode(cache_key, 'hex') FROM derived.recall_cache WHERE tenant_id = %s"
            " AND (%s OR user_id = ANY(%s))",
            (ctx.tenant_id, ctx.tenant_scope, subjects),
        )
    }


class RecallCacheAdapter:
    name = "recall_cache"

    def find(self, conn: psycopg.Connection, ctx: Context) -> set[str]:
        # By lineage and by content: a cached answer names its versions (ids only), and the soak once
        # found an answer naming a forgotten version after COMPLETE with no lineage edge to it. And by
        # asker: an answer to a forgotten subject's own query, whoever's memories it names.
        return (
            linked(conn, ctx.tenant_id, CACHE_STORE, ctx.everything)
            | naming(conn, ctx.tenant_id, ctx.everything)
            | asked_by(conn, ctx)
        )

    def delete(self, ctx: Context) -> None:
        with ctx.store.transaction() as conn:
            conn.execute(
                "DELETE FROM derived.recall_cache WHERE tenant_id = %s AND encode(cache_key, 'hex') = ANY(%s)",
                (ctx.tenant_id, sorted(ctx.records)),
            )
            drop_edges(conn, ctx.tenant_id, CACHE_STORE, ctx.records)

    def count(self, ctx: Context) -> int:
        with ctx.store.transaction() as conn:
            return edges_left(conn, ctx.tenant_id, CACHE_STORE, ctx.everything) + len(
                naming(conn, ctx.tenant_id, ctx.everything) | asked_by(conn, ctx)
            )

    def verify(self, ctx: Context, probes: Any) -> int:
        return 0

    def fingerprints(self, conn: psycopg.Connection, ctx: Context) -> list[bytes]:
        return []  # ids and scores only: nothing of the content to look for

    def erase(self, derived: DerivedStores, tenant_id: str) -> Erasure:
        return Erasure(detail={"note": "ids and scores only; nothing to rewrite"})
