"""Deletion adapter of the primary store: the target versions themselves (sealed text and query)."""

from __future__ import annotations

from typing import Any

import psycopg

from memory_pipelines.lib.memories.store import repair_heads
from memory_pipelines.lib.stores import bytescan, lineage
from memory_pipelines.lib.stores.adapter import Context, Erasure, compact, run_count
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "BATCH",
    "STORE",
    "TABLES",
    "PrimaryAdapter",
]

STORE = "primary"
TABLES = ("memory.memory_versions",)
BATCH = 5_000
# What a TENANT deletion removes besides the versions (ids and memberships, no content).
_TENANT_ROWS = (
    "DELETE FROM memory.team_members WHERE tenant_id = %s",
    "DELETE FROM memory.teams WHERE tenant_id = %s",
    "DELETE FROM memory.subjects WHERE tenant_id = %s AND NOT EXISTS (SELECT 1 FROM memory.memories m"
    " WHERE m.tenant_id = memory.subjects.tenant_id AND m.user_id = memory.subjects.user_id)",
    "DELETE FROM derived.summaries WHERE tenant_id = %s",
    "DELETE FROM derived.summary_modes WHERE tenant_id = %s",
    "DELETE FROM derived.recall_cache WHERE tenant_id = %s",
    "DELETE FROM derived.prompt_snapshots WHERE tenant_id = %s",
    "DELETE FROM derived.lineage WHERE tenant_id = %s",
)
# What a SUBJECT deletion removes besides the versions: what the subject's export lists about them
# that is no memory (memberships, their summary mode; the ledger unlinks their MEMORY jobs). Their
# do-not-sell opt-out stays: nothing but the subject undoes an opt-out, and it covers whatever is
# written under that id later.
_SUBJECT_ROWS = (
    "DELETE FROM memory.team_members WHERE tenant_id = %s AND user_id = ANY(%s)",
    "DELETE FROM derived.summary_modes WHERE tenant_id = %s AND user_id = ANY(%s)",
)
_LEFTOVER = (
    "SELECT count(*) FROM memory.memory_versions x JOIN unnest(%s::text[], %s::int[])"
    " AS w(memory_id, version) ON x.memory_id = w.memory_id AND x.version = w.version WHERE x.tenant_id = %s"
)


class PrimaryAdapter:
    name = STORE

    def find(self, conn: psycopg.Connection, ctx: Context) -> set[str]:
        return set(ctx.ids)

    def delete(self, ctx: Context) -> None:
        wanted = sorted(ctx.everything)
        # Batches by key range, each in its own short transaction: a large sweep never holds one
        # huge lock, and every batch is idempotent on a retry. The memberships (and a TENANT scope's
        # other rows) go with the last one: one commit for a subject's versions.
        batches = [wanted[start : start + BATCH] for start in range(0, len(wanted), BATCH)] or [[]]
        for n, batch in enumerate(batches):
            with ctx.store.transaction() as conn:
                if batch:
                    self._delete_batch(conn, ctx.tenant_id, batch)
                if n == len(batches) - 1:
                    self._delete_rest(conn, ctx)

    @staticmethod
    def _delete_rest(conn: psycopg.Connection, ctx: Context) -> None:
        subjects = sorted({str(scope["subject"]) for scope in ctx.scopes("SUBJECT")})
        if subjects:
            for query in _SUBJECT_ROWS:
                conn.execute(query, (ctx.tenant_id, subjects))

        if ctx.tenant_scope:
            for query in _TENANT_ROWS:
                conn.execute(query, (ctx.tenant_id,))

    @staticmethod
    def _delete_batch(conn: psycopg.Connection, tenant_id: str, wanted: list[tuple[str, int]]) -> None:
        conn.execute(
            "DELETE FROM memory.memory_versions v USING unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
            " WHERE v.tenant_id = %s AND v.memory_id = w.memory_id AND v.version = w.version",
            (*lineage.pair_arrays(wanted), tenant_id),
        )
        repair_heads(conn, tenant_id=tenant_id, memory_ids=sorted({m for m, _ in wanted}))
        conn.execute(
            "DELETE FROM derived.lineage l USING unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
            " WHERE l.tenant_id = %s AND l.source_memory_id = w.memory_id AND l.source_version = w.version",
            (*lineage.pair_arrays(wanted), tenant_id),
        )

    def count_sql(self, ctx: Context) -> tuple[str, tuple[Any, ...]]:
        return _LEFTOVER, (*lineage.pair_arrays(sorted(ctx.everything)), ctx.tenant_id)

    def count(self, ctx: Context) -> int:
        return run_count(ctx, self.count_sql(ctx))

    def verify(self, ctx: Context, probes: Any) -> int:
        return 0

    def fingerprints(self, conn: psycopg.Connection, ctx: Context) -> list[bytes]:
        rows = conn.execute(
            "SELECT x.text_ct, x.original_query_ct FROM memory.memory_versions x JOIN unnest(%s::text[], %s::int[])"
            " AS w(memory_id, version) ON x.memory_id = w.memory_id AND x.version = w.version WHERE x.tenant_id = %s",
            (*lineage.pair_arrays(sorted(ctx.everything)), ctx.tenant_id),
        ).fetchall()
        return [w for text_ct, query_ct in rows for w in bytescan.windows(text_ct) + bytescan.windows(query_ct)]

    def erase(self, derived: DerivedStores, tenant_id: str) -> Erasure:
        return compact(derived, tenant_id, TABLES)
