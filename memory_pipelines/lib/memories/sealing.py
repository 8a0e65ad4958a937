"""Memory texts and original queries at rest: each is sealed under the key of its version alone
(lib/memories/version_keys.py; rows from before version keys: under the author's subject key) with
(tenant, memory_id, version) as associated data, so a ciphertext cannot be moved to another memory
or version, and opened with the key its row names.
"""

from __future__ import annotations

from typing import Any

import psycopg

from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.keys import KeyDestroyedError, KeyStore

__all__ = [
    "Sealing",
    "key_of",
    "query_aad",
    "seal_query",
    "text_aad",
]


def text_aad(tenant_id: str, memory_id: str, version: int) -> bytes:
    return crypto.aad("memory-text", tenant_id, memory_id, version)


def query_aad(tenant_id: str, memory_id: str, version: int) -> bytes:
    return crypto.aad("original-query", tenant_id, memory_id, version)


def key_of(row: dict[str, Any], keys: dict[str, bytes]) -> bytes:
    """The key a row names, from keys looked up (`KeyStore.keys_by_id`) in the same read."""
    if row["key_id"] not in keys:
        raise KeyDestroyedError("key_id", f"key {row['key_id']!r} does not exist")
    return keys[row["key_id"]]


def seal_query(key: bytes, tenant_id: str, memory_id: str, version: int, query: str | None) -> bytes | None:
    """A version's original query sealed under `key`; None when it has none."""
    if query is None:
        return None
    return crypto.seal(key, query.encode("utf-8"), query_aad(tenant_id, memory_id, version))


class Sealing:
    """Opens the texts and original queries of memory version rows with the keys `keys` holds."""

    def __init__(self, keys: KeyStore) -> None:
        self.keys = keys

    def open_query(self, conn: psycopg.Connection, row: dict[str, Any]) -> str | None:
        """The row's original query, decrypted; None when it has none."""
        if row["original_query_ct"] is None:
            return None
        key = self.keys.key_by_id(conn, row["tenant_id"], row["key_id"])
        aad = query_aad(row["tenant_id"], row["memory_id"], row["version"])
        return crypto.open_sealed(key, bytes(row["original_query_ct"]), aad).decode("utf-8")

    def open_text(self, conn: psycopg.Connection, row: dict[str, Any]) -> str:
        """The row's text, decrypted."""
        key = self.keys.key_by_id(conn, row["tenant_id"], row["key_id"])
        aad = text_aad(row["tenant_id"], row["memory_id"], row["version"])
        return crypto.open_sealed(key, bytes(row["text_ct"]), aad).decode("utf-8")
