"""Rows as releases before version keys (migration 0021) wrote them: a memory version's text and
query sealed under its author's subject key, and no version key. For tests of what such rows still
do (a restore's safety net, a MEMORY forget that destroys no key) and of their conversion."""

from __future__ import annotations

import psycopg

from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.store import MemoryStore

__all__ = ["seal_as_before_version_keys"]


def seal_as_before_version_keys(store: MemoryStore, tenant_id: str, memory_id: str) -> int:
    """Re-seal every version of `memory_id` under its author's subject key and drop their version
    keys, as the code before version keys left them; marks that key as having sealed texts.
    Returns the versions re-sealed."""
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT v.version, v.text_ct, v.original_query_ct, v.key_id, m.user_id FROM memory.memory_versions v"
            " JOIN memory.memories m ON m.tenant_id = v.tenant_id AND m.memory_id = v.memory_id"
            " WHERE v.tenant_id = %s AND v.memory_id = %s",
            (tenant_id, memory_id),
        ).fetchall()
        for version, text_ct, query_ct, key_id, user_id in rows:
            key = store.keys.key_by_id(conn, tenant_id, key_id)
            subject_key_id, subject_key = store.keys.subject_key(conn, tenant_id, user_id)
            query_aad = crypto.aad("original-query", tenant_id, memory_id, version)
            conn.execute(
                "UPDATE memory.memory_versions SET text_ct = %s, original_query_ct = %s, key_id = %s"
                " WHERE tenant_id = %s AND memory_id = %s AND version = %s",
                (
                    _reseal(key, subject_key, text_ct, crypto.aad("memory-text", tenant_id, memory_id, version)),
                    None if query_ct is None else _reseal(key, subject_key, query_ct, query_aad),
                    subject_key_id,
                    tenant_id,
                    memory_id,
                    version,
                ),
            )
            conn.execute("DELETE FROM keystore.version_keys WHERE tenant_id = %s AND key_id = %s", (tenant_id, key_id))
            _sealed_texts(conn, tenant_id, user_id)
    return len(rows)


def _reseal(old: bytes, new: bytes, blob: bytes, aad: bytes) -> bytes:
    return crypto.seal(new, crypto.open_sealed(old, bytes(blob), aad), aad)


def _sealed_texts(conn: psycopg.Connection, tenant_id: str, user_id: str) -> None:
    conn.execute(
        "UPDATE keystore.subject_keys SET seals_text = true WHERE tenant_id = %s AND user_id = %s", (tenant_id, user_id)
    )
