"""Deletion adapter of prompt snapshots: a snapshot holding any target goes whole (one sealed prompt)."""

from __future__ import annotations

from typing import Any

import psycopg

from memory_pipelines.lib.stores import bytescan
from memory_pipelines.lib.stores.adapter import Context, Erasure, compact, drop_edges, run_count
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "STORE",
    "TABLES",
    "PromptSnapshotsAdapter",
]

STORE = "prompt_snapshots"
TABLES = ("derived.prompt_snapshots",)


class PromptSnapshotsAdapter:
    name = STORE

    def find(self, conn: psycopg.Connection, ctx: Context) -> set[str]:
        return ctx.linked(conn, STORE)

    def delete(self, ctx: Context) -> None:
        with ctx.store.transaction() as conn:
            if ctx.tenant_scope:
                conn.execute("DELETE FROM derived.prompt_snapshots WHERE tenant_id = %s", (ctx.tenant_id,))
                conn.execute("DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s", (ctx.tenant_id, STORE))
                return
            conn.execute(
                "DELETE FROM derived.prompt_snapshots WHERE tenant_id = %s AND snapshot_id = ANY(%s)",
                (ctx.tenant_id, sorted(ctx.records)),
            )
            drop_edges(conn, ctx.tenant_id, STORE, ctx.records)

    def count_sql(self, ctx: Context) -> tuple[str, tuple[Any, ...]]:
        return (
            "SELECT count(*) FROM derived.prompt_snapshots WHERE tenant_id = %s AND snapshot_id = ANY(%s)",
            (ctx.tenant_id, sorted(ctx.records)),
        )

    def count(self, ctx: Context) -> int:
        return run_count(ctx, self.count_sql(ctx))

    def verify(self, ctx: Context, probes: Any) -> int:
        return 0

    def fingerprints(self, conn: psycopg.Connection, ctx: Context) -> list[bytes]:
        rows = conn.execute(
            "SELECT prompt_ct FROM derived.prompt_snapshots WHERE tenant_id = %s AND (%s OR snapshot_id = ANY(%s))",
            (ctx.tenant_id, ctx.tenant_scope, sorted(ctx.records)),
        ).fetchall()
        return [w for (ct,) in rows for w in bytescan.windows(ct)]

    def erase(self, derived: DerivedStores, tenant_id: str) -> Erasure:
        return compact(derived, tenant_id, TABLES)
