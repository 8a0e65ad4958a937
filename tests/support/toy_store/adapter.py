"""The toy store's deletion adapter (see `memory_pipelines/lib/stores/adapter.py`)."""

from __future__ import annotations

from typing import Any

import psycopg

from memory_pipelines.lib.stores.adapter import Context, Erasure, drop_edges, linked
from memory_pipelines.lib.stores.derived import DerivedStores
from tests.support.toy_store.store import NAME


class ToyAdapter:
    name = NAME

    def find(self, conn: psycopg.Connection, ctx: Context) -> set[str]:
        return linked(conn, ctx.tenant_id, NAME, ctx.everything)

    def delete(self, ctx: Context) -> None:
        with ctx.store.transaction() as conn:
            conn.execute(
                "DELETE FROM derived.toy_notes WHERE tenant_id = %s AND note_id = ANY(%s)",
                (ctx.tenant_id, sorted(ctx.records | set(ctx.ids))),
            )
            drop_edges(conn, ctx.tenant_id, NAME, ctx.records)

    def count(self, ctx: Context) -> int:
        with ctx.store.transaction() as conn:
            row = conn.execute(
                "SELECT count(*) FROM derived.toy_notes WHERE tenant_id = %s AND note_id = ANY(%s)",
                (ctx.tenant_id, ctx.ids),
            ).fetchone()
        return int(row[0]) if row else 0

    def verify(self, ctx: Context, probes: Any) -> int:
        return 0  # ids only: nothing to ask by meaning

    def fingerprints(self, conn: psycopg.Connection, ctx: Context) -> list[bytes]:
        return []  # ids only: no stored bytes of the memory's text

    def erase(self, derived: DerivedStores, tenant_id: str) -> Erasure:
        return Erasure(scanned=False, detail={"toy": True})
