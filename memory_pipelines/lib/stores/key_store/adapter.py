"""Deletion adapter of the key store: the key of every forgotten version (every scope), the subject's
keys (SUBJECT: subject key, group and version keys, retired key) or every key of the tenant and its key
vault file (TENANT). The tenant's physical erasure (lib/forget/erasure.py) then gives groups that lost
a member a new group key and rotates the KEK, which makes wrapped copies in PostgreSQL's history
useless, before this adapter compacts the key partitions."""

from __future__ import annotations

from typing import Any

import psycopg

from memory_pipelines.lib.memories.table_partitions import KEY_TABLES
from memory_pipelines.lib.stores import bytescan, lineage
from memory_pipelines.lib.stores.adapter import Context, Erasure, compact, run_count
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "STORE",
    "TABLES",
    "KeyStoreAdapter",
]

STORE = "key_store"
TABLES = KEY_TABLES
# Every key of the tenant, by the tables of TABLES (a build key lives and dies with its row's trigger).
# Positional parameters throughout: verification joins every store's count_sql into one statement.
_TENANT_KEYS = " UNION ALL ".join(f"SELECT key_id, wrapped FROM {t} WHERE tenant_id = %s" for t in TABLES)  # noqa: S608
_TENANT_KEY_COUNT = "SELECT " + " + ".join(f"(SELECT count(*) FROM {t} WHERE tenant_id = %s)" for t in TABLES)  # noqa: S608
# The keys of a batch that is not a TENANT scope: of its versions and of its SUBJECT scopes' subjects.
# One shape for reading them and for counting what is left; parameters from `_scoped`.
_SCOPED_KEYS = (
    "SELECT k.key_id, k.wrapped FROM keystore.version_keys k JOIN unnest(%s::text[], %s::int[])"
    " AS w(memory_id, version) ON k.memory_id = w.memory_id AND k.version = w.version WHERE k.tenant_id = %s"
    " UNION ALL SELECT key_id, wrapped FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = ANY(%s)"
    " UNION ALL SELECT key_id, wrapped FROM keystore.group_keys WHERE tenant_id = %s AND user_id = ANY(%s)"
    " UNION ALL SELECT key_id, wrapped FROM keystore.retired_keys WHERE tenant_id = %s AND user_id = ANY(%s)"
)


def _scoped(ctx: Context) -> tuple[Any, ...]:
    memory_ids, versions = lineage.pair_arrays(sorted(ctx.everything))
    subjects = sorted(set(ctx.subjects()))
    return (memory_ids, versions, ctx.tenant_id, *((ctx.tenant_id, subjects) * 3))


class KeyStoreAdapter:
    name = STORE

    def _keys(self, conn: psycopg.Connection, ctx: Context) -> list[tuple[str, bytes | None]]:
        if ctx.tenant_scope:
            return [(str(k), w) for k, w in conn.execute(_TENANT_KEYS, (ctx.tenant_id,) * len(TABLES))]
        return [(str(k), w) for k, w in conn.execute(_SCOPED_KEYS, _scoped(ctx))]

    def find(self, conn: psycopg.Connection, ctx: Context) -> set[str]:
        return {key_id for key_id, _ in self._keys(conn, ctx)}

    def delete(self, ctx: Context) -> None:
        keys = ctx.store.keys
        with ctx.store.transaction() as conn:
            # Every scope: the key of each forgotten version (its group is rekeyed by the erasure).
            keys.versions.destroy_versions(conn, ctx.tenant_id, sorted(ctx.everything))
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
            return _TENANT_KEY_COUNT, (ctx.tenant_id,) * len(TABLES)
        return f"SELECT count(*) FROM ({_SCOPED_KEYS}) k", _scoped(ctx)  # noqa: S608 - constant text

    def count(self, ctx: Context) -> int:
        return run_count(ctx, self.count_sql(ctx))

    def verify(self, ctx: Context, probes: Any) -> int:
        return 0

    def fingerprints(self, conn: psycopg.Connection, ctx: Context) -> list[bytes]:
        return [w for _, wrapped in self._keys(conn, ctx) for w in bytescan.windows(wrapped)]

    def erase(self, derived: DerivedStores, tenant_id: str) -> Erasure:
        return compact(derived, tenant_id, TABLES)
