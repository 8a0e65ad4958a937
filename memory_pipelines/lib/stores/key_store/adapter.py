"""Deletion adapter of the key store: the subject's key (SUBJECT) or every key of the tenant and its
key vault file (TENANT). The tenant's KEK rotation, which makes wrapped copies in PostgreSQL's history
useless, is the physical erasure's (lib/erasure.py), before this adapter compacts the key partitions."""

from __future__ import annotations

from typing import Any

import psycopg

from memory_pipelines.lib.stores import bytescan
from memory_pipelines.lib.stores.adapter import Context, Erasure, compact, run_count
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "STORE",
    "TABLES",
    "KeyStoreAdapter",
]

STORE = "key_store"
TABLES = ("keystore.subject_keys", "keystore.team_keys", "keystore.tenant_keys", "keystore.build_keys")
_TENANT_KEYS = (
    "SELECT key_id, wrapped FROM keystore.subject_keys WHERE tenant_id = %s"
    " UNION ALL SELECT key_id, wrapped FROM keystore.team_keys WHERE tenant_id = %s"
    " UNION ALL SELECT key_id, wrapped FROM keystore.tenant_keys WHERE tenant_id = %s"
    " UNION ALL SELECT key_id, wrapped FROM keystore.build_keys WHERE tenant_id = %s"
)

_TENANT_KEY_COUNT = (
    "SELECT (SELECT count(*) FROM keystore.subject_keys WHERE tenant_id = %s)"
    " + (SELECT count(*) FROM keystore.team_keys WHERE tenant_id = %s)"
    " + (SELECT count(*) FROM keystore.tenant_keys WHERE tenant_id = %s)"
    " + (SELECT count(*) FROM keystore.build_keys WHERE tenant_id = %s)"
)


class KeyStoreAdapter:
    name = STORE

    def _keys(self, conn: psycopg.Connection, ctx: Context) -> list[tuple[str, bytes | None]]:
        if ctx.tenant_scope:
            return [(str(k), w) for k, w in conn.execute(_TENANT_KEYS, (ctx.tenant_id,) * 4)]
        subjects = sorted(set(ctx.subjects()))
        return [
            (str(k), w)
            for k, w in conn.execute(
                "SELECT key_id, wrapped FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = ANY(%s)",
                (ctx.tenant_id, subjects),
            )
        ]

    def find(self, conn: psycopg.Connection, ctx: Context) -> set[str]:
        return {key_id for key_id, _ in self._keys(conn, ctx)}

    def delete(self, ctx: Context) -> None:
        keys = ctx.store.keys
        with ctx.store.transaction() as conn:
            for job in ctx.jobs:
                scope = job["scope"]
                destroyed: list[str] = []
                if scope["type"] == "SUBJECT":
                    assert scope["subject"] is not None  # a SUBJECT scope always names its subject
                    key_id = keys.destroy_subject_key(conn, ctx.tenant_id, scope["subject"])
                    destroyed = [] if key_id is None else [key_id]
                elif scope["type"] == "TENANT":
                    destroyed = keys.destroy_tenant_keys(conn, ctx.tenant_id)
                with conn.cursor() as cur:
                    cur.executemany(
                        "INSERT INTO control.journal (tenant_id, kind, subject_id, key_id, job_id)"
                        " VALUES (%s, 'KEY_DESTROYED', %s, %s, %s)",
                        [(ctx.tenant_id, scope["subject"], key_id, job["job_id"]) for key_id in destroyed],
                    )

    def count_sql(self, ctx: Context) -> tuple[str, tuple[Any, ...]]:
        if ctx.tenant_scope:
            return _TENANT_KEY_COUNT, (ctx.tenant_id,) * 4
        return (
            "SELECT count(*) FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = ANY(%s)",
            (ctx.tenant_id, sorted(set(ctx.subjects()))),
        )

    def count(self, ctx: Context) -> int:
        return run_count(ctx, self.count_sql(ctx))

    def verify(self, ctx: Context, probes: Any) -> int:
        return 0

    def fingerprints(self, conn: psycopg.Connection, ctx: Context) -> list[bytes]:
        return [w for _, wrapped in self._keys(conn, ctx) for w in bytescan.windows(wrapped)]

    def erase(self, derived: DerivedStores, tenant_id: str) -> Erasure:
        return compact(derived, tenant_id, TABLES)
