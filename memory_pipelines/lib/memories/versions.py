"""A memory's versions: the head (its current version), the append-only chain of versions behind it
(numbers never reused), rollback to an earlier version as a new one, the history, and the repair of
heads after versions were deleted (forget, a restore's replay).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import ConflictError, NotFoundError, PermissionDeniedError
from memory_pipelines.lib.memories import crypto, ordering, tenants
from memory_pipelines.lib.memories.connections import Connections
from memory_pipelines.lib.memories.keys import KeyStore
from memory_pipelines.lib.memories.records import iso
from memory_pipelines.lib.memories.sealing import Sealing, seal_query, text_aad
from memory_pipelines.lib.memories.version_keys import INSERT_ONE, NewVersionKey, VersionKeys
from memory_pipelines.lib.results import MemoryVersion, RollBack

# A version and its key, in one statement (one round trip: a write waits on each); a new memory's first
# version with the memory's row too (its foreign key is checked when the statement ends).
_VERSION_ROW = (
    " INSERT INTO memory.memory_versions (tenant_id, memory_id, version,"
    " shareable, category, confidence, text_ct, text_mac, original_query_ct, key_id, restored_from)"
    " VALUES (%(t)s, %(m)s, %(v)s, %(shareable)s, %(category)s, %(confidence)s, %(text_ct)s, %(text_mac)s,"
    " %(query_ct)s, %(key_id)s, %(restored_from)s)"
)
_INSERT_VERSION = "WITH k AS (" + INSERT_ONE + ")" + _VERSION_ROW
_INSERT_MEMORY = (
    "WITH k AS (" + INSERT_ONE + "), m AS ("  # noqa: S608 - constant text
    "INSERT INTO memory.memories (tenant_id, memory_id, user_id, team_id,"
    " memory_type, current_version, do_not_sell) VALUES (%(t)s, %(m)s, %(user)s, %(team)s, %(type)s, 1, %(dns)s))"
    + _VERSION_ROW
)

__all__ = [
    "Versions",
    "next_version",
    "read_head",
    "repair_heads",
    "require_author",
    "supersede_and_point",
]


def repair_heads(conn: psycopg.Connection, *, tenant_id: str, memory_ids: list[str] | None = None) -> int:
    """After versions were deleted (forget, a restore's replay): each memory that lost some points at
    its newest remaining version, and memories left with none go. `None` checks the whole tenant.
    Returns how many memories went."""
    conn.execute(
        "UPDATE memory.memories m SET current_version = latest.version, updated_at = now()"
        " FROM (SELECT memory_id, max(version) AS version FROM memory.memory_versions"
        "       WHERE tenant_id = %(t)s AND (%(ids)s::text[] IS NULL OR memory_id = ANY(%(ids)s))"
        "       GROUP BY memory_id) latest"
        " WHERE m.tenant_id = %(t)s AND m.memory_id = latest.memory_id AND m.current_version <> latest.version",
        {"t": tenant_id, "ids": memory_ids},
    )
    conn.execute(
        "UPDATE memory.memory_versions v SET superseded_at = NULL FROM memory.memories m"
        " WHERE v.tenant_id = %(t)s AND m.tenant_id = v.tenant_id AND m.memory_id = v.memory_id"
        " AND v.version = m.current_version AND v.superseded_at IS NOT NULL"
        " AND (%(ids)s::text[] IS NULL OR m.memory_id = ANY(%(ids)s))",
        {"t": tenant_id, "ids": memory_ids},
    )
    return conn.execute(
        "DELETE FROM memory.memories m WHERE m.tenant_id = %(t)s"
        " AND (%(ids)s::text[] IS NULL OR m.memory_id = ANY(%(ids)s))"
        " AND NOT EXISTS (SELECT 1 FROM memory.memory_versions v WHERE v.tenant_id = m.tenant_id"
        " AND v.memory_id = m.memory_id)",
        {"t": tenant_id, "ids": memory_ids},
    ).rowcount


def read_head(conn: psycopg.Connection, tenant_id: str, memory_id: str, *, lock: bool = False) -> dict[str, Any]:
    """The memory's row with its current version's fields (no text); NotFoundError when absent or hidden.
    With `lock`, the memory's row is locked FOR UPDATE first."""
    query = (
        "SELECT m.*, v.shareable, v.category, v.confidence, v.text_mac, v.original_query_ct, v.key_id,"
        " (s.forgotten_at IS NOT NULL OR EXISTS (SELECT 1 FROM control.tombstones t"
        "   WHERE t.tenant_id = m.tenant_id AND t.memory_id = m.memory_id AND t.version = m.current_version))"
        " AS hidden"
        " FROM memory.memories m"
        " JOIN memory.subjects s ON s.tenant_id = m.tenant_id AND s.user_id = m.user_id"
        " JOIN memory.memory_versions v"
        "  ON v.tenant_id = m.tenant_id AND v.memory_id = m.memory_id AND v.version = m.current_version "
        "WHERE m.tenant_id = %s AND m.memory_id = %s"
    )
    if lock:
        # Lock the head alone, then read it with a fresh statement: locking inside the join let a
        # concurrent new version drop the row from the result (a false "no memory").
        conn.execute(
            "SELECT 1 FROM memory.memories WHERE tenant_id = %s AND memory_id = %s FOR UPDATE",
            (tenant_id, memory_id),
        )
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(query, (tenant_id, memory_id)).fetchone()
    if row is None or row["hidden"]:
        raise NotFoundError("memory_id", f"no memory {memory_id} in tenant {tenant_id!r}")
    return row


def supersede_and_point(conn: psycopg.Connection, tenant_id: str, memory_id: str, version: int) -> None:
    """Supersede the memory's current version and point its head at `version` (whose row follows)."""
    conn.execute(
        "UPDATE memory.memory_versions SET superseded_at = now() "
        "WHERE tenant_id = %s AND memory_id = %s AND superseded_at IS NULL",
        (tenant_id, memory_id),
    )
    conn.execute(
        "UPDATE memory.memories SET current_version = %s, updated_at = now() WHERE tenant_id = %s AND memory_id = %s",
        (version, tenant_id, memory_id),
    )


def _nothing_to_roll_back(
    conn: psycopg.Connection, tenant_id: str, memory_id: str, current: int, earlier: list[tuple[int, bool]]
) -> str:
    """Why a rollback has no version to copy: one version only, earlier ones being forgotten
    (they never come back), or earlier ones gone (forgotten, or dropped by a restore)."""
    pending = sorted(int(v) for v, _ in earlier)
    if pending:
        which = ", ".join(map(str, pending))
        return (
            f"version{'s' if len(pending) > 1 else ''} {which} of memory {memory_id}"
            f" {'are' if len(pending) > 1 else 'is'} being forgotten and cannot come back;"
            " no earlier version is left to roll back to"
        )
    if current < 2:
        return f"memory {memory_id} has one version; there is nothing to roll back to"
    forgotten = {
        int(r[0])
        for r in conn.execute(
            "SELECT version FROM control.tombstones WHERE tenant_id = %s AND memory_id = %s AND version < %s",
            (tenant_id, memory_id, current),
        )
    }
    gone = range(1, current)
    parts = []
    for label, numbers in (
        ("forgotten", [v for v in gone if v in forgotten]),
        ("dropped by a restore", [v for v in gone if v not in forgotten]),
    ):
        if numbers:
            were = "was" if len(numbers) == 1 else "were"
            parts.append(f"version{'s' if len(numbers) > 1 else ''} {', '.join(map(str, numbers))} {were} {label}")
    return f"memory {memory_id} has no version before {current} left ({'; '.join(parts)}); nothing to roll back to"


def next_version(conn: psycopg.Connection, tenant_id: str, memory_id: str, current: int) -> int:
    """A version number never used before: a forgotten version's number stays taken by its
    tombstone (a new version under it would be hidden, and removed by every restore's replay),
    and one a restore dropped by the derived copies still named after it."""
    row = conn.execute(
        "SELECT greatest((SELECT max(version) FROM control.tombstones WHERE tenant_id = %(t)s"
        " AND memory_id = %(m)s), (SELECT max(source_version) FROM derived.lineage WHERE tenant_id = %(t)s"
        " AND source_memory_id = %(m)s))",
        {"t": tenant_id, "m": memory_id},
    ).fetchone()
    return max(current, row[0] if row and row[0] is not None else 0) + 1


def require_author(head: dict[str, Any], user_id: str, action: str) -> None:
    """Refuse unless `user_id` wrote the memory of `head`; `action` ends the refusal's sentence."""
    if head["user_id"] != user_id:
        raise PermissionDeniedError(
            "user", f"memory {head['memory_id']} belongs to another user; only its author {action}"
        )


def _version_row(conn: psycopg.Connection, tenant_id: str, memory_id: str, version: int) -> dict[str, Any]:
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            "SELECT * FROM memory.memory_versions WHERE tenant_id = %s AND memory_id = %s AND version = %s",
            (tenant_id, memory_id, version),
        ).fetchone()
    if row is None:
        raise NotFoundError("version", f"memory {memory_id} has no version {version}")
    return row


class Versions:
    """Version rows (sealed under their own keys from `keys`), rollback and history."""

    def __init__(self, connections: Connections, keys: KeyStore, sealing: Sealing) -> None:
        self.connections = connections
        self.keys = keys
        self.sealing = sealing

    def insert_version_row(
        self,
        conn: psycopg.Connection,
        *,
        tenant_id: str,
        memory_id: str,
        version: int,
        key: NewVersionKey,
        text: str,
        text_mac: bytes,
        shareable: bool,
        category: str,
        confidence: float,
        original_query: str | None,
        restored_from: int | None,
        memory: dict[str, Any] | None = None,
    ) -> None:
        """The version's row, its text and query sealed under `key`, a key of its own (from
        `KeyStore.for_writes` or `VersionKeys.new_key`), stored in the same statement; with `memory`
        (user, team, type, dns), the row of the new memory whose first version it is, too."""
        made = key
        self.keys.remember(made.key_id, made.key)
        conn.execute(
            _INSERT_VERSION if memory is None else _INSERT_MEMORY,
            {
                **(memory or {}),
                "t": tenant_id,
                "m": memory_id,
                "v": version,
                "shareable": shareable,
                "category": category,
                "confidence": confidence,
                "text_ct": crypto.seal(made.key, text.encode("utf-8"), text_aad(tenant_id, memory_id, version)),
                "text_mac": text_mac,
                "query_ct": seal_query(made.key, tenant_id, memory_id, version, original_query),
                "key_id": made.key_id,
                "restored_from": restored_from,
                **VersionKeys.params(tenant_id, made, memory_id, version),
            },
        )

    def rollback(self, *, tenant_id: str, memory_id: str, user_id: str) -> RollBack:
        """Make the previous version current again, as a new version (history is kept).

        The previous version is the newest one before the current that still exists and is not being
        forgotten: a forgotten version (or one a restore dropped) is passed over, and a version being
        forgotten is never copied forward. The answer's `restored_from` names the version copied and,
        when any was passed over, `skipped` lists their numbers. `user_id` is the acting user: only
        the memory's author rolls it back.
        """
        validation.check_id("tenant", tenant_id)
        validation.check_memory_id("memory_id", memory_id)
        validation.check_id("user", user_id)
        with self.connections.transaction() as conn:
            ordering.lock_tenant_shared(conn, tenant_id)
            tenants.tenant_mode(conn, tenant_id)
            head = read_head(conn, tenant_id, memory_id, lock=True)
            require_author(head, user_id, "rolls it back")
            current = head["current_version"]
            earlier = conn.execute(
                "SELECT v.version, EXISTS (SELECT 1 FROM control.tombstones t WHERE t.tenant_id = v.tenant_id"
                " AND t.memory_id = v.memory_id AND t.version = v.version) FROM memory.memory_versions v"
                " WHERE v.tenant_id = %s AND v.memory_id = %s AND v.version < %s ORDER BY v.version DESC",
                (tenant_id, memory_id, current),
            ).fetchall()
            back_to = next((int(v) for v, hidden in earlier if not hidden), None)
            if back_to is None:
                raise ConflictError("memory_id", _nothing_to_roll_back(conn, tenant_id, memory_id, current, earlier))
            skipped = list(range(back_to + 1, current))
            previous = _version_row(conn, tenant_id, memory_id, back_to)
            text = self.sealing.open_text(conn, previous)
            version = next_version(conn, tenant_id, memory_id, current)
            supersede_and_point(conn, tenant_id, memory_id, version)
            self.insert_version_row(
                conn,
                tenant_id=tenant_id,
                memory_id=memory_id,
                version=version,
                key=self.keys.versions.new_key(conn, tenant_id, head["user_id"]),
                text=text,
                text_mac=bytes(previous["text_mac"]),
                shareable=previous["shareable"],
                category=previous["category"],
                confidence=previous["confidence"],
                original_query=self.sealing.open_query(conn, previous),
                restored_from=back_to,
            )
            tenants.bump(conn, tenant_id)
        rolled: RollBack = {
            "tenant_id": tenant_id,
            "memory_id": memory_id,
            "version": version,
            "text": text,
            "restored_from": back_to,
        }
        if skipped:
            rolled["skipped"] = skipped
        return rolled

    def history(self, *, tenant_id: str, memory_id: str) -> list[MemoryVersion]:
        """Every version of a memory, oldest first, decrypted."""
        validation.check_id("tenant", tenant_id)
        validation.check_memory_id("memory_id", memory_id)
        with self.connections.transaction() as conn:
            tenants.tenant_mode(conn, tenant_id)
            head = read_head(conn, tenant_id, memory_id)
            with conn.cursor(row_factory=dict_row) as cur:
                rows = cur.execute(
                    "SELECT * FROM memory.memory_versions v WHERE v.tenant_id = %s AND v.memory_id = %s"
                    " AND NOT EXISTS (SELECT 1 FROM control.tombstones t WHERE t.tenant_id = v.tenant_id"
                    " AND t.memory_id = v.memory_id AND t.version = v.version) ORDER BY version",
                    (tenant_id, memory_id),
                ).fetchall()
            return [
                {
                    "memory_id": memory_id,
                    "version": row["version"],
                    "text": self.sealing.open_text(conn, row),
                    "current": row["version"] == head["current_version"],
                    "user_id": head["user_id"],
                    "team_id": head["team_id"],
                    "category": row["category"],
                    "shareable": row["shareable"],
                    "confidence": row["confidence"],
                    "original_query": self.sealing.open_query(conn, row),
                    "restored_from": row["restored_from"],
                    "created_at": iso(row["created_at"]),
                    "superseded_at": iso(row["superseded_at"]),
                }
                for row in rows
            ]
