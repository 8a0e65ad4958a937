"""Key store: wrapped keys in their own PostgreSQL schema (`keystore`), their wrapping key outside it.

The master key (a file or KMS) seals each tenant's key-encryption key (KEK), which lives in the key
vault (files under HOME/keys/vault, lib/memories/key_vault.py), never in PostgreSQL. The KEK wraps
every key of the tenant the `keystore` rows hold: the tenant key (blind-index, pseudonym and cache
subkeys derive from it, so its value never changes), subject keys (text MACs and the blind index of
the memories only their author sees), group keys (each wraps the version keys that seal up to
GROUP_SIZE memory versions of one author: lib/memories/version_keys.py), team keys (team summaries
built before per-build keys), build keys (one per summary build or prompt snapshot, destroyed with
the row they seal) and retired keys (subject keys that sealed texts before version keys, kept until
the backups holding such texts expire). The physical erasure rotates the KEK
(lib/memories/key_rotation.py): whatever copies of wrapped keys PostgreSQL's WAL, dead tuples or
replicas keep are wrapped by a KEK that no longer exists anywhere.

Rows written before key vaults carry no `kek_id`: such a tenant key is wrapped by the master key,
such subject, team and build keys by the tenant key. They still open; the tenant's first rotation
rewraps them all under a KEK.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import psycopg

from memory_pipelines.lib.infra.errors import NotFoundError, ServiceError
from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.key_vault import KeyVault, retrying
from memory_pipelines.lib.memories.version_keys import VERSION_KEY_PREFIX, NewVersionKey, VersionKeys, rotation_lock

__all__ = [
    "BUILD_KEY_PREFIX",
    "CONTROL_TENANT",
    "KeyDestroyedError",
    "KeyStore",
    "WriteKeys",
    "key_aad",
    "lock_shared",
]


class KeyDestroyedError(NotFoundError):
    """The key was crypto-shredded; whatever it protected is gone for good."""


_TENANT_ROW = "SELECT key_id, wrapped, provider, kek_id FROM keystore.tenant_keys WHERE tenant_id = %s"
_DATA_KEY_SQL = {
    "subject": (
        "SELECT key_id, wrapped, kek_id FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = %s",
        "INSERT INTO keystore.subject_keys (tenant_id, user_id, key_id, wrapped, tenant_key_id, kek_id)"
        " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (tenant_id, user_id) DO NOTHING RETURNING key_id",
        "sk_",
    ),
    "team": (
        "SELECT key_id, wrapped, kek_id FROM keystore.team_keys WHERE tenant_id = %s AND team_id = %s",
        "INSERT INTO keystore.team_keys (tenant_id, team_id, key_id, wrapped, tenant_key_id, kek_id)"
        " VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (tenant_id, team_id) DO NOTHING RETURNING key_id",
        "tm_",
    ),
}
_OWNER_FIELD = {"subject": "user", "team": "team"}
_DESTROY_TENANT_SQL = (
    "DELETE FROM keystore.subject_keys WHERE tenant_id = %s RETURNING key_id",
    "DELETE FROM keystore.team_keys WHERE tenant_id = %s RETURNING key_id",
    "DELETE FROM keystore.tenant_keys WHERE tenant_id = %s RETURNING key_id",
)
# Tenant ids start with a letter or digit, so this can never collide with one.
CONTROL_TENANT = "__control_plane__"
BUILD_KEY_PREFIX = "bk_"
_UNREAD = object()


class WriteKeys(NamedTuple):
    """What one author's write seals and MACs with (`KeyStore.for_writes`)."""

    subject_key_id: str
    subject_key: bytes
    version_keys: list[NewVersionKey]


def key_aad(kind: str, tenant_id: str, owner: str | None, key_id: str) -> bytes:
    """Associated data of a wrapped key: its place in the hierarchy (kind, tenant, owner, id)."""
    if kind == "build":
        return crypto.aad("build-key", tenant_id, key_id)
    return crypto.aad(f"{kind}-key", tenant_id, owner or "", key_id)


def lock_shared(conn: psycopg.Connection, tenant_id: str) -> None:
    # Held until commit: a rotation (exclusive) waits for this new row, then rewraps it too.
    conn.execute("SELECT pg_advisory_xact_lock_shared(hashtextextended(%s, 2))", (rotation_lock(tenant_id),))


class KeyStore:
    """Gets or creates tenant, subject, team and build keys; unwrapped keys are cached by key id only.

    `vault` is the key vault (a directory, or a KeyVault); by default `vault/` beside a local master
    key file. Every process sharing one database must share one vault, as it shares the master key.
    """

    def __init__(
        self, master: crypto.MasterKey, *, vault: KeyVault | Path | None = None, cache_size: int = 50_000
    ) -> None:
        self.master = master
        if vault is None:
            path = getattr(master, "path", None)
            if path is None:
                raise ServiceError("key_vault", "a key store with this master key needs its vault directory")
            vault = Path(path).parent / "vault"
        self.vault = vault if isinstance(vault, KeyVault) else KeyVault(vault, master)
        # Bounded: a tenant with millions of subjects must not pin all their keys in memory.
        self._cache: OrderedDict[str, bytes] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.versions = VersionKeys(self)

    def cached(self, key_id: str) -> bytes | None:
        with self._lock:
            key = self._cache.get(key_id)
            if key is not None:
                self._cache.move_to_end(key_id)
            return key

    def remember(self, key_id: str, key: bytes) -> bytes:
        with self._lock:
            self._cache[key_id] = key
            self._cache.move_to_end(key_id)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return key

    def forget_cached(self) -> None:
        with self._lock:
            self._cache.clear()

    # -- wrapping keys -----------------------------------------------------------------------------

    def kek(self, tenant_id: str, kek_id: str) -> bytes:
        """A KEK by id: cached, or unsealed from the vault (KekUnavailable once rotated away)."""
        cached = self.cached("kek:" + kek_id)
        if cached is not None:
            return cached
        return self.remember("kek:" + kek_id, self.vault.unseal(tenant_id, kek_id))

    @contextlib.contextmanager
    def wrapping(self, conn: psycopg.Connection, tenant_id: str) -> Iterator[tuple[str | None, bytes]]:
        """(KEK id, KEK) to wrap a new key of the tenant with, under the shared rotation lock, in a
        transaction that lasts until the block ends (the caller inserts the new row inside it)."""
        with self._wrapping(conn):
            lock_shared(conn, tenant_id)
            yield self._current_wrapping(conn, tenant_id)

    @contextlib.contextmanager
    def _wrapping(self, conn: psycopg.Connection) -> Iterator[None]:
        """A transaction to wrap a new key in: the caller's, or one of its own on an idle autocommit
        connection (the rotation lock must be held until the new row commits)."""
        idle = conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with conn.transaction() if idle else contextlib.nullcontext():
            yield

    def _current_wrapping(self, conn: psycopg.Connection, tenant_id: str) -> tuple[str | None, bytes]:
        """The key new keys of the tenant are wrapped with, under the shared rotation lock: its KEK,
        or (a tenant not yet rotated since key vaults) its tenant key; from one read of the tenant's row
        (NotFoundError without one, KeyDestroyedError when its key was destroyed)."""

        def open_row(row: Any) -> tuple[str | None, bytes]:
            _, tenant_key = self._open_tenant_row(tenant_id, row)
            kek_id = row[3]
            return (None, tenant_key) if kek_id is None else (str(kek_id), self.kek(tenant_id, str(kek_id)))

        row = conn.execute(_TENANT_ROW, (tenant_id,)).fetchone()
        if row is None:
            raise NotFoundError("tenant", f"no key for tenant {tenant_id!r}")
        rows = iter([row])
        return retrying(lambda: next(rows, None) or conn.execute(_TENANT_ROW, (tenant_id,)).fetchone(), open_row)

    def open_wrapped(
        self, conn: psycopg.Connection, tenant_id: str, kek_id: str | None, wrapped: Any, aad: bytes
    ) -> bytes:
        """A key wrapped by the tenant's KEK `kek_id` (None: by the tenant key, rows from before key vaults)."""
        wrapping = self.tenant_key(conn, tenant_id, create=False)[1] if kek_id is None else self.kek(tenant_id, kek_id)
        return crypto.open_sealed(wrapping, bytes(wrapped), aad)

    # -- tenant keys -------------------------------------------------------------------------------

    def tenant_key(self, conn: psycopg.Connection, tenant_id: str, *, create: bool = True) -> tuple[str, bytes]:
        """The tenant key (id, key); with `create`, made with the tenant's first KEK on first use."""
        row = conn.execute(_TENANT_ROW, (tenant_id,)).fetchone()
        if row is None:
            if not create:
                raise NotFoundError("tenant", f"no key for tenant {tenant_id!r}")
            return self._create_tenant_key(conn, tenant_id)
        rows = iter([row])
        return retrying(
            lambda: next(rows, None) or conn.execute(_TENANT_ROW, (tenant_id,)).fetchone(),
            lambda found: self._open_tenant_row(tenant_id, found),
        )

    def _open_tenant_row(self, tenant_id: str, row: Any) -> tuple[str, bytes]:
        if row is None:
            raise KeyDestroyedError("tenant", f"the key of tenant {tenant_id!r} was destroyed")
        key_id, wrapped, provider, kek_id = row
        if wrapped is None:
            raise KeyDestroyedError("tenant", f"the key of tenant {tenant_id!r} was destroyed")
        cached = self.cached(key_id)
        if cached is not None:
            return key_id, cached
        if provider != self.master.provider:
            raise ServiceError(
                "master_key",
                f"tenant {tenant_id!r} keys are wrapped by {provider}, but the configured master key is "
                f"{self.master.provider}; set MEMORY_PIPELINES_KMS_KEY_ID (or unset it) to match",
            )
        if kek_id is None:  # made before key vaults: wrapped by the master key itself
            key = self.master.unwrap(bytes(wrapped), tenant_id=tenant_id)
        else:
            key = crypto.open_sealed(
                self.kek(tenant_id, kek_id), bytes(wrapped), crypto.aad("tenant-key", tenant_id, key_id)
            )
        return key_id, self.remember(key_id, key)

    def _create_tenant_key(self, conn: psycopg.Connection, tenant_id: str) -> tuple[str, bytes]:
        with self._wrapping(conn):
            lock_shared(conn, tenant_id)
            kek_id, kek = self.vault.current(tenant_id, create=True)
            self.remember("kek:" + kek_id, kek)
            key = crypto.new_key()
            key_id = "tk_" + secrets.token_hex(12)
            wrapped = crypto.seal(kek, key, crypto.aad("tenant-key", tenant_id, key_id))
            inserted = conn.execute(
                "INSERT INTO keystore.tenant_keys (tenant_id, key_id, wrapped, provider, kek_id) "
                "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (tenant_id) DO NOTHING RETURNING key_id",
                (tenant_id, key_id, wrapped, self.master.provider, kek_id),
            ).fetchone()
            if inserted is not None:
                return key_id, self.remember(key_id, key)
        return self.tenant_key(conn, tenant_id, create=False)

    def tenant_subkey(self, conn: psycopg.Connection, tenant_id: str, purpose: str, *, create: bool = True) -> bytes:
        """A key derived from the tenant key for one purpose (blind index, pseudonyms, cache keys)."""
        _, tenant_key = self.tenant_key(conn, tenant_id, create=create)
        return crypto.derive_key(tenant_key, b"tenant-subkey:" + purpose.encode())

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
        cached = self.cached("control")
        if cached is not None:
            return cached
        if row[1] != self.master.provider:
            raise ServiceError(
                "master_key",
                f"the control-plane key is wrapped by {row[1]}, but the configured master key is "
                f"{self.master.provider}; every process sharing this database needs the same master key",
            )
        return self.remember("control", self.master.unwrap(bytes(row[0]), tenant_id=CONTROL_TENANT))

    # -- subject and team keys -----------------------------------------------------------------------

    def subject_key(
        self, conn: psycopg.Connection, tenant_id: str, user_id: str, *, create: bool = True
    ) -> tuple[str, bytes]:
        """The data key of one subject (user); every memory text they author is sealed under it."""
        return self._data_key(conn, "subject", tenant_id, user_id, create=create)

    def subject_subkeys(
        self, conn: psycopg.Connection, tenant_id: str, user_ids: Iterable[str], purpose: str
    ) -> dict[str, bytes]:
        """user_id -> a key derived from that subject's key for one purpose (the blind index of their
        author-only memories), for those of `user_ids` whose key lives: it goes with the subject key,
        and whatever it MACed becomes unlinkable. Never creates a key; one query for one subject, two for more."""
        wanted = sorted(set(user_ids))
        if not wanted:
            return {}
        label = b"subject-subkey:" + purpose.encode()
        if len(wanted) == 1:  # a personal view's search: one lookup, not two
            try:
                _, key = self.subject_key(conn, tenant_id, wanted[0], create=False)
            except NotFoundError:  # never a key, or destroyed (KeyDestroyedError)
                return {}
            return {wanted[0]: crypto.derive_key(key, label)}
        rows = conn.execute(
            "SELECT user_id, key_id FROM keystore.subject_keys"
            " WHERE tenant_id = %s AND user_id = ANY(%s) AND wrapped IS NOT NULL",
            (tenant_id, wanted),
        ).fetchall()
        keys = self.keys_by_id(conn, tenant_id, [str(key_id) for _, key_id in rows])
        return {str(user): crypto.derive_key(keys[key_id], label) for user, key_id in rows if key_id in keys}

    def team_key(
        self, conn: psycopg.Connection, tenant_id: str, team_id: str, *, create: bool = True
    ) -> tuple[str, bytes]:
        """The data key of one team (team summaries built before per-build keys are sealed under it)."""
        return self._data_key(conn, "team", tenant_id, team_id, create=create)

    def for_writes(self, conn: psycopg.Connection, tenant_id: str, wanted: dict[str, int]) -> dict[str, WriteKeys]:
        """For each author of `wanted`: their subject key (made on first use) and that many new version
        keys, in the caller's transaction. The subject key rows and the authors' open groups are read in
        one statement (`VersionKeys.open_groups`): a write waits on every round trip."""
        opened = self.versions.open_groups(conn, tenant_id, list(wanted))
        subjects = {
            user: self._data_key(conn, "subject", tenant_id, user, create=True, row=opened[user].subject_key)
            for user in sorted(wanted)
        }
        made = self.versions.allocate(conn, tenant_id, wanted, opened)
        return {user: WriteKeys(*subjects[user], made[user]) for user in sorted(wanted)}

    def _data_key(
        self, conn: psycopg.Connection, kind: str, tenant_id: str, owner_id: str, *, create: bool, row: Any = _UNREAD
    ) -> tuple[str, bytes]:
        """`row`: the key's row (None: there is none) when the caller read it already."""
        select, insert, prefix = _DATA_KEY_SQL[kind]
        if row is _UNREAD:
            row = conn.execute(select, (tenant_id, owner_id)).fetchone()
        if row is None:
            if not create:
                raise NotFoundError(_OWNER_FIELD[kind], f"no {kind} key for {owner_id!r}")
            with self._wrapping(conn):
                lock_shared(conn, tenant_id)
                tenant_key_id, _ = self.tenant_key(conn, tenant_id)
                kek_id, wrapping = self._current_wrapping(conn, tenant_id)
                key_id = prefix + secrets.token_hex(12)
                key = crypto.new_key()
                wrapped = crypto.seal(wrapping, key, key_aad(kind, tenant_id, owner_id, key_id))
                inserted = conn.execute(
                    insert, (tenant_id, owner_id, key_id, wrapped, tenant_key_id, kek_id)
                ).fetchone()
                if inserted is not None:
                    return key_id, self.remember(key_id, key)
            return self._data_key(conn, kind, tenant_id, owner_id, create=False)
        rows = iter([row])

        def open_row(found: Any) -> tuple[str, bytes]:
            if found is None or found[1] is None:
                raise KeyDestroyedError(_OWNER_FIELD[kind], f"the key of {kind} {owner_id!r} was destroyed")
            key_id, wrapped, kek_id = found
            cached = self.cached(key_id)
            if cached is not None:
                return key_id, cached
            key = self.open_wrapped(conn, tenant_id, kek_id, wrapped, key_aad(kind, tenant_id, owner_id, key_id))
            return key_id, self.remember(key_id, key)

        return retrying(lambda: next(rows, None) or conn.execute(select, (tenant_id, owner_id)).fetchone(), open_row)

    def key_by_id(self, conn: psycopg.Connection, tenant_id: str, key_id: str) -> bytes:
        """The key a stored ciphertext names (a version key, a build key, or the subject key that sealed
        texts before version keys), for decryption.

        The key store is asked every time (one indexed lookup in the caller's transaction): a
        key destroyed by another process must stop decrypting here at once, whatever this
        process cached. Only the unwrapping is cached.
        """
        if key_id.startswith(BUILD_KEY_PREFIX):
            return self.build_key(conn, tenant_id, key_id)
        keys = self.keys_by_id(conn, tenant_id, [key_id])
        if key_id not in keys:
            raise KeyDestroyedError("key_id", f"key {key_id!r} does not exist")
        return keys[key_id]

    def keys_by_id(self, conn: psycopg.Connection, tenant_id: str, key_ids: list[str]) -> dict[str, bytes]:
        """key_id -> key, for those of `key_ids` that still exist: version keys, and subject keys (live
        or retired) that sealed texts before version keys. One query per kind asked for."""
        wanted = sorted(set(key_ids))
        out = self.versions.open(conn, tenant_id, [k for k in wanted if k.startswith(VERSION_KEY_PREFIX)])
        subjects = [k for k in wanted if not k.startswith(VERSION_KEY_PREFIX)]
        if subjects:
            out.update(self._subject_keys_by_id(conn, tenant_id, subjects))
        return out

    def _subject_keys_by_id(self, conn: psycopg.Connection, tenant_id: str, key_ids: list[str]) -> dict[str, bytes]:
        def read() -> list[Any]:
            return conn.execute(
                "SELECT key_id, user_id, wrapped, kek_id FROM keystore.subject_keys"
                " WHERE tenant_id = %(t)s AND key_id = ANY(%(k)s)"
                " UNION ALL SELECT key_id, user_id, wrapped, kek_id FROM keystore.retired_keys"
                " WHERE tenant_id = %(t)s AND key_id = ANY(%(k)s)",
                {"t": tenant_id, "k": key_ids},
            ).fetchall()

        def open_rows(rows: list[Any]) -> dict[str, bytes]:
            out: dict[str, bytes] = {}
            for key_id, user_id, wrapped, kek_id in rows:
                if wrapped is None:
                    continue
                cached = self.cached(key_id)
                if cached is None:
                    aad = key_aad("subject", tenant_id, user_id, key_id)
                    cached = self.remember(key_id, self.open_wrapped(conn, tenant_id, kek_id, wrapped, aad))
                out[key_id] = cached
            return out

        return retrying(read, open_rows)

    # -- build keys ----------------------------------------------------------------------------------

    def new_build_key(self, conn: psycopg.Connection, tenant_id: str, purpose: str) -> tuple[str, bytes]:
        """A fresh key for one build of derived text (a summary, a prompt snapshot), wrapped by the
        tenant's KEK, in the caller's transaction. The row it seals is the key's only user: replacing
        or deleting that row deletes the key in the same transaction (migration 0015's triggers).
        Never creates the tenant's key: a build for a destroyed or unknown tenant raises NotFoundError."""
        with self._wrapping(conn):
            lock_shared(conn, tenant_id)
            kek_id, wrapping = self._current_wrapping(conn, tenant_id)
            key_id = BUILD_KEY_PREFIX + secrets.token_hex(12)
            key = crypto.new_key()
            conn.execute(
                "INSERT INTO keystore.build_keys (tenant_id, key_id, purpose, wrapped, kek_id)"
                " VALUES (%s, %s, %s, %s, %s)",
                (
                    tenant_id,
                    key_id,
                    purpose,
                    crypto.seal(wrapping, key, key_aad("build", tenant_id, None, key_id)),
                    kek_id,
                ),
            )
        return key_id, self.remember(key_id, key)

    def build_key(self, conn: psycopg.Connection, tenant_id: str, key_id: str) -> bytes:
        """A build key by id, if it still exists (asked in the caller's transaction every time)."""

        def read() -> Any:
            return conn.execute(
                "SELECT wrapped, kek_id FROM keystore.build_keys WHERE tenant_id = %s AND key_id = %s",
                (tenant_id, key_id),
            ).fetchone()

        def open_row(row: Any) -> bytes:
            if row is None:
                raise KeyDestroyedError("key_id", f"build key {key_id!r} does not exist")
            cached = self.cached(key_id)
            if cached is not None:
                return cached
            wrapped, kek_id = row
            return self.remember(
                key_id, self.open_wrapped(conn, tenant_id, kek_id, wrapped, key_aad("build", tenant_id, None, key_id))
            )

        return retrying(read, open_row)

    # -- destruction and rotation --------------------------------------------------------------------

    def destroy_subject_key(self, conn: psycopg.Connection, tenant_id: str, user_id: str) -> str | None:
        """Delete the subject's key, every version and group key of theirs and their retired key
        (crypto-shredding); returns the destroyed subject key's id.

        Copies of the wrapped keys in PostgreSQL's history stay wrapped by the tenant's current KEK
        until the tenant's physical erasure rotates it."""
        row = conn.execute(
            "DELETE FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = %s RETURNING key_id",
            (tenant_id, user_id),
        ).fetchone()
        self.versions.destroy_subject(conn, tenant_id, user_id)
        conn.execute("DELETE FROM keystore.retired_keys WHERE tenant_id = %s AND user_id = %s", (tenant_id, user_id))
        self.forget_cached()
        return None if row is None else str(row[0])

    def destroy_tenant_keys(self, conn: psycopg.Connection, tenant_id: str) -> list[str]:
        """Delete the tenant key and every subject, team and build key under it, and destroy the
        tenant's vault file (overwritten, then unlinked); returns the destroyed tenant, subject and
        team key ids. Every wrapped copy anywhere is then wrapped by a KEK that no longer exists."""
        destroyed = [str(r[0]) for sql in _DESTROY_TENANT_SQL for r in conn.execute(sql, (tenant_id,)).fetchall()]
        conn.execute("DELETE FROM keystore.build_keys WHERE tenant_id = %s", (tenant_id,))
        conn.execute("DELETE FROM keystore.retired_keys WHERE tenant_id = %s", (tenant_id,))
        self.versions.destroy_tenant(conn, tenant_id)
        self.vault.destroy(tenant_id)
        self.forget_cached()
        return destroyed

    def forget_keks(self, kek_ids: Iterable[str]) -> None:
        """This process forgets these KEKs (rotated away)."""
        with self._lock:
            for kek_id in kek_ids:
                self._cache.pop("kek:" + kek_id, None)
