"""Rotation of a tenant's key-encryption key (KEK), the physical erasure's key step.

A new KEK joins the tenant's vault file (fsynced before anything names it); in the caller's
transaction, groups that lost a member get new group keys (lib/memories/version_keys.py), retired
subject keys past their date go, and every key the KEK wraps is rewrapped under the new one. After
the commit the vault file is overwritten in place with the new KEK alone. Any wrapped copy that
PostgreSQL's history keeps (WAL, dead tuples, pg_statistic, replicas, base backups) is then wrapped
by a KEK that exists nowhere, so a destroyed key cannot be rebuilt from it with every key left.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from memory_pipelines.lib.infra import faults
from memory_pipelines.lib.infra.errors import NotFoundError
from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.keys import KeyStore, key_aad
from memory_pipelines.lib.memories.version_keys import rotation_lock

__all__ = [
    "KeyRotation",
    "Rotation",
]

# Every table of keys the KEK wraps below the tenant key: the name its count goes by, the table, the
# column naming each key's owner, and the kind its associated data names (a retired key was a subject
# key). Version keys are wrapped by group keys, not by the KEK: a rotation leaves them alone.
_WRAPPED = (
    ("subject", "subject_keys", "user_id", "subject"),
    ("team", "team_keys", "team_id", "team"),
    ("build", "build_keys", None, "build"),
    ("group", "group_keys", "user_id", "group"),
    ("retired", "retired_keys", "user_id", "subject"),
)


def _select(table: str, owner: str | None) -> sql.Composed:
    return sql.SQL("SELECT {}, key_id, wrapped, kek_id FROM {} WHERE tenant_id = %s AND wrapped IS NOT NULL").format(
        sql.Identifier(owner) if owner else sql.NULL, sql.Identifier("keystore", table)
    )


def _update(table: str) -> sql.Composed:
    return sql.SQL(
        "UPDATE {} k SET wrapped = u.wrapped, kek_id = %s FROM unnest(%s::text[], %s::bytea[]) AS u(key_id, wrapped)"
        " WHERE k.tenant_id = %s AND k.key_id = u.key_id"
    ).format(sql.Identifier("keystore", table))


_KEKS_IN_USE = sql.SQL(" UNION ").join(
    sql.SQL("SELECT kek_id FROM {} WHERE tenant_id = %(t)s AND kek_id IS NOT NULL").format(
        sql.Identifier("keystore", table)
    )
    for table in ("tenant_keys", *(t for _, t, _, _ in _WRAPPED))
)


@dataclass(frozen=True)
class Rotation:
    """A KEK rotation whose rows are rewrapped (in an uncommitted transaction until its caller commits)."""

    tenant_id: str
    kek_id: str
    previous: tuple[str, ...]
    rewrapped: dict[str, int]
    rekeyed: dict[str, int]  # group keys replaced for their survivors, version keys rewrapped (VersionKeys.rekey)
    retired_destroyed: int  # retired subject keys destroyed: every backup that needed them has expired


class KeyRotation:
    """Rotates the KEKs of the tenants of `keys`: `begin`, commit, `finish`."""

    def __init__(self, keys: KeyStore) -> None:
        self.keys = keys

    def begin(self, conn: psycopg.Connection, tenant_id: str) -> Rotation | None:
        """First half, in the caller's transaction (see the module docstring); None when the tenant has
        no live tenant key. Takes the tenant's rotation lock exclusively: a key being wrapped
        concurrently commits first and is rewrapped here too, or waits and is wrapped under the new KEK;
        a version key being added to a group commits first and is rekeyed with it."""
        keys = self.keys
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 2))", (rotation_lock(tenant_id),))
        try:
            tenant_key_id, tenant_key = keys.tenant_key(conn, tenant_id, create=False)
        except NotFoundError:  # never made, or destroyed with the tenant
            return None
        rekeyed = keys.versions.rekey(conn, tenant_id)
        retired = conn.execute(
            "DELETE FROM keystore.retired_keys WHERE tenant_id = %s AND destroy_after <= now()", (tenant_id,)
        ).rowcount
        in_use = {str(r[0]) for r in conn.execute(_KEKS_IN_USE, {"t": tenant_id})}
        previous = tuple(keys.vault.kek_ids(tenant_id))
        kek_id, kek = keys.vault.introduce(tenant_id, keep=in_use)
        faults.point("kek.introduced")
        keys.remember("kek:" + kek_id, kek)
        rewrapped: dict[str, int] = {}
        for name, table, owner, kind in _WRAPPED:
            ids: list[str] = []
            blobs: list[bytes] = []
            for owner_id, key_id, wrapped, old_kek in conn.execute(_select(table, owner), (tenant_id,)).fetchall():
                aad = key_aad(kind, tenant_id, owner_id, key_id)
                wrapping = tenant_key if old_kek is None else keys.kek(tenant_id, old_kek)
                ids.append(key_id)
                blobs.append(crypto.seal(kek, crypto.open_sealed(wrapping, bytes(wrapped), aad), aad))
            if ids:
                conn.execute(_update(table), (kek_id, ids, blobs, tenant_id))
            rewrapped[name] = len(ids)
        conn.execute(
            "UPDATE keystore.tenant_keys SET wrapped = %s, kek_id = %s WHERE tenant_id = %s",
            (crypto.seal(kek, tenant_key, crypto.aad("tenant-key", tenant_id, tenant_key_id)), kek_id, tenant_id),
        )
        rewrapped["tenant"] = 1
        return Rotation(
            tenant_id=tenant_id,
            kek_id=kek_id,
            previous=previous,
            rewrapped=rewrapped,
            rekeyed=rekeyed,
            retired_destroyed=retired,
        )

    def finish(self, rotation: Rotation) -> None:
        """Second half, after the commit: the vault file is overwritten in place with the new KEK
        only (both slots, fsynced), and this process forgets the old KEKs."""
        self.keys.vault.keep_only(rotation.tenant_id, rotation.kek_id)
        self.keys.forget_keks(k for k in rotation.previous if k != rotation.kek_id)
