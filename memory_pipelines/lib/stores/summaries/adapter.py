"""Deletion adapters of subject and team summaries (records `subject:<id>` / `team:<id>`)."""

from __future__ import annotations

from typing import Any

import psycopg

from memory_pipelines.lib.stores import bytescan
from memory_pipelines.lib.stores.adapter import Context, Erasure, compact, edges_left_sql, linked, run_count
from memory_pipelines.lib.stores.derived import DerivedStores
from memory_pipelines.lib.stores.summaries.store import SUBJECT_STORE, TEAM_STORE

__all__ = [
    "TABLES",
    "SubjectSummariesAdapter",
    "TeamSummariesAdapter",
]

TABLES = ("derived.summaries",)


class _SummariesAdapter:
    name: str
    scope: str

    def find(self, conn: psycopg.Connection, ctx: Context) -> set[str]:
        return ctx.linked(conn, self.name)

    def delete(self, ctx: Context) -> None:
        if ctx.tenant_scope:
            with ctx.store.transaction() as conn:
                conn.execute(
                    "DELETE FROM derived.summaries WHERE tenant_id = %s AND scope = %s", (ctx.tenant_id, self.scope)
                )
                conn.execute(
                    "DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s", (ctx.tenant_id, self.name)
                )
            return
        # Hidden sources are already out of the current versions: a sync of the summaries whose
        # lineage reaches a target rebuilds them without it, and removes those left with no source.
        touched = sorted(record.partition(":")[2] for record in ctx.records)
        if touched:
            ctx.derived.summaries.sync(tenant_id=ctx.tenant_id, scope=self.scope, scope_ids=touched)

    def count_sql(self, ctx: Context) -> tuple[str, tuple[Any, ...]]:
        return edges_left_sql(ctx.tenant_id, self.name, ctx.everything)

    def count(self, ctx: Context) -> int:
        return run_count(ctx, self.count_sql(ctx))

    def verify(self, ctx: Context, probes: Any) -> int:
        return 0

    def fingerprints(self, conn: psycopg.Connection, ctx: Context) -> list[bytes]:
        # The summaries as they are now that are still built from a target (their lineage read
        # again here): the cascade's sync rebuilds each (its sources changed), sealing anew, so these
        # windows can only be found in dead rows. One another process rebuilt without the targets
        # since the batch read the lineage holds nothing forgotten and stays live; the build that
        # replaced it deleted its key. A tenant's forget takes every summary: no lineage to read.
        still = ctx.records
        if not ctx.tenant_scope:
            still = still & linked(conn, ctx.tenant_id, self.name, ctx.everything)  # a new set: records stay
        rows = conn.execute(
            "SELECT summary_ct FROM derived.summaries WHERE tenant_id = %s AND scope = %s"
            " AND (%s OR scope_id = ANY(%s))",
            (ctx.tenant_id, self.scope, ctx.tenant_scope, sorted(record.partition(":")[2] for record in still)),
        ).fetchall()
        return [w for (ct,) in rows for w in bytescan.windows(ct)]

    def erase(self, derived: DerivedStores, tenant_id: str) -> Erasure:
        return compact(derived, tenant_id, TABLES)


class SubjectSummariesAdapter(_SummariesAdapter):
    name = SUBJECT_STORE
    scope = "subject"


class TeamSummariesAdapter(_SummariesAdapter):
    name = TEAM_STORE
    scope = "team"
