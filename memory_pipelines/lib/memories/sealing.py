"""Memory texts and original queries at rest: each is sealed under its author's subject key with
(tenant, memory_id, version) as associated data, so a ciphertext cannot be moved to another memory
or version, and opened with the key its row names.
"""

from __future__ import annotations

from typing import Any

import psycopg

from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.connections import ConnectionsMixin
from memory_pipelines.lib.memories.keys import KeyDestroyedError, KeyStore

__all__ = [
    "SealingMixin",
]


def _text_aad(tenant_id: str, memory_id: str, version: int) -> bytes:
    return crypto.aad("memory-text", tenant_id, memory_id, version)


def _query_aad(tenant_id: str, memory_id: str, version: int) -> bytes:
    return crypto.aad("original-query", tenant_id, memory_id, version)


def _key_of(row: dict[str, Any], keys: dict[str, bytes]) -> bytes:
    """The subject key a row names, from keys looked up (`KeyStore.keys_by_id`) in the same read."""
    if row["key_id"] not in keys:
        raise KeyDestroyedError("key_id", f"subject key {row['key_id']!r} does not exist")
    return keys[row["key_id"]]


class SealingMixin(ConnectionsMixin):
    """Seal and open the texts and original queries of memory versions."""

    keys: KeyStore

    @staticmethod
    def _seal_query(key: bytes, tenant_id: str, memory_id: str, version: int, query: str | None) -> bytes | None:
        if query is None:
            return None
        return crypto.seal(key, query.encode("utf-8"), _query_aad(tenant_id, memory_id, version))

    def _open_query(self, conn: psycopg.Connection, row: dict[str, Any]) -> str | None:
        if row["original_query_ct"] is None:
            return None
        key = self.keys.key_by_id(conn, row["tenant_id"], row["key_id"])
        aad = _query_aad(row["tenant_id"], row["memory_id"], row["version"])
        return crypto.open_sealed(key, bytes(row["original_query_ct"]), aad).decode("utf-8")

    def _reseal_query(self, conn: psycopg.Connection, row: dict[str, Any], key: bytes, version: int) -> bytes | None:
        query = self._open_query(conn, {**row, "version": row.get("version", row.get("current_version"))})
        return self._seal_query(key, row["tenant_id"], row["memory_id"], version, query)

    def _open_text(self, conn: psycopg.Connection, row: dict[str, Any]) -> str:
        key = self.keys.key_by_id(conn, row["tenant_id"], row["key_id"])
        aad = _text_aad(row["tenant_id"], row["memory_id"], row["version"])
        return crypto.open_sealed(key, bytes(row["text_ct"]), aad).decode("utf-8")
