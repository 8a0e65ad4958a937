"""Deletion adapter of the analytics copy (no text; rows keyed by memory_id and version, in PostgreSQL)."""

from __future__ import annotations

from typing import Any

import psycopg

from memory_pipelines.lib.stores.adapter import Context, Erasure, compact
from memory_pipelines.lib.stores.analytics.rows import TABLE
from memory_pipelines.lib.stores.analytics.store import STORE
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "AnalyticsAdapter",
]

TABLES = (TABLE,)


class AnalyticsAdapter:
    name = STORE

    def find(self, conn: psycopg.Connection, ctx: Context) -> set[str]:
        return ctx.linked(conn, STORE)

    def delete(self, ctx: Context) -> None:
        analytics = ctx.derived.analytics
        if ctx.tenant_scope:
            analytics.drop(store=ctx.store, tenant_id=ctx.tenant_id)
        elif ctx.scopes("MEMORY"):
            # Deleting a current version makes an older one current: the copy must show it.
            analytics.rebuild(store=ctx.store, tenant_id=ctx.tenant_id)
        else:
            analytics.remove(store=ctx.store, tenant_id=ctx.tenant_id, sources=ctx.everything)

    def count(self, ctx: Context) -> int:
        return ctx.derived.analytics.count(tenant_id=ctx.tenant_id, record_ids=list(ctx.ids))

    def verify(self, ctx: Context, probes: Any) -> int:
        return 0

    def fingerprints(self, conn: psycopg.Connection, ctx: Context) -> list[bytes]:
        return []  # no text, no vector, no key: lengths, categories and pseudonyms

    def erase(self, derived: DerivedStores, tenant_id: str) -> Erasure:
        # The tenant's partition rewritten (deleted rows leave its files) and listed for the byte
        # scan; an earlier version's Parquet files, if any are left, removed whole.
        old = derived.analytics.remove_old()
        erasure = compact(derived, tenant_id, TABLES)
        if old:
            erasure.detail["old_files_removed"] = len(old)
        return erasure
