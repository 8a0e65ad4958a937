"""Texts written before version keys (migration 0021), converted to them, subject by subject.

Releases before 0021 sealed each memory text and original query under its author's subject key, a
key that a MEMORY or retention deletion does not destroy (the author lives on). A subject's
conversion:
1. re-seals each such version of theirs under a new version key, in batches of BATCH versions, each
   batch one transaction (rows locked, so a deletion of one of them orders with it); a version being
   forgotten is left to its deletion;
2. then, in one transaction that holds the subject's write lock and their memories' heads, replaces
   the subject key by a new one that never sealed a text: every text MAC of theirs is recomputed
   under it (the no-op rule compares MACs under the current key) and their postings are marked for
   the keyword index's next sync, which rewrites them under it;
3. and retires the old key: it stays in `keystore.retired_keys`, opening only what backups taken
   before this moment hold, until every such backup has expired; a KEK rotation then destroys it
   (lib/memories/key_rotation.py: the tenant's next erasure, or the next conversion run, whichever
   comes first).

Reads find every row under the key its row names throughout (a retired key opens by its id), and a
conversion stopped anywhere resumes where it stopped. Until a subject's retired key is destroyed,
the copies of their texts made before the conversion (those backups, WAL archives or replicas of an
external server) open with it: deletions of such subjects' versions say so in their proof.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.key_rotation import KeyRotation
from memory_pipelines.lib.memories.keys import KeyStore, key_aad
from memory_pipelines.lib.memories.sealing import query_aad, text_aad
from memory_pipelines.lib.results import KeysConverted

__all__ = [
    "BATCH",
    "KeyConversion",
]

BATCH = 500
# Subjects with something to convert: versions sealed under a subject key (live or retired) rather
# than a key of their own, or a key that once sealed texts. Not those being forgotten: their deletion
# destroys every key of theirs.
_TODO = (
    "SELECT u.user_id FROM ("
    " SELECT user_id FROM keystore.subject_keys WHERE tenant_id = %(t)s AND seals_text"
    " UNION SELECT m.user_id FROM memory.memory_versions v JOIN memory.memories m"
    "  ON m.tenant_id = %(t)s AND m.memory_id = v.memory_id"
    "  WHERE v.tenant_id = %(t)s AND v.key_id NOT LIKE 'vk\\_%%') u"
    " JOIN memory.subjects s ON s.tenant_id = %(t)s AND s.user_id = u.user_id WHERE s.forgotten_at IS NULL"
    " ORDER BY u.user_id"
)
# The next of them: not being forgotten, nor its author (a deletion removes it), its key still there
# (one whose key is destroyed can never be read: a restore's replay or a deletion removes it). Rows
# are locked: a deletion's DELETE of one waits for the batch, whose keys it then finds and destroys.
_BATCH = (
    "SELECT v.memory_id, v.version, v.text_ct, v.original_query_ct, v.key_id FROM memory.memory_versions v"
    " JOIN memory.memories m ON m.tenant_id = %(t)s AND m.memory_id = v.memory_id"
    " JOIN memory.subjects s ON s.tenant_id = %(t)s AND s.user_id = m.user_id AND s.forgotten_at IS NULL"
    " WHERE v.tenant_id = %(t)s AND m.user_id = %(u)s AND v.key_id NOT LIKE 'vk\\_%%'"
    " AND NOT EXISTS (SELECT 1 FROM control.tombstones x WHERE x.tenant_id = %(t)s AND x.memory_id = v.memory_id"
    "  AND x.version = v.version)"
    " AND (EXISTS (SELECT 1 FROM keystore.subject_keys k WHERE k.tenant_id = %(t)s AND k.key_id = v.key_id)"
    "  OR EXISTS (SELECT 1 FROM keystore.retired_keys k WHERE k.tenant_id = %(t)s AND k.key_id = v.key_id))"
    " ORDER BY v.memory_id, v.version LIMIT %(n)s FOR UPDATE OF v SKIP LOCKED"
)
_ALL_ROWS = (
    "SELECT v.memory_id, v.version, v.text_ct, v.key_id FROM memory.memory_versions v"
    " JOIN memory.memories m ON m.tenant_id = %(t)s AND m.memory_id = v.memory_id"
    " WHERE v.tenant_id = %(t)s AND m.user_id = %(u)s"
)


def _due(conn: psycopg.Connection, tenant_id: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM keystore.retired_keys WHERE tenant_id = %s AND destroy_after <= now()", (tenant_id,)
    ).fetchone()
    return int(row[0]) if row else 0


class KeyConversion:
    """Converts the tenants of `keys` (see the module docstring); `backup_days` bounds how long a
    retired key lives (every backup taken before its retirement expires by then)."""

    def __init__(self, transaction: Callable[[], Any], keys: KeyStore, *, backup_days: int) -> None:
        self.transaction = transaction
        self.keys = keys
        self.backup_days = backup_days

    def pending(self, *, tenant_id: str | None = None) -> dict[str, int]:
        """tenant -> subjects with something to convert, and retired keys due for destruction (only
        tenants that have some)."""
        with self.transaction() as conn:
            tenants = (
                [tenant_id]
                if tenant_id is not None
                else [r[0] for r in conn.execute("SELECT tenant_id FROM memory.tenants WHERE deleted_at IS NULL")]
            )
            counts = {t: len(conn.execute(_TODO, {"t": t}).fetchall()) + _due(conn, t) for t in tenants}
        return {t: n for t, n in sorted(counts.items()) if n}

    def convert_tenant(self, *, tenant_id: str, progress: Progress = no_progress) -> KeysConverted:
        """Convert every subject of the tenant that needs it; counts only (versions re-sealed, MACs
        recomputed, keys retired, subjects)."""
        validation.check_id("tenant", tenant_id)
        with self.transaction() as conn:
            subjects = [str(r[0]) for r in conn.execute(_TODO, {"t": tenant_id})]
        totals: KeysConverted = {
            "tenant_id": tenant_id,
            "subjects": 0,
            "resealed": 0,
            "macs": 0,
            "retired": 0,
            "retired_destroyed": 0,
        }
        for index, user_id in enumerate(subjects):
            resealed, macs, retired = self.convert_subject(tenant_id=tenant_id, user_id=user_id)
            totals["resealed"] += resealed
            totals["macs"] += macs
            totals["retired"] += retired
            totals["subjects"] += 1
            progress(index + 1, len(subjects), "key conversion")
        totals["retired_destroyed"] = self._destroy_due(tenant_id)
        return totals

    def _destroy_due(self, tenant_id: str) -> int:
        """Retired keys past their date are destroyed by a KEK rotation, which makes every wrapped copy
        of theirs useless too; none due: nothing rotated."""
        with self.transaction() as conn:
            if not _due(conn, tenant_id):
                return 0
            rotations = KeyRotation(self.keys)
            rotation = rotations.begin(conn, tenant_id)
        if rotation is None:
            return 0
        rotations.finish(rotation)
        return rotation.retired_destroyed

    def convert_subject(self, *, tenant_id: str, user_id: str) -> tuple[int, int, int]:
        """One subject's conversion: (versions re-sealed, MACs recomputed, keys retired)."""
        resealed = 0
        while True:
            with self.transaction() as conn:
                done = self._reseal_batch(conn, tenant_id, user_id)
            resealed += done
            if done < BATCH:
                break
        with self.transaction() as conn:
            macs, retired = self._retire(conn, tenant_id, user_id)
        return resealed, macs, retired

    def _reseal_batch(self, conn: psycopg.Connection, tenant_id: str, user_id: str) -> int:
        """Up to BATCH of the subject's legacy versions sealed again under version keys of their own."""
        rows = conn.execute(_BATCH, {"t": tenant_id, "u": user_id, "n": BATCH}).fetchall()
        if not rows:
            return 0
        old = self.keys.keys_by_id(conn, tenant_id, [str(r[4]) for r in rows])
        new = self.keys.versions.allocate(conn, tenant_id, {user_id: len(rows)})[user_id]
        updates = []
        for (memory_id, version, text_ct, query_ct, key_id), made in zip(rows, new, strict=True):
            key = old[key_id]
            aad = text_aad(tenant_id, memory_id, version)
            q_aad = query_aad(tenant_id, memory_id, version)
            query = None if query_ct is None else crypto.open_sealed(key, bytes(query_ct), q_aad)
            updates.append(
                (
                    memory_id,
                    version,
                    crypto.seal(made.key, crypto.open_sealed(key, bytes(text_ct), aad), aad),
                    None if query is None else crypto.seal(made.key, query, q_aad),
                    made.key_id,
                )
            )
        self.keys.versions.insert(conn, tenant_id, [(k, u[0], u[1]) for k, u in zip(new, updates, strict=True)])
        conn.execute(
            "UPDATE memory.memory_versions v SET text_ct = u.text_ct, original_query_ct = u.query_ct, key_id = u.key_id"
            " FROM unnest(%s::text[], %s::int[], %s::bytea[], %s::bytea[], %s::text[])"
            " AS u(memory_id, version, text_ct, query_ct, key_id)"
            " WHERE v.tenant_id = %s AND v.memory_id = u.memory_id AND v.version = u.version",
            (
                [u[0] for u in updates],
                [u[1] for u in updates],
                [u[2] for u in updates],
                [u[3] for u in updates],
                [u[4] for u in updates],
                tenant_id,
            ),
        )
        return len(updates)

    def _retire(self, conn: psycopg.Connection, tenant_id: str, user_id: str) -> tuple[int, int]:
        """Under the subject's write lock and their heads: a new subject key if theirs sealed texts (the
        old one retired), and every MAC of theirs recomputed under the current one. Returns (MACs
        recomputed, keys retired)."""
        conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"{tenant_id}\x1f{user_id}",))
        conn.execute(
            "SELECT 1 FROM memory.memories WHERE tenant_id = %s AND user_id = %s ORDER BY memory_id FOR UPDATE",
            (tenant_id, user_id),
        )
        row = conn.execute(
            "SELECT k.seals_text FROM keystore.subject_keys k JOIN memory.subjects s ON s.tenant_id = %(t)s"
            " AND s.user_id = k.user_id AND s.forgotten_at IS NULL WHERE k.tenant_id = %(t)s AND k.user_id = %(u)s"
            " FOR UPDATE OF k",
            {"t": tenant_id, "u": user_id},
        ).fetchone()
        if row is None:
            return 0, 0  # being forgotten, or destroyed meanwhile: their deletion removes the rest
        retire = bool(row[0])
        if retire:
            self._new_subject_key(conn, tenant_id, user_id)
        _, root = self.keys.subject_key(conn, tenant_id, user_id, create=False)
        mac_key = crypto.derive_key(root, b"memory-text-mac")
        rows = conn.execute(_ALL_ROWS, {"t": tenant_id, "u": user_id}).fetchall()
        keys = self.keys.keys_by_id(conn, tenant_id, [str(r[3]) for r in rows])
        macs = []
        for memory_id, version, text_ct, key_id in rows:
            if key_id in keys:
                text = crypto.open_sealed(keys[key_id], bytes(text_ct), text_aad(tenant_id, memory_id, version))
                macs.append((memory_id, version, crypto.mac(mac_key, text)))
        conn.execute(
            "UPDATE memory.memory_versions v SET text_mac = u.mac FROM unnest(%s::text[], %s::int[], %s::bytea[])"
            " AS u(memory_id, version, mac) WHERE v.tenant_id = %s AND v.memory_id = u.memory_id"
            " AND v.version = u.version AND v.text_mac <> u.mac",
            ([m for m, _, _ in macs], [v for _, v, _ in macs], [x for _, _, x in macs], tenant_id),
        )
        if retire:
            # Their author-only postings were MACed under the old key: the next keyword sync rewrites them.
            conn.execute(
                "UPDATE derived.keyword_postings p SET legacy_key = true FROM memory.memories m"
                " WHERE p.tenant_id = %s AND m.tenant_id = %s AND m.memory_id = p.memory_id AND m.user_id = %s"
                " AND NOT p.legacy_key",
                (tenant_id, tenant_id, user_id),
            )
        return len(macs), int(retire)

    def _new_subject_key(self, conn: psycopg.Connection, tenant_id: str, user_id: str) -> None:
        conn.execute(
            "INSERT INTO keystore.retired_keys (tenant_id, key_id, user_id, wrapped, kek_id, destroy_after)"
            " SELECT tenant_id, key_id, user_id, wrapped, kek_id, now() + %s FROM keystore.subject_keys"
            " WHERE tenant_id = %s AND user_id = %s",
            (timedelta(days=self.backup_days), tenant_id, user_id),
        )
        with self.keys.wrapping(conn, tenant_id) as (kek_id, wrapping):
            key_id = "sk_" + secrets.token_hex(12)
            wrapped = crypto.seal(wrapping, crypto.new_key(), key_aad("subject", tenant_id, user_id, key_id))
            conn.execute(
                "UPDATE keystore.subject_keys SET key_id = %s, wrapped = %s, kek_id = %s, seals_text = false,"
                " created_at = now() WHERE tenant_id = %s AND user_id = %s",
                (key_id, wrapped, kek_id, tenant_id, user_id),
            )
