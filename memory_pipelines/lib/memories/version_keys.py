"""Version keys: one data key per memory version, so forgetting a version destroys a key that no
surviving memory needs, whatever the scope.

A version's text and original query are sealed under its own key (`vk_`), wrapped by a group key
(`gk_`) of its author; a group wraps at most GROUP_SIZE version keys and is wrapped by the tenant's
key-encryption key like every other key of the tenant (lib/memories/keys.py). Forgetting a version
deletes its key and marks its group; the tenant's physical erasure then gives the group's survivors a
new group key and deletes the old one (`rekey`), in the transaction that rotates the KEK. From then
on every copy PostgreSQL keeps of the forgotten ciphertext (WAL, dead tuples, pg_statistic, a
replica, an archive) and every backup's copy is sealed under a key whose wrapped copies are all
wrapped by keys that no longer exist anywhere. A KEK rotation rewraps group keys only, so its cost
follows versions / GROUP_SIZE; a rekey rewraps at most GROUP_SIZE - 1 version keys per group.

Ordering, against the erasure: a writer takes the tenant's rotation lock (shared) before it reads its
group, in the statement that reads it, and holds it until it commits; a rotation, and the rekey in it,
holds it exclusively. So a rekey never meets a version key being added to its group: it starts after
the writer committed (and rewraps that key with the others) or the writer starts after it (and finds
the group gone). No group row is locked (a row lock would write WAL at every write).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg

from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.key_vault import retrying

if TYPE_CHECKING:
    from memory_pipelines.lib.memories.keys import KeyStore

__all__ = [
    "GROUP_KEY_PREFIX",
    "GROUP_SIZE",
    "INSERT_ONE",
    "VERSION_KEY_PREFIX",
    "NewVersionKey",
    "OpenGroup",
    "VersionKeys",
    "rotation_lock",
]

VERSION_KEY_PREFIX = "vk_"
GROUP_KEY_PREFIX = "gk_"
# Versions per group key: a rotation rewraps one key per group, a rekey after a forget rewraps the
# group's survivors. Chosen by measurement (docs/performance.md: version keys).
GROUP_SIZE = 256


def rotation_lock(tenant_id: str) -> str:
    """Advisory lock of a tenant's KEK: shared by whoever wraps a new key, exclusive for a rotation."""
    return f"kek-rotation\x1f{tenant_id}"


# Each author's newest group that takes new members, with how many it has, in one statement that takes
# the tenant's rotation lock first: the authors come out of a CTE that takes it, and each group is read
# for one of them. Every table is bound to the tenant by value, so planning locks the tenant's
# partitions alone (another tenant's compaction holds ACCESS EXCLUSIVE on its own).
_OPEN_GROUPS = (
    "WITH w AS MATERIALIZED (SELECT u.user_id FROM unnest(%(u)s::text[]) AS u(user_id),"
    " pg_advisory_xact_lock_shared(hashtextextended(%(lock)s, 2)))"
    " SELECT w.user_id, x.key_id, x.wrapped, x.kek_id, x.members, s.key_id, s.wrapped, s.kek_id FROM w"
    " LEFT JOIN keystore.subject_keys s ON s.tenant_id = %(t)s AND s.user_id = w.user_id"
    " LEFT JOIN LATERAL ("
    "  SELECT g.key_id, g.wrapped, g.kek_id, (SELECT count(*) FROM keystore.version_keys v"
    "   WHERE v.tenant_id = %(t)s AND v.group_key_id = g.key_id) AS members"
    "  FROM keystore.group_keys g WHERE g.tenant_id = %(t)s AND g.user_id = w.user_id AND NOT g.rekey"
    "  ORDER BY g.created_at DESC, g.key_id DESC LIMIT 1) x ON true"
)
_NEW_GROUPS = (
    "INSERT INTO keystore.group_keys (tenant_id, key_id, user_id, wrapped, kek_id)"
    " SELECT %s, k, u, w, %s FROM unnest(%s::text[], %s::text[], %s::bytea[]) AS x(k, u, w)"
)
# One version key, in the statement that inserts its version (`VersionKeys.params` binds it).
INSERT_ONE = (
    "INSERT INTO keystore.version_keys (tenant_id, key_id, group_key_id, memory_id, version, wrapped)"
    " VALUES (%(vk_tenant)s, %(vk_key)s, %(vk_group)s, %(vk_memory)s, %(vk_version)s, %(vk_wrapped)s)"
)
_OPEN = (
    "SELECT v.key_id, v.wrapped, g.key_id, g.user_id, g.wrapped, g.kek_id FROM keystore.version_keys v"
    " JOIN keystore.group_keys g ON g.tenant_id = %(t)s AND g.key_id = v.group_key_id"
    " WHERE v.tenant_id = %(t)s AND v.key_id = ANY(%(k)s)"
)


def _group_aad(tenant_id: str, user_id: str, key_id: str) -> bytes:
    return crypto.aad("group-key", tenant_id, user_id, key_id)


def _version_aad(tenant_id: str, key_id: str) -> bytes:
    return crypto.aad("version-key", tenant_id, key_id)


def _rewrap(old: bytes, new: bytes, wrapped: bytes, aad: bytes) -> bytes:
    return crypto.seal(new, crypto.open_sealed(old, wrapped, aad), aad)


@dataclass(frozen=True)
class OpenGroup:
    """An author's newest group that takes members (None: none), read under the tenant's rotation lock,
    and the row of their subject key (None: they have none), read in the same statement."""

    group: tuple[str, Any, str | None, int] | None  # key id, wrapped, KEK id, members
    subject_key: tuple[str, Any, str | None] | None  # key id, wrapped, KEK id


@dataclass(frozen=True)
class NewVersionKey:
    """A version key made for one version, wrapped by its group key, not yet stored."""

    key_id: str
    key: bytes = field(repr=False)
    group_key_id: str
    wrapped: bytes


class VersionKeys:
    """Makes, opens, destroys and rekeys version keys and their group keys (see the module docstring).
    `keys` is the tenant key store that wraps group keys under the tenant's KEK and caches unwrapped keys."""

    def __init__(self, keys: KeyStore) -> None:
        self.keys = keys

    # -- new keys ------------------------------------------------------------------------------------

    def open_groups(self, conn: psycopg.Connection, tenant_id: str, users: Sequence[str]) -> dict[str, OpenGroup]:
        """Each author's open group and subject key row, in one statement that first takes the tenant's
        rotation lock (shared, until the transaction ends: no rekey of these groups meanwhile)."""
        rows = conn.execute(
            _OPEN_GROUPS, {"t": tenant_id, "u": sorted(set(users)), "lock": rotation_lock(tenant_id)}
        ).fetchall()
        return {
            str(user_id): OpenGroup(
                None if group_id is None else (str(group_id), wrapped, kek_id, int(members)),
                None if key_id is None else (str(key_id), key_wrapped, key_kek),
            )
            for user_id, group_id, wrapped, kek_id, members, key_id, key_wrapped, key_kek in rows
        }

    def allocate(
        self,
        conn: psycopg.Connection,
        tenant_id: str,
        wanted: dict[str, int],
        opened: dict[str, OpenGroup] | None = None,
    ) -> dict[str, list[NewVersionKey]]:
        """For each author of `wanted`, that many new version keys, in their open group (new groups as
        they fill), in the caller's transaction; stored by `insert` (or with the version, `INSERT_ONE`).
        No rekey touches the groups until it commits. `opened`: their `open_groups`, when already read (the
        authors' subject keys must exist before a group is made: the tenant key comes with the first)."""
        users = sorted(wanted)
        opened = opened if opened is not None else self.open_groups(conn, tenant_id, users)
        groups: dict[str, list[tuple[str, bytes, int]]] = {}  # user -> (group id, group key, room), in order
        needed: dict[str, int] = {}
        for user_id in users:
            found = opened[user_id].group
            room = 0 if found is None else GROUP_SIZE - found[3]
            if found is not None and room > 0:
                key = self._group_key(conn, tenant_id, user_id, found[0], found[2], found[1])
                groups[user_id] = [(found[0], key, room)]
            missing = wanted[user_id] - max(room, 0)
            if missing > 0:
                needed[user_id] = -(-missing // GROUP_SIZE)
        for user_id, made in self._new_groups(conn, tenant_id, needed).items():
            groups.setdefault(user_id, []).extend((group_id, key, GROUP_SIZE) for group_id, key in made)
        out: dict[str, list[NewVersionKey]] = {}
        for user_id in users:
            keys: list[NewVersionKey] = []
            for group_id, group_key, room in groups[user_id]:
                wrap = crypto.sealer(group_key)
                for _ in range(min(room, wanted[user_id] - len(keys))):
                    key_id = VERSION_KEY_PREFIX + secrets.token_hex(12)
                    key = crypto.new_key()
                    keys.append(NewVersionKey(key_id, key, group_id, wrap(key, _version_aad(tenant_id, key_id))))
            out[user_id] = keys
        return out

    def insert(self, conn: psycopg.Connection, tenant_id: str, rows: Sequence[tuple[NewVersionKey, str, int]]) -> None:
        """Store version keys for (key, memory_id, version) rows, in the transaction of their `allocate`
        (which holds their groups)."""
        with conn.cursor() as cur:
            with cur.copy(
                "COPY keystore.version_keys (tenant_id, key_id, group_key_id, memory_id, version, wrapped) FROM STDIN"
            ) as copy:
                for key, memory_id, version in rows:
                    copy.write_row((tenant_id, key.key_id, key.group_key_id, memory_id, version, key.wrapped))
        for key, _, _ in rows:
            self.keys.remember(key.key_id, key.key)

    def new_key(self, conn: psycopg.Connection, tenant_id: str, user_id: str) -> NewVersionKey:
        """One version key of `user_id`, for the caller to store with its version (`INSERT_ONE`, `params`)."""
        (key,) = self.allocate(conn, tenant_id, {user_id: 1})[user_id]
        self.keys.remember(key.key_id, key.key)
        return key

    @staticmethod
    def params(tenant_id: str, key: NewVersionKey, memory_id: str, version: int) -> dict[str, Any]:
        """The parameters of `INSERT_ONE`."""
        return {
            "vk_tenant": tenant_id,
            "vk_key": key.key_id,
            "vk_group": key.group_key_id,
            "vk_memory": memory_id,
            "vk_version": version,
            "vk_wrapped": key.wrapped,
        }

    def _new_groups(
        self, conn: psycopg.Connection, tenant_id: str, needed: dict[str, int]
    ) -> dict[str, list[tuple[str, bytes]]]:
        """user -> that many new group keys of theirs, (id, key), made in one insert under the KEK."""
        if not needed:
            return {}
        made: dict[str, list[tuple[str, bytes]]] = {}
        ids, users, blobs = [], [], []
        with self.keys.wrapping(conn, tenant_id) as (kek_id, wrapping):
            for user_id, count in sorted(needed.items()):
                for _ in range(count):
                    key_id = GROUP_KEY_PREFIX + secrets.token_hex(12)
                    key = self.keys.remember(key_id, crypto.new_key())
                    made.setdefault(user_id, []).append((key_id, key))
                    ids.append(key_id)
                    users.append(user_id)
                    blobs.append(crypto.seal(wrapping, key, _group_aad(tenant_id, user_id, key_id)))
            conn.execute(_NEW_GROUPS, (tenant_id, kek_id, ids, users, blobs))
        return made

    def _group_key(
        self, conn: psycopg.Connection, tenant_id: str, user_id: str, key_id: str, kek_id: str | None, wrapped: Any
    ) -> bytes:
        cached = self.keys.cached(key_id)
        if cached is not None:
            return cached
        key = self.keys.open_wrapped(conn, tenant_id, kek_id, wrapped, _group_aad(tenant_id, user_id, key_id))
        return self.keys.remember(key_id, key)

    # -- reading -------------------------------------------------------------------------------------

    def open(self, conn: psycopg.Connection, tenant_id: str, key_ids: Sequence[str]) -> dict[str, bytes]:
        """key_id -> version key, for those of `key_ids` that still exist (one query for all). The key
        store is asked every time; only unwrapping is cached."""
        wanted = sorted(set(key_ids))
        if not wanted:
            return {}

        def read() -> list[Any]:
            return conn.execute(_OPEN, {"t": tenant_id, "k": wanted}).fetchall()

        def open_rows(rows: list[Any]) -> dict[str, bytes]:
            out: dict[str, bytes] = {}
            for key_id, wrapped, group_id, user_id, group_wrapped, kek_id in rows:
                key = self.keys.cached(key_id)
                if key is None:
                    group_key = self._group_key(conn, tenant_id, user_id, group_id, kek_id, group_wrapped)
                    key = crypto.open_sealed(group_key, bytes(wrapped), _version_aad(tenant_id, key_id))
                    self.keys.remember(key_id, key)
                out[key_id] = key
            return out

        return retrying(read, open_rows)

    # -- destruction ---------------------------------------------------------------------------------

    def destroy_versions(self, conn: psycopg.Connection, tenant_id: str, sources: Sequence[tuple[str, int]]) -> int:
        """Delete the keys of these (memory_id, version) pairs and mark their groups for the next
        erasure's rekey; returns the keys deleted."""
        if not sources:
            return 0
        rows = conn.execute(
            "DELETE FROM keystore.version_keys k USING unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
            " WHERE k.tenant_id = %s AND k.memory_id = w.memory_id AND k.version = w.version"
            " RETURNING k.key_id, k.group_key_id",
            ([m for m, _ in sources], [v for _, v in sources], tenant_id),
        ).fetchall()
        groups = sorted({str(group) for _, group in rows})
        if groups:
            conn.execute(
                "UPDATE keystore.group_keys SET rekey = true WHERE tenant_id = %s AND key_id = ANY(%s) AND NOT rekey",
                (tenant_id, groups),
            )
        self.keys.forget_cached()
        return len(rows)

    @staticmethod
    def destroy_subject(conn: psycopg.Connection, tenant_id: str, user_id: str) -> int:
        """Delete every version key and group key of the subject; returns the version keys deleted."""
        deleted = conn.execute(
            "DELETE FROM keystore.version_keys v USING keystore.group_keys g WHERE v.tenant_id = %(t)s"
            " AND g.tenant_id = %(t)s AND g.user_id = %(u)s AND v.group_key_id = g.key_id",
            {"t": tenant_id, "u": user_id},
        ).rowcount
        conn.execute("DELETE FROM keystore.group_keys WHERE tenant_id = %s AND user_id = %s", (tenant_id, user_id))
        return deleted

    @staticmethod
    def destroy_tenant(conn: psycopg.Connection, tenant_id: str) -> int:
        deleted = conn.execute("DELETE FROM keystore.version_keys WHERE tenant_id = %s", (tenant_id,)).rowcount
        conn.execute("DELETE FROM keystore.group_keys WHERE tenant_id = %s", (tenant_id,))
        return deleted

    def rekey(self, conn: psycopg.Connection, tenant_id: str) -> dict[str, int]:
        """Every group with a destroyed member gets a new group key for its survivors, and the old one
        is deleted; in the caller's transaction, which holds the tenant's rotation lock exclusively and
        rotates the KEK before it commits. Returns counts: groups rekeyed, survivors rewrapped."""
        dirty = conn.execute(
            "SELECT key_id, user_id, wrapped, kek_id FROM keystore.group_keys WHERE tenant_id = %s AND rekey"
            " ORDER BY key_id FOR UPDATE",
            (tenant_id,),
        ).fetchall()
        rewrapped = 0
        for group_id, user_id, wrapped, kek_id in dirty:
            old = self._group_key(conn, tenant_id, user_id, group_id, kek_id, wrapped)
            members = conn.execute(
                "SELECT key_id, wrapped FROM keystore.version_keys WHERE tenant_id = %s AND group_key_id = %s",
                (tenant_id, group_id),
            ).fetchall()
            if members:
                [(new_id, new)] = self._new_groups(conn, tenant_id, {user_id: 1})[user_id]
                ids = [str(key_id) for key_id, _ in members]
                blobs = [_rewrap(old, new, bytes(w), _version_aad(tenant_id, str(k))) for k, w in members]
                conn.execute(
                    "UPDATE keystore.version_keys k SET group_key_id = %s, wrapped = u.wrapped"
                    " FROM unnest(%s::text[], %s::bytea[]) AS u(key_id, wrapped)"
                    " WHERE k.tenant_id = %s AND k.key_id = u.key_id",
                    (new_id, ids, blobs, tenant_id),
                )
                rewrapped += len(ids)
            conn.execute("DELETE FROM keystore.group_keys WHERE tenant_id = %s AND key_id = %s", (tenant_id, group_id))
        if dirty:
            self.keys.forget_cached()
        return {"groups": len(dirty), "rewrapped": rewrapped}
