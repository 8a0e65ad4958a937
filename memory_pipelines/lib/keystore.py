"""Key store in its own PostgreSQL schema (`keystore`): wrapped tenant and subject keys only."""

from __future__ import annotations

import threading
from collections import OrderedDict

import psycopg

from memory_pipelines.lib import crypto
from memory_pipelines.lib.errors import NotFoundError, ServiceError


class KeyDestroyedError(NotFoundError):
    """The key was crypto-shredded; whatever it protected is gone for good."""


_DATA_KEY_SQL = {
    "subject": (
        "SELECT key_id, wrapped FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = %s",
        "INSERT INTO keystore.subject_keys (tenant_id, user_id, key_id, wrapped, tenant_key_id)"
        " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (tenant_id, user_id) DO NOTHING RETURNING key_id",
        "sk_",
    ),
    "team": (
        "SELECT key_id, wrapped FROM keystore.team_keys WHERE tenant_id = %s AND team_id = %s",
        "INSERT INTO keystore.team_keys (tenant_id, team_id, key_id, wrapped, tenant_key_id)"
        " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (tenant_id, team_id) DO NOTHING RETURNING key_id",
        "tm_",
    ),
}
_OWNER_FIELD = {"subject": "user", "team": "team"}
_DESTROY_TENANT_SQL = {
    "subject_keys": "DELETE FROM keystore.subject_keys WHERE tenant_id = %s RETURNING key_id",
    "team_keys": "DELETE FROM keystore.team_keys WHERE tenant_id = %s RETURNING key_id",
    "tenant_keys": "DELETE FROM keystore.tenant_keys WHERE tenant_id = %s RETURNING key_id",
}
# Tenant ids start with a letter or digit, so this can never collide with one.
CONTROL_TENANT = "__control_plane__"


class KeyStore:
    """Gets or creates tenant and subject data keys; unwrapped keys are cached by key id only."""

    def __init__(self, master: crypto.MasterKey, *, cache_size: int = 50_000) -> None:
        self.master = master
        # Bounded: a tenant with millions of subjects must not pin all their keys in memory.
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def _cached(self, key_id: str) -> bytes | None:
        with self._lock:
            key = self._cache.get(key_id)
            if key is not None:
                self._cache.move_to_end(key_id)
            return key

    def _remember(self, key_id: str, key: bytes) -> bytes:
        with self._lock:
            self._cache[key_id] = key
            self._cache.move_to_end(key_id)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return key

    def forget_cached(self) -> None:
        with self._lock:
            self._cache.clear()

    def tenant_key(self, conn: psycopg.Connection, tenant_id: str, *, create: bool = True) -> tuple[str, bytes]:
        row = conn.execute(
            "SELECT key_id, wrapped, provider FROM keystore.tenant_keys WHERE tenant_id = %s", (tenant_id,)
        ).fetchone()
        if row is None:
            if not create:
                raise NotFoundError("tenant", f"no key for tenant {tenant_id!r}")
            key, wrapped = self.master.new_wrapped_key(tenant_id=tenant_id)
            key_id = "tk_" + crypto.secrets.token_hex(12)
            inserted = conn.execute(
                "INSERT INTO keystore.tenant_keys (tenant_id, key_id, wrapped, provider) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (tenant_id) DO NOTHING RETURNING key_id",
                (tenant_id, key_id, wrapped, self.master.provider),
            ).fetchone()
            if inserted is not None:
                return key_id, self._remember(key_id, key)
            return self.tenant_key(conn, tenant_id, create=False)
        key_id, wrapped, provider = row
        if wrapped is None:
            raise KeyDestroyedError("tenant", f"the key of tenant {tenant_id!r} was destroyed")
        cached = self._cached(key_id)
        if cached is not None:
            return key_id, cached
        if provider != self.master.provider:
            raise ServiceError(
                "master_key",
                f"tenant {tenant_id!r} keys are wrapped by {provider}, but the configured master key is "
                f"{self.master.provider}; set MEMORY_PIPELINES_KMS_KEY_ID (or unset it) to match",
            )
        return key_id, self._remember(key_id, self.master.unwrap(bytes(wrapped), tenant_id=tenant_id))

    def subject_key(
        self, conn: psycopg.Connection, tenant_id: str, user_id: str, *, create: bool = True
    ) -> tuple[str, bytes]:
        """The data key of one subject (user); every memory text they author is sealed under it."""
        return self._data_key(conn, "subject", tenant_id, user_id, create=create)

    def team_key(
        self, conn: psycopg.Connection, tenant_id: str, team_id: str, *, create: bool = True
    ) -> tuple[str, bytes]:
        """The data key of one team; team summaries are sealed under it and rebuilt when an author is forgotten."""
        return self._data_key(conn, "team", tenant_id, team_id, create=create)

    def control_key(self, conn: psycopg.Connection) -> bytes:
        """The control-plane key (scope HMACs). Never shredded: proofs must stay checkable."""
        row = conn.execute("SELECT wrapped, provider FROM keystore.control_key WHERE id = 1").fetchone()
        if row is None:
            key, wrapped = self.master.new_wrapped_key(tenant_id=CONTROL_TENANT)
            inserted = conn.execute(
                "INSERT INTO keystore.control_key (id, wrapped, provider) VALUES (1, %s, %s)"
                " ON CONFLICT (id) DO NOTHING RETURNING id",
                (wrapped, self.master.provider),
            ).fetchone()
            return key if inserted is not None else self.control_key(conn)
        cached = self._cached("control")
        if cached is not None:
            return cached
        if row[1] != self.master.provider:
            raise ServiceError(
                "master_key",
                f"the control-plane key is wrapped by {row[1]}, but the configured master key is "
                f"{self.master.provider}; every process sharing this database needs the same master key",
            )
        return self._remember("control", self.master.unwrap(bytes(row[0]), tenant_id=CONTROL_TENANT))

    def destroy_subject_key(self, conn: psycopg.Connection, tenant_id: str, user_id: str) -> str | None:
        """Delete the subject's wrapped key (crypto-shredding); returns the destroyed key id."""
        row = conn.execute(
            "DELETE FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = %s RETURNING key_id",
            (tenant_id, user_id),
        ).fetchone()
        self.forget_cached()
        return None if row is None else str(row[0])

    def destroy_tenant_keys(self, conn: psycopg.Connection, tenant_id: str) -> list[str]:
        """Delete the tenant key and every subject and team key under it; returns destroyed key ids."""
        destroyed = [
            str(r[0])
            for table in ("subject_keys", "team_keys", "tenant_keys")
            for r in conn.execute(_DESTROY_TENANT_SQL[table], (tenant_id,)).fetchall()
        ]
        self.forget_cached()
        return destroyed

    def tenant_subkey(self, conn: psycopg.Connection, tenant_id: str, purpose: str, *, create: bool = True) -> bytes:
        """A key derived from the tenant key for one purpose (blind index, pseudonyms, cache keys)."""
        _, tenant_key = self.tenant_key(conn, tenant_id, create=create)
        return crypto.derive_key(tenant_key, b"tenant-subkey:" + purpose.encode())

    def _data_key(
        self, conn: psycopg.Connection, kind: str, tenant_id: str, owner_id: str, *, create: bool
    ) -> tuple[str, bytes]:
        select, insert, prefix = _DATA_KEY_SQL[kind]
        row = conn.execute(select, (tenant_id, owner_id)).fetchone()
        if row is None:
            if not create:
                raise NotFoundError(_OWNER_FIELD[kind], f"no key for {kind} {owner_id!r}")
            tenant_key_id, tenant_key = self.tenant_key(conn, tenant_id)
            key_id = prefix + crypto.secrets.token_hex(12)
            key = crypto.new_key()
            wrapped = crypto.seal(tenant_key, key, crypto.aad(f"{kind}-key", tenant_id, owner_id, key_id))
            inserted = conn.execute(insert, (tenant_id, owner_id, key_id, wrapped, tenant_key_id)).fetchone()
            if inserted is not None:
                return key_id, self._remember(key_id, key)
            return self._data_key(conn, kind, tenant_id, owner_id, create=False)
        key_id, wrapped = row
        if wrapped is None:
            raise KeyDestroyedError(_OWNER_FIELD[kind], f"the key of {kind} {owner_id!r} was destroyed")
        cached = self._cached(key_id)
        if cached is not None:
            return key_id, cached
        _, tenant_key = self.tenant_key(conn, tenant_id, create=False)
        key = crypto.open_sealed(tenant_key, bytes(wrapped), crypto.aad(f"{kind}-key", tenant_id, owner_id, key_id))
        return key_id, self._remember(key_id, key)

    def key_by_id(self, conn: psycopg.Connection, tenant_id: str, key_id: str) -> bytes:
        """The subject key a stored ciphertext names, for decryption.

        The key store is asked every time (one indexed lookup in the caller's transaction): a
        key destroyed by another process must stop decrypting here at once, whatever this
        process cached. Only the unwrapping is cached.
        """
        keys = self.keys_by_id(conn, tenant_id, [key_id])
        if key_id not in keys:
            raise KeyDestroyedError("key_id", f"subject key {key_id!r} does not exist")
        return keys[key_id]

    def keys_by_id(self, conn: psycopg.Connection, tenant_id: str, key_ids: list[str]) -> dict[str, bytes]:
        """key_id -> subject key for those of `key_ids` that still exist (one query for all)."""
        rows = conn.execute(
            "SELECT key_id, user_id, wrapped FROM keystore.subject_keys WHERE tenant_id = %s AND key_id = ANY(%s)",
            (tenant_id, sorted(set(key_ids))),
        ).fetchall()
        out: dict[str, bytes] = {}
        for key_id, user_id, wrapped in rows:
            if wrapped is None:
                continue
            cached = self._cached(key_id)
            if cached is None:
                _, tenant_key = self.tenant_key(conn, tenant_id, create=False)
                aad = crypto.aad("subject-key", tenant_id, user_id, key_id)
                cached = self._remember(key_id, crypto.open_sealed(tenant_key, bytes(wrapped), aad))
            out[key_id] = cached
        return out
