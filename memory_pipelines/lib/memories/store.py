"""The versioned, encrypted memory store on PostgreSQL (source of truth for every derived store).

A memory has a stable `memory_id` and an append-only list of versions; exactly one is current.
Text is sealed under its author's subject key with (tenant, memory_id, version) as associated data,
so no plaintext reaches the database, its WAL or its backups.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import (
    ConflictError,
    NotFoundError,
    PermissionDeniedError,
    ServiceError,
    ValidationError,
)
from memory_pipelines.lib.memories import consent, crypto, ordering
from memory_pipelines.lib.memories.bulk_write import BulkWriter, check_items
from memory_pipelines.lib.memories.keys import KeyDestroyedError, KeyStore

DEFAULT_CATEGORY = "general"
# Idle connections a store keeps for its threads; more threads open more, closed when given back.
POOL_IDLE = 8
# A connection idle this long gets one cheap ping before use: the server may have dropped it.
_IDLE_PING_SECONDS = 1.0
DEFAULT_CONFIDENCE = 1.0
EXPORT_BATCH = 500

# Query texts are constants; every value travels as a bound parameter.
# Hide at once: a forgotten subject's memories and tombstoned versions vanish from every read the
# moment a deletion request is accepted, before any store is touched.
_NOT_HIDDEN = (
    " AND s.forgotten_at IS NULL AND NOT EXISTS (SELECT 1 FROM control.tombstones t"
    " WHERE t.tenant_id = v.tenant_id AND t.memory_id = v.memory_id AND t.version = v.version)"
)
_NOT_TOMBSTONED = (
    " AND NOT EXISTS (SELECT 1 FROM control.tombstones t"
    " WHERE t.tenant_id = v.tenant_id AND t.memory_id = v.memory_id AND t.version = v.version)"
)
# Current versions with a given text MAC that no deletion hides (the no-op rule of writes).
_SAME_TEXT = (
    "SELECT v.memory_id FROM memory.memory_versions v"  # noqa: S608 - constant text
    " WHERE v.tenant_id = %s AND v.text_mac = %s AND v.superseded_at IS NULL" + _NOT_TOMBSTONED
)
_SAME_TEXTS = (
    "SELECT m.memory_id, m.current_version, m.user_id, m.team_id, v.text_mac"  # noqa: S608 - constant text
    " FROM memory.memory_versions v JOIN memory.memories m"
    " ON m.tenant_id = v.tenant_id AND m.memory_id = v.memory_id"
    " WHERE v.tenant_id = %s AND v.superseded_at IS NULL AND v.text_mac = ANY(%s)" + _NOT_TOMBSTONED
)
_SELECT_MEMORY = (
    "SELECT m.tenant_id, m.memory_id, m.user_id, m.team_id, m.memory_type, m.do_not_sell AS memory_dns,"
    " m.created_at AS memory_created_at, m.updated_at, m.current_version,"
    " v.version, v.shareable, v.category, v.confidence, v.text_ct, v.original_query_ct, v.key_id,"
    " v.restored_from, v.created_at, v.superseded_at, s.do_not_sell AS subject_dns, s.epoch AS subject_epoch"
    " FROM memory.memories m"
    " JOIN memory.subjects s ON s.tenant_id = m.tenant_id AND s.user_id = m.user_id"
    " JOIN memory.memory_versions v ON v.tenant_id = m.tenant_id AND v.memory_id = m.memory_id"
)
_VISIBLE_WHERE = {
    None: " AND m.user_id = %(user)s AND m.team_id IS NULL",
    "strict": " AND m.team_id = %(team)s AND m.user_id = %(user)s",
    "shared_pool": " AND m.team_id = %(team)s",
    "progressive": (
        " AND (m.team_id = %(team)s"
        " OR (m.team_id IS NULL AND v.shareable AND m.user_id IN ("
        "   SELECT tm.user_id FROM memory.team_members tm"
        "   WHERE tm.tenant_id = %(tenant)s AND tm.team_id = %(team)s)))"
    ),
}
_SELECT_VISIBLE = {
    mode: _SELECT_MEMORY
    + " AND v.version = m.current_version WHERE m.tenant_id = %(tenant)s"
    + _NOT_HIDDEN
    + where
    + " ORDER BY m.created_at, m.memory_id"
    for mode, where in _VISIBLE_WHERE.items()
}
# Recall: the rules of _SELECT_VISIBLE applied to candidates `c` only, so a recall never loads the
# user's whole visible set. Each LATERAL ... OFFSET 0 is one primary-key probe per candidate, in the
# candidates' order, whatever the planner guesses of a tenant's size: left to it, generic plans of
# the plain join scanned all of a tenant's memories. The scope rule (_VISIBLE_WHERE) goes in WHERE;
# _NOW is the rest of _SELECT_VISIBLE: the current version, and _NOT_HIDDEN's two tests.
_CANDIDATE_CHECK = (
    " CROSS JOIN LATERAL (SELECT m.user_id, m.team_id, m.current_version FROM memory.memories m"
    "  WHERE m.tenant_id = %(tenant)s AND m.memory_id = c.memory_id OFFSET 0) m"
    " CROSS JOIN LATERAL (SELECT v.shareable, v.category, EXISTS (SELECT 1 FROM control.tombstones t"
    "  WHERE t.tenant_id = v.tenant_id AND t.memory_id = v.memory_id AND t.version = v.version) AS tombstoned"
    "  FROM memory.memory_versions v WHERE v.tenant_id = %(tenant)s AND v.memory_id = c.memory_id"
    "  AND v.version = c.version OFFSET 0) v"
    " CROSS JOIN LATERAL (SELECT s.epoch, s.forgotten_at FROM memory.subjects s WHERE s.tenant_id = %(tenant)s"
    "  AND s.user_id = m.user_id OFFSET 0) s"
    " WHERE TRUE"
)
_NOW = "m.current_version = c.version AND NOT v.tombstoned AND s.forgotten_at IS NULL"


def visible_candidates_sql(source: str, scope: str | None, *, in_scope: bool = False) -> str:
    """SELECT of the visible current versions among `source`, a constant FROM item aliased `c` with
    columns memory_id, version (and any more, passed through; its order is kept), plus each one's
    user_id, team_id, category and subject_epoch. `scope` is what `MemoryStore.check_scope`
    returned; the query binds %(tenant)s, %(user)s and %(team)s. With `in_scope`, every candidate
    the scope's rule admits, with a boolean `visible` (current, not hidden) for each."""
    columns = "c.*, m.user_id, m.team_id, v.category, s.epoch AS subject_epoch"
    where = _VISIBLE_WHERE[scope]
    if in_scope:
        columns += ", (" + _NOW + ") AS visible"
    else:
        where += " AND " + _NOW
    return "SELECT " + columns + " FROM " + source + _CANDIDATE_CHECK + where  # noqa: S608 - constant text


# The memories a scope's rule can admit, from memories alone (progressive's shareable flag is per
# version: checked with the rest afterwards). Counted with a bound: cheap for any scope.
_SCOPE_MEMORIES = {
    None: " AND m.user_id = %(user)s AND m.team_id IS NULL",
    "strict": " AND m.team_id = %(team)s AND m.user_id = %(user)s",
    "shared_pool": " AND m.team_id = %(team)s",
    "progressive": (
        " AND (m.team_id = %(team)s OR (m.team_id IS NULL AND m.user_id IN (SELECT tm.user_id"
        " FROM memory.team_members tm WHERE tm.tenant_id = %(tenant)s AND tm.team_id = %(team)s)))"
    ),
}
_COUNT_SCOPE = {
    scope: "SELECT count(*) FROM (SELECT 1 FROM memory.memories m WHERE m.tenant_id = %(tenant)s"  # noqa: S608
    + where
    + " LIMIT %(cap)s) x"
    for scope, where in _SCOPE_MEMORIES.items()
}
_SCOPE_VERSIONS = {
    scope: "SELECT v.memory_id, v.version FROM memory.memories m JOIN memory.memory_versions v"  # noqa: S608
    " ON v.tenant_id = m.tenant_id AND v.memory_id = m.memory_id WHERE m.tenant_id = %(tenant)s" + where
    for scope, where in _SCOPE_MEMORIES.items()
}
_CANDIDATES = "unnest(%(m)s::text[], %(v)s::int[]) AS c(memory_id, version)"
_CONFIRM_VISIBLE = {
    (scope, in_scope): visible_candidates_sql(_CANDIDATES, scope, in_scope=in_scope)
    for scope in _VISIBLE_WHERE
    for in_scope in (False, True)
}
_CURRENT_BASE = (
    "SELECT m.memory_id, v.version, m.user_id, m.team_id, m.memory_type, v.shareable, v.category, v.confidence,"
    " (m.do_not_sell OR s.do_not_sell) AS do_not_sell, s.epoch, m.created_at, m.updated_at, v.created_at"
    " FROM memory.memories m"
    " JOIN memory.subjects s ON s.tenant_id = m.tenant_id AND s.user_id = m.user_id"
    " JOIN memory.memory_versions v ON v.tenant_id = m.tenant_id AND v.memory_id = m.memory_id"
    " AND v.version = m.current_version"
    " WHERE m.tenant_id = %s"
)
_SELECT_CURRENT = _CURRENT_BASE + _NOT_HIDDEN + " ORDER BY m.memory_id"
_SELECT_QUERIES = (
    "SELECT v.tenant_id, v.memory_id, v.version, v.original_query_ct, v.key_id"  # noqa: S608
    " FROM memory.memories m JOIN memory.memory_versions v ON v.tenant_id = m.tenant_id"
    " AND v.memory_id = m.memory_id AND v.version = m.current_version"
    " JOIN memory.subjects s ON s.tenant_id = m.tenant_id AND s.user_id = m.user_id"
    " WHERE m.tenant_id = %s AND m.memory_id = ANY(%s)" + _NOT_HIDDEN
)
_SELECT_CURRENT_OF_OWNERS = (
    _CURRENT_BASE + _NOT_HIDDEN + " AND (m.user_id = ANY(%s) OR m.team_id = ANY(%s)) ORDER BY m.memory_id"
)
_SELECT_EXPORT = (
    _SELECT_MEMORY
    + " WHERE m.tenant_id = %s AND m.user_id = %s"
    + _NOT_HIDDEN
    + " ORDER BY m.created_at, m.memory_id, v.version"
)

_SELECT_TEXTS = (
    "SELECT v.tenant_id, v.memory_id, v.version, v.text_ct, v.key_id FROM memory.memory_versions v"
    " JOIN unnest(%s::text[], %s::int[]) AS want(memory_id, version)"
    " ON v.memory_id = want.memory_id AND v.version = want.version WHERE v.tenant_id = %s"
)
_SELECT_VISIBLE_TEXTS = (
    "SELECT v.tenant_id, v.memory_id, v.version, v.text_ct, v.key_id FROM memory.memory_versions v"  # noqa: S608
    " JOIN unnest(%s::text[], %s::int[]) AS want(memory_id, version)"
    " ON v.memory_id = want.memory_id AND v.version = want.version"
    " JOIN memory.memories m ON m.tenant_id = v.tenant_id AND m.memory_id = v.memory_id"
    " JOIN memory.subjects s ON s.tenant_id = m.tenant_id AND s.user_id = m.user_id"
    " WHERE v.tenant_id = %s" + _NOT_HIDDEN
)


@dataclass(frozen=True)
class WriteResult:
    tenant_id: str
    memory_id: str
    version: int
    user_id: str
    team_id: str | None
    changed: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "tenant_id": self.tenant_id,
            "memory_id": self.memory_id,
            "version": self.version,
            "user_id": self.user_id,
            "team_id": self.team_id,
            "changed": self.changed,
        }


@dataclass(frozen=True)
class CurrentVersion:
    """Metadata of one current memory version (no text): what derived stores are built from."""

    memory_id: str
    version: int
    user_id: str
    team_id: str | None
    memory_type: str
    shareable: bool
    category: str
    confidence: float
    do_not_sell: bool
    epoch: int
    created_at: datetime
    updated_at: datetime
    version_created_at: datetime

    @property
    def source(self) -> tuple[str, int]:
        return (self.memory_id, self.version)

    @property
    def record_id(self) -> str:
        return f"{self.memory_id}:{self.version}"


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _text_aad(tenant_id: str, memory_id: str, version: int) -> bytes:
    return crypto.aad("memory-text", tenant_id, memory_id, version)


def _query_aad(tenant_id: str, memory_id: str, version: int) -> bytes:
    return crypto.aad("original-query", tenant_id, memory_id, version)


def _key_of(row: dict[str, Any], keys: dict[str, bytes]) -> bytes:
    """The subject key a row names, from keys looked up (`KeyStore.keys_by_id`) in the same read."""
    if row["key_id"] not in keys:
        raise KeyDestroyedError("key_id", f"subject key {row['key_id']!r} does not exist")
    return keys[row["key_id"]]


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


class MemoryStore:
    """API over the memory and key-store schemas. Methods take keyword arguments only."""

    def __init__(self, conninfo: str, keys: KeyStore) -> None:
        self.conninfo = conninfo
        self.keys = keys
        self._idle: list[tuple[psycopg.Connection, float]] = []  # (connection, when it was given back)
        self._idle_lock = threading.Lock()
        self._local = threading.local()

    # -- connections ---------------------------------------------------------------------

    def _connect(self) -> psycopg.Connection:
        try:
            conn = psycopg.connect(self.conninfo, autocommit=True)
            # Per-tenant partitions (lib/partitions.py): a custom plan prunes to one tenant's partition
            # at plan time, while a generic plan (psycopg's prepared statements after 5 runs, and the
            # foreign keys' and plpgsql's cached plans, which psycopg's prepare_threshold never reaches)
            # locks every tenant's partition at executor start and so waits for any tenant's compaction.
            conn.execute("SET plan_cache_mode = force_custom_plan")
            return conn
        except psycopg.OperationalError as exc:
            raise ServiceError("postgres", f"cannot connect to the memory database: {exc}") from exc

    def _take(self) -> psycopg.Connection:
        """An idle connection that still answers, or a new one."""
        while True:
            with self._idle_lock:
                if not self._idle:
                    break
                conn, since = self._idle.pop()
            if conn.closed or conn.broken:
                continue
            if time.monotonic() - since < _IDLE_PING_SECONDS:
                return conn
            try:
                conn.execute("SELECT 1")
                return conn
            except psycopg.Error:
                conn.close()
        return self._connect()

    def _give_back(self, conn: psycopg.Connection) -> None:
        if conn.closed or conn.broken or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.close()
            return
        with self._idle_lock:
            if len(self._idle) < POOL_IDLE:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Connection]:
        """One transaction on a connection of the store's pool; threads work in parallel, each on its own.

        Nested in the same thread (a transaction opened while one is open), it joins the open one as
        a savepoint: a second connection could wait on locks the first holds."""
        held: psycopg.Connection | None = getattr(self._local, "conn", None)
        if held is not None:
            with held.transaction():
                yield held
            return
        conn = self._take()
        self._local.conn = conn
        try:
            with conn.transaction():
                yield conn
        except psycopg.OperationalError as exc:
            conn.close()
            self.close()  # a server restart or terminated backends: the idle ones are gone too
            raise ServiceError("postgres", f"lost the connection to the memory database: {exc}") from exc
        finally:
            self._local.conn = None
            self._give_back(conn)

    def close(self) -> None:
        """Close the idle connections; the store stays usable (it opens new ones when asked)."""
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()

    # -- tenants, subjects, teams ----------------------------------------------------------

    @staticmethod
    def _bump(conn: psycopg.Connection, tenant_id: str) -> None:
        conn.execute(
            "UPDATE memory.tenants SET change_seq = change_seq + 1, updated_at = now() WHERE tenant_id = %s",
            (tenant_id,),
        )

    @staticmethod
    def _ensure_tenant(conn: psycopg.Connection, tenant_id: str) -> None:
        created = conn.execute(
            "INSERT INTO memory.tenants (tenant_id) VALUES (%s) ON CONFLICT (tenant_id) DO NOTHING RETURNING 1",
            (tenant_id,),
        ).fetchone()
        if created is not None:
            validation.check_new_tenant(tenant_id)  # raising rolls the insert back
        MemoryStore._tenant_mode(conn, tenant_id)  # refuses a deleted tenant

    @staticmethod
    def _ensure_subject(conn: psycopg.Connection, tenant_id: str, user_id: str) -> None:
        row = conn.execute(
            "INSERT INTO memory.subjects (tenant_id, user_id) VALUES (%s, %s)"
            " ON CONFLICT (tenant_id, user_id) DO UPDATE SET user_id = EXCLUDED.user_id RETURNING forgotten_at",
            (tenant_id, user_id),
        ).fetchone()
        if row is not None and row[0] is not None:
            raise ConflictError(
                "user", f"subject {user_id!r} is being forgotten; writes resume when that job completes"
            )

    @staticmethod
    def _tenant_mode(conn: psycopg.Connection, tenant_id: str) -> str:
        row = conn.execute(
            "SELECT sharing_mode, deleted_at, restoring_since FROM memory.tenants WHERE tenant_id = %s", (tenant_id,)
        ).fetchone()
        if row is None:
            raise NotFoundError("tenant", f"unknown tenant {tenant_id!r}")
        if row[1] is not None:
            raise NotFoundError("tenant", f"tenant {tenant_id!r} was deleted")
        if row[2] is not None:
            # The restore gate: nothing is read or written until the journal replay is verified.
            raise ConflictError(
                "tenant", f"tenant {tenant_id!r} is being restored; it reopens once the restore is verified"
            )
        return str(row[0])

    def create_tenant(self, *, tenant_id: str, sharing_mode: str = "strict") -> dict[str, Any]:
        """Create a tenant (idempotent); an existing tenant keeps its data and gets `sharing_mode`."""
        validation.check_id("tenant", tenant_id)
        validation.check_sharing_mode(sharing_mode)
        with self.transaction() as conn:
            self._ensure_tenant(conn, tenant_id)
            self._set_mode(conn, tenant_id, sharing_mode)
            self._bump(conn, tenant_id)
        return {"tenant_id": tenant_id, "sharing_mode": sharing_mode}

    def set_sharing_mode(self, *, tenant_id: str, sharing_mode: str) -> dict[str, Any]:
        validation.check_id("tenant", tenant_id)
        validation.check_sharing_mode(sharing_mode)
        with self.transaction() as conn:
            self._tenant_mode(conn, tenant_id)
            self._set_mode(conn, tenant_id, sharing_mode)
            self._bump(conn, tenant_id)
        return {"tenant_id": tenant_id, "sharing_mode": sharing_mode}

    @staticmethod
    def _set_mode(conn: psycopg.Connection, tenant_id: str, sharing_mode: str) -> None:
        # A change is journalled with it, so no restore of an older backup undoes it (lib/consent.py).
        row = conn.execute(
            "SELECT sharing_mode FROM memory.tenants WHERE tenant_id = %s FOR UPDATE", (tenant_id,)
        ).fetchone()
        conn.execute(
            "UPDATE memory.tenants SET sharing_mode = %s, updated_at = now() WHERE tenant_id = %s",
            (sharing_mode, tenant_id),
        )
        if row is not None and row[0] != sharing_mode:
            consent.record(conn, tenant_id, "SHARING_MODE", mode=sharing_mode)

    def tenants(self) -> list[dict[str, Any]]:
        """Every tenant with its sharing mode and counts (no text)."""
        with self.transaction() as conn:
            rows = conn.execute(
                """
                SELECT t.tenant_id, t.sharing_mode, t.change_seq, t.created_at,
                       (SELECT count(*) FROM memory.memories m WHERE m.tenant_id = t.tenant_id) AS memories,
                       (SELECT count(*) FROM memory.subjects s WHERE s.tenant_id = t.tenant_id) AS subjects,
                       (SELECT count(*) FROM memory.teams tm WHERE tm.tenant_id = t.tenant_id) AS teams
                FROM memory.tenants t WHERE t.deleted_at IS NULL ORDER BY t.tenant_id
                """
            ).fetchall()
        return [
            {
                "tenant_id": r[0],
                "sharing_mode": r[1],
                "change_seq": r[2],
                "created_at": _iso(r[3]),
                "memories": r[4],
                "subjects": r[5],
                "teams": r[6],
            }
            for r in rows
        ]

    def tenant_watermarks(self) -> dict[str, int]:
        """tenant -> change sequence; grows with every write, so a sensor can tell what changed.

        Tenants behind the restore gate are left out: they show again, with a new sequence, once
        the restore reopens them.
        """
        with self.transaction() as conn:
            return {
                r[0]: int(r[1])
                for r in conn.execute(
                    "SELECT tenant_id, change_seq FROM memory.tenants WHERE deleted_at IS NULL"
                    " AND restoring_since IS NULL"
                )
            }

    def add_team_member(self, *, tenant_id: str, team_id: str, user_id: str) -> dict[str, Any]:
        """Add a user to a team, creating tenant and team if needed (idempotent)."""
        validation.check_id("tenant", tenant_id)
        validation.check_id("team", team_id)
        validation.check_id("user", user_id)
        with self.transaction() as conn:
            self._ensure_tenant(conn, tenant_id)
            self._ensure_subject(conn, tenant_id, user_id)
            conn.execute(
                "INSERT INTO memory.teams (tenant_id, team_id) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                (tenant_id, team_id),
            )
            added = conn.execute(
                "INSERT INTO memory.team_members (tenant_id, team_id, user_id) VALUES (%s, %s, %s) "
                "ON CONFLICT DO NOTHING RETURNING user_id",
                (tenant_id, team_id, user_id),
            ).fetchone()
            if added is not None:
                consent.record(conn, tenant_id, "TEAM_MEMBER_ADDED", team_id=team_id, subject_id=user_id)
            self._bump(conn, tenant_id)
            members = self._members(conn, tenant_id, team_id)
        return {
            "tenant_id": tenant_id,
            "team_id": team_id,
            "user_id": user_id,
            "added": added is not None,
            "members": members,
        }

    def remove_team_member(self, *, tenant_id: str, team_id: str, user_id: str) -> dict[str, Any]:
        """Remove a user from a team; the memories they wrote for it stay with the team."""
        validation.check_id("tenant", tenant_id)
        validation.check_id("team", team_id)
        validation.check_id("user", user_id)
        with self.transaction() as conn:
            self._tenant_mode(conn, tenant_id)
            self._require_team(conn, tenant_id, team_id)
            removed = conn.execute(
                "DELETE FROM memory.team_members WHERE tenant_id = %s AND team_id = %s AND user_id = %s "
                "RETURNING user_id",
                (tenant_id, team_id, user_id),
            ).fetchone()
            if removed is None:
                raise NotFoundError("user", f"user {user_id!r} is not a member of team {team_id!r}")
            consent.record(conn, tenant_id, "TEAM_MEMBER_REMOVED", team_id=team_id, subject_id=user_id)
            self._bump(conn, tenant_id)
            members = self._members(conn, tenant_id, team_id)
        return {"tenant_id": tenant_id, "team_id": team_id, "user_id": user_id, "removed": True, "members": members}

    @staticmethod
    def _members(conn: psycopg.Connection, tenant_id: str, team_id: str) -> list[str]:
        return [
            r[0]
            for r in conn.execute(
                "SELECT user_id FROM memory.team_members WHERE tenant_id = %s AND team_id = %s ORDER BY user_id",
                (tenant_id, team_id),
            )
        ]

    @staticmethod
    def _require_team(conn: psycopg.Connection, tenant_id: str, team_id: str) -> None:
        if (
            conn.execute(
                "SELECT 1 FROM memory.teams WHERE tenant_id = %s AND team_id = %s", (tenant_id, team_id)
            ).fetchone()
            is None
        ):
            raise NotFoundError("team", f"no team {team_id!r} in tenant {tenant_id!r}")

    def _require_member(self, conn: psycopg.Connection, tenant_id: str, team_id: str, user_id: str) -> None:
        self._require_team(conn, tenant_id, team_id)
        # FOR SHARE: a concurrent remove-member waits until this write or read is done.
        if (
            conn.execute(
                "SELECT 1 FROM memory.team_members WHERE tenant_id = %s AND team_id = %s AND user_id = %s FOR SHARE",
                (tenant_id, team_id, user_id),
            ).fetchone()
            is None
        ):
            raise PermissionDeniedError("team", f"user {user_id!r} is not a member of team {team_id!r}")

    # -- writes -------------------------------------------------------------------------------

    def write(
        self,
        *,
        tenant_id: str,
        user_id: str,
        text: str,
        memory_id: str | None = None,
        team_id: str | None = None,
        shareable: bool | None = None,
        category: str | None = None,
        confidence: float | None = None,
        original_query: str | None = None,
        do_not_sell: bool | None = None,
    ) -> WriteResult:
        """Write a memory or a new version of one. Unspecified fields keep the current version's values.

        Identical text and fields to the current version (of `memory_id`, or of any of the
        subject's memories in the same team scope when no id is given) is a no-op.
        """
        validation.check_id("tenant", tenant_id)
        validation.check_id("user", user_id)
        validation.check_text("text", text)
        if memory_id is not None:
            validation.check_memory_id("memory_id", memory_id)
        validation.check_optional_id("team", team_id)
        if category is not None:
            validation.check_category(category)
        if confidence is not None:
            confidence = validation.check_confidence(confidence)
        if original_query is not None:
            validation.check_text("original_query", original_query)
        validation.check_optional_bool("shareable", shareable)
        validation.check_optional_bool("do_not_sell", do_not_sell)

        with self.transaction() as conn:
            # Ordered against deletion acceptance and the restore gate (see lib/ordering.py); then
            # serialised per subject, so two identical concurrent writes make one memory.
            ordering.lock_tenant_shared(conn, tenant_id)
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"{tenant_id}\x1f{user_id}",))
            head = None
            if memory_id is not None:
                head = self._head_for_write(conn, tenant_id, user_id, memory_id, team_id)
                team_id = head["team_id"]
            else:
                self._ensure_tenant(conn, tenant_id)
            self._ensure_subject(conn, tenant_id, user_id)
            if team_id is not None:
                self._require_member(conn, tenant_id, team_id, user_id)
            key_id, key = self.keys.subject_key(conn, tenant_id, user_id)
            text_mac = crypto.mac(crypto.derive_key(key, b"memory-text-mac"), text.encode("utf-8"))
            if head is None:
                head = self._head_by_mac(conn, tenant_id, user_id, team_id, text_mac)
            if head is None:
                result = self._insert_new(
                    conn,
                    tenant_id=tenant_id,
                    user_id=user_id,
                    team_id=team_id,
                    key_id=key_id,
                    key=key,
                    text=text,
                    text_mac=text_mac,
                    shareable=bool(shareable),
                    category=category or DEFAULT_CATEGORY,
                    confidence=DEFAULT_CONFIDENCE if confidence is None else confidence,
                    original_query=original_query,
                    do_not_sell=bool(do_not_sell),
                )
            else:
                result = self._insert_version(
                    conn,
                    head=head,
                    key_id=key_id,
                    key=key,
                    text=text,
                    text_mac=text_mac,
                    shareable=shareable,
                    category=category,
                    confidence=confidence,
                    original_query=original_query,
                    do_not_sell=do_not_sell,
                )
            if result.changed:
                self._bump(conn, tenant_id)
            return result

    def write_many(self, *, tenant_id: str, items: list[dict[str, Any]]) -> list[WriteResult]:
        """Bulk-write new memories (no `memory_id`); results in item order.

        Each item has `user_id`, `text` and optionally `team_id`, `shareable`, `category`,
        `confidence`, `original_query`, `do_not_sell`. The no-op rule holds as for `write`: an
        item identical to a current memory of its author in the same scope returns that memory.
        Every item is checked before anything is written; the write commits in chunks (see
        lib/bulk_write.py), and one stopped part way raises `PartialWriteError` naming what landed.
        """
        validation.check_id("tenant", tenant_id)
        return BulkWriter(self, tenant_id).write(check_items(items))

    def _head_for_write(
        self, conn: psycopg.Connection, tenant_id: str, user_id: str, memory_id: str, team_id: str | None
    ) -> dict[str, Any]:
        self._tenant_mode(conn, tenant_id)
        head = self._head(conn, tenant_id, memory_id, lock=True)
        if head["user_id"] != user_id:
            raise PermissionDeniedError(
                "memory_id", f"memory {memory_id} belongs to another user; only its author writes new versions"
            )
        if team_id is not None and head["team_id"] != team_id:
            where = "is personal" if head["team_id"] is None else f"belongs to team {head['team_id']!r}"
            raise ValidationError("team", f"memory {memory_id} {where}; a new version cannot move it")
        return head

    @staticmethod
    def _head(conn: psycopg.Connection, tenant_id: str, memory_id: str, *, lock: bool = False) -> dict[str, Any]:
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

    def _head_by_mac(
        self, conn: psycopg.Connection, tenant_id: str, user_id: str, team_id: str | None, text_mac: bytes
    ) -> dict[str, Any] | None:
        # Two indexed lookups rather than one join: on a young table without statistics the
        # planner picked a nested loop over every memory of the tenant (O(n) per write).
        # A memory being forgotten is never the same memory (see write_many).
        candidates = conn.execute(_SAME_TEXT, (tenant_id, text_mac)).fetchall()
        for (memory_id,) in candidates:
            try:
                head = self._head(conn, tenant_id, memory_id, lock=True)
            except NotFoundError:
                continue  # hidden or gone since the lookup
            if head["user_id"] == user_id and head["team_id"] == team_id:
                return head
        return None

    def _insert_new(
        self,
        conn: psycopg.Connection,
        *,
        tenant_id: str,
        user_id: str,
        team_id: str | None,
        key_id: str,
        key: bytes,
        text: str,
        text_mac: bytes,
        shareable: bool,
        category: str,
        confidence: float,
        original_query: str | None,
        do_not_sell: bool,
    ) -> WriteResult:
        memory_id = validation.new_memory_id()
        conn.execute(
            "INSERT INTO memory.memories (tenant_id, memory_id, user_id, team_id, memory_type, current_version,"
            " do_not_sell) VALUES (%s, %s, %s, %s, %s, 1, %s)",
            (tenant_id, memory_id, user_id, team_id, "personal" if team_id is None else "team_shared", do_not_sell),
        )
        self._insert_version_row(
            conn,
            tenant_id=tenant_id,
            memory_id=memory_id,
            version=1,
            key_id=key_id,
            key=key,
            text=text,
            text_mac=text_mac,
            shareable=shareable,
            category=category,
            confidence=confidence,
            original_query_ct=self._seal_query(key, tenant_id, memory_id, 1, original_query),
            restored_from=None,
        )
        return WriteResult(tenant_id, memory_id, 1, user_id, team_id, True)

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

    def _insert_version(
        self,
        conn: psycopg.Connection,
        *,
        head: dict[str, Any],
        key_id: str,
        key: bytes,
        text: str,
        text_mac: bytes,
        shareable: bool | None,
        category: str | None,
        confidence: float | None,
        original_query: str | None,
        do_not_sell: bool | None,
    ) -> WriteResult:
        tenant_id, memory_id = head["tenant_id"], head["memory_id"]
        new_fields: dict[str, Any] = {
            "shareable": head["shareable"] if shareable is None else shareable,
            "category": head["category"] if category is None else category,
            "confidence": head["confidence"] if confidence is None else confidence,
        }
        flags_changed = do_not_sell is not None and do_not_sell != head["do_not_sell"]
        if flags_changed:
            conn.execute(
                "UPDATE memory.memories SET do_not_sell = %s, updated_at = now() "
                "WHERE tenant_id = %s AND memory_id = %s",
                (do_not_sell, tenant_id, memory_id),
            )
            consent.record(conn, tenant_id, "MEMORY_DO_NOT_SELL", memory_id=memory_id, flag=do_not_sell)
        same_query = original_query is None or original_query == self._open_query(
            conn, {**head, "version": head["current_version"]}
        )
        same = (
            bytes(head["text_mac"]) == text_mac
            and same_query
            and all(new_fields[name] == head[name] for name in new_fields)
        )
        if same:
            return WriteResult(
                tenant_id, memory_id, head["current_version"], head["user_id"], head["team_id"], flags_changed
            )
        version = self._next_version(conn, tenant_id, memory_id, head["current_version"])
        query_ct = (
            self._seal_query(key, tenant_id, memory_id, version, original_query)
            if original_query is not None
            else self._reseal_query(conn, head, key, version)
        )
        self._supersede_and_point(conn, tenant_id, memory_id, version)
        self._insert_version_row(
            conn,
            tenant_id=tenant_id,
            memory_id=memory_id,
            version=version,
            key_id=key_id,
            key=key,
            text=text,
            text_mac=text_mac,
            original_query_ct=query_ct,
            restored_from=None,
            **new_fields,
        )
        return WriteResult(tenant_id, memory_id, version, head["user_id"], head["team_id"], True)

    def _reseal_query(self, conn: psycopg.Connection, row: dict[str, Any], key: bytes, version: int) -> bytes | None:
        query = self._open_query(conn, {**row, "version": row.get("version", row.get("current_version"))})
        return self._seal_query(key, row["tenant_id"], row["memory_id"], version, query)

    @staticmethod
    def _supersede_and_point(conn: psycopg.Connection, tenant_id: str, memory_id: str, version: int) -> None:
        conn.execute(
            "UPDATE memory.memory_versions SET superseded_at = now() "
            "WHERE tenant_id = %s AND memory_id = %s AND superseded_at IS NULL",
            (tenant_id, memory_id),
        )
        conn.execute(
            "UPDATE memory.memories SET current_version = %s, updated_at = now() "
            "WHERE tenant_id = %s AND memory_id = %s",
            (version, tenant_id, memory_id),
        )

    @staticmethod
    def _insert_version_row(
        conn: psycopg.Connection,
        *,
        tenant_id: str,
        memory_id: str,
        version: int,
        key_id: str,
        key: bytes,
        text: str,
        text_mac: bytes,
        shareable: bool,
        category: str,
        confidence: float,
        original_query_ct: bytes | None,
        restored_from: int | None,
    ) -> None:
        text_ct = crypto.seal(key, text.encode("utf-8"), _text_aad(tenant_id, memory_id, version))
        conn.execute(
            "INSERT INTO memory.memory_versions (tenant_id, memory_id, version, shareable, category, confidence,"
            " text_ct, text_mac, original_query_ct, key_id, restored_from)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                tenant_id,
                memory_id,
                version,
                shareable,
                category,
                confidence,
                text_ct,
                text_mac,
                original_query_ct,
                key_id,
                restored_from,
            ),
        )

    def rollback(self, *, tenant_id: str, memory_id: str, user_id: str) -> dict[str, Any]:
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
        with self.transaction() as conn:
            ordering.lock_tenant_shared(conn, tenant_id)
            self._tenant_mode(conn, tenant_id)
            head = self._head(conn, tenant_id, memory_id, lock=True)
            self._require_author(head, user_id, "rolls it back")
            current = head["current_version"]
            earlier = conn.execute(
                "SELECT v.version, EXISTS (SELECT 1 FROM control.tombstones t WHERE t.tenant_id = v.tenant_id"
                " AND t.memory_id = v.memory_id AND t.version = v.version) FROM memory.memory_versions v"
                " WHERE v.tenant_id = %s AND v.memory_id = %s AND v.version < %s ORDER BY v.version DESC",
                (tenant_id, memory_id, current),
            ).fetchall()
            back_to = next((int(v) for v, hidden in earlier if not hidden), None)
            if back_to is None:
                raise ConflictError(
                    "memory_id", self._nothing_to_roll_back(conn, tenant_id, memory_id, current, earlier)
                )
            skipped = list(range(back_to + 1, current))
            previous = self._version_row(conn, tenant_id, memory_id, back_to)
            text = self._open_text(conn, previous)
            key_id, key = self.keys.subject_key(conn, tenant_id, head["user_id"])
            version = self._next_version(conn, tenant_id, memory_id, current)
            query_ct = self._reseal_query(conn, previous, key, version)
            self._supersede_and_point(conn, tenant_id, memory_id, version)
            self._insert_version_row(
                conn,
                tenant_id=tenant_id,
                memory_id=memory_id,
                version=version,
                key_id=key_id,
                key=key,
                text=text,
                text_mac=bytes(previous["text_mac"]),
                shareable=previous["shareable"],
                category=previous["category"],
                confidence=previous["confidence"],
                original_query_ct=query_ct,
                restored_from=back_to,
            )
            self._bump(conn, tenant_id)
        return {
            "tenant_id": tenant_id,
            "memory_id": memory_id,
            "version": version,
            "text": text,
            "restored_from": back_to,
            **({"skipped": skipped} if skipped else {}),
        }

    @staticmethod
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

    @staticmethod
    def _next_version(conn: psycopg.Connection, tenant_id: str, memory_id: str, current: int) -> int:
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

    @staticmethod
    def _require_author(head: dict[str, Any], user_id: str, action: str) -> None:
        if head["user_id"] != user_id:
            raise PermissionDeniedError(
                "user", f"memory {head['memory_id']} belongs to another user; only its author {action}"
            )

    @staticmethod
    def _version_row(conn: psycopg.Connection, tenant_id: str, memory_id: str, version: int) -> dict[str, Any]:
        with conn.cursor(row_factory=dict_row) as cur:
            row = cur.execute(
                "SELECT * FROM memory.memory_versions WHERE tenant_id = %s AND memory_id = %s AND version = %s",
                (tenant_id, memory_id, version),
            ).fetchone()
        if row is None:
            raise NotFoundError("version", f"memory {memory_id} has no version {version}")
        return row

    def _open_text(self, conn: psycopg.Connection, row: dict[str, Any]) -> str:
        key = self.keys.key_by_id(conn, row["tenant_id"], row["key_id"])
        aad = _text_aad(row["tenant_id"], row["memory_id"], row["version"])
        return crypto.open_sealed(key, bytes(row["text_ct"]), aad).decode("utf-8")

    def set_do_not_sell(
        self,
        *,
        tenant_id: str,
        user_id: str,
        value: bool = True,
        memory_id: str | None = None,
        subject: str | None = None,
    ) -> dict[str, Any]:
        """CCPA opt-out for one memory or for every memory of a subject (present and future).

        `user_id` is the acting user: a memory's author flags it, a subject flags themselves.
        """
        validation.check_id("tenant", tenant_id)
        validation.check_id("user", user_id)
        validation.check_bool("value", value)
        if (memory_id is None) == (subject is None):
            raise ValidationError("memory_id", "give exactly one of memory_id or subject")
        if subject is not None:
            validation.check_id("subject", subject)
            if subject != user_id:
                raise PermissionDeniedError("subject", "only the subject sets their own do-not-sell flag")
        with self.transaction() as conn:
            self._tenant_mode(conn, tenant_id)
            if memory_id is not None:
                validation.check_memory_id("memory_id", memory_id)
                head = self._head(conn, tenant_id, memory_id, lock=True)
                self._require_author(head, user_id, "sets its do-not-sell flag")
                conn.execute(
                    "UPDATE memory.memories SET do_not_sell = %s, updated_at = now() "
                    "WHERE tenant_id = %s AND memory_id = %s",
                    (value, tenant_id, memory_id),
                )
                consent.record(conn, tenant_id, "MEMORY_DO_NOT_SELL", memory_id=memory_id, flag=value)
                result: dict[str, Any] = {"tenant_id": tenant_id, "memory_id": memory_id, "do_not_sell": value}
            else:
                assert subject is not None
                self._ensure_subject(conn, tenant_id, subject)
                conn.execute(
                    "UPDATE memory.subjects SET do_not_sell = %s WHERE tenant_id = %s AND user_id = %s",
                    (value, tenant_id, subject),
                )
                consent.record(conn, tenant_id, "SUBJECT_DO_NOT_SELL", subject_id=subject, flag=value)
                result = {"tenant_id": tenant_id, "subject": subject, "do_not_sell": value}
            self._bump(conn, tenant_id)
        return result

    # -- reads ---------------------------------------------------------------------------------

    def history(self, *, tenant_id: str, memory_id: str) -> list[dict[str, Any]]:
        """Every version of a memory, oldest first, decrypted."""
        validation.check_id("tenant", tenant_id)
        validation.check_memory_id("memory_id", memory_id)
        with self.transaction() as conn:
            self._tenant_mode(conn, tenant_id)
            head = self._head(conn, tenant_id, memory_id)
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
                    "text": self._open_text(conn, row),
                    "current": row["version"] == head["current_version"],
                    "user_id": head["user_id"],
                    "team_id": head["team_id"],
                    "category": row["category"],
                    "shareable": row["shareable"],
                    "confidence": row["confidence"],
                    "original_query": self._open_query(conn, row),
                    "restored_from": row["restored_from"],
                    "created_at": _iso(row["created_at"]),
                    "superseded_at": _iso(row["superseded_at"]),
                }
                for row in rows
            ]

    def list_visible(self, *, tenant_id: str, user_id: str, team_id: str | None = None) -> list[dict[str, Any]]:
        """Current memories a user sees: their personal view, or a team view by the tenant's sharing mode.

        strict: the user's own memories in the team (team_id + user_id).
        shared_pool: every team memory, each with its creator.
        progressive: the team pool (every team memory) plus personal memories that a current
        member marked shareable.
        """
        validation.check_id("tenant", tenant_id)
        validation.check_id("user", user_id)
        validation.check_optional_id("team", team_id)
        with self.transaction() as conn:
            mode = self._tenant_mode(conn, tenant_id)
            rows = self._visible_rows(conn, tenant_id, user_id, team_id, mode)
            return [self._current_view(conn, row) for row in rows]

    def _visible_rows(
        self, conn: psycopg.Connection, tenant_id: str, user_id: str, team_id: str | None, mode: str
    ) -> list[dict[str, Any]]:
        params = {"tenant": tenant_id, "user": user_id, "team": team_id}
        if team_id is not None:
            self._require_member(conn, tenant_id, team_id, user_id)
        query = _SELECT_VISIBLE[None if team_id is None else mode]
        with conn.cursor(row_factory=dict_row) as cur:
            return cur.execute(query, params).fetchall()

    def visible_scope(self, *, tenant_id: str, user_id: str, team_id: str | None = None) -> dict[str, Any]:
        """What a user may see, without decrypting: sharing mode, team members, visible (memory_id, version)."""
        validation.check_id("tenant", tenant_id)
        validation.check_id("user", user_id)
        validation.check_optional_id("team", team_id)
        with self.transaction() as conn:
            mode = self._tenant_mode(conn, tenant_id)
            rows = self._visible_rows(conn, tenant_id, user_id, team_id, mode)
            members = self._members(conn, tenant_id, team_id) if team_id is not None else [user_id]
        return {
            "sharing_mode": mode,
            "members": members,
            "visible": {(r["memory_id"], r["version"]): r for r in rows},
        }

    def check_scope(self, conn: psycopg.Connection, tenant_id: str, user_id: str, team_id: str | None) -> str | None:
        """Validate a recall scope on `conn` (tenant open, user a member of the team); returns the key
        of its visibility rule for `visible_candidates_sql`: None for the personal view, else the mode."""
        validation.check_id("tenant", tenant_id)
        validation.check_id("user", user_id)
        validation.check_optional_id("team", team_id)
        mode = self._tenant_mode(conn, tenant_id)
        if team_id is None:
            return None
        self._require_member(conn, tenant_id, team_id, user_id)
        return mode

    def recall_scope(self, *, tenant_id: str, user_id: str, team_id: str | None = None) -> dict[str, Any]:
        """What recall needs before it asks the indexes (no memory is read): sharing mode, the team's
        members (the user alone in a personal view) and the tenant's change sequence."""
        with self.transaction() as conn:
            self.check_scope(conn, tenant_id, user_id, team_id)
            row = conn.execute(
                "SELECT sharing_mode, change_seq FROM memory.tenants WHERE tenant_id = %s", (tenant_id,)
            ).fetchone()
            assert row is not None  # check_scope found it in this transaction
            members = self._members(conn, tenant_id, team_id) if team_id is not None else [user_id]
        return {"sharing_mode": str(row[0]), "members": members, "change_seq": int(row[1])}

    @staticmethod
    def scope_versions(
        conn: psycopg.Connection, scope: str | None, tenant_id: str, user_id: str, team_id: str | None, *, cap: int
    ) -> list[tuple[str, int]] | None:
        """Every version of every memory the rule of `scope` (what `check_scope` returned on `conn`)
        can admit: a superset of what the user sees, stale versions included as an index may still
        hold them; when the scope has at most `cap` memories, else None. A bounded count first: at
        most `cap` index entries are read for a scope of any size."""
        params = {"tenant": tenant_id, "user": user_id, "team": team_id, "cap": cap + 1}
        counted = conn.execute(_COUNT_SCOPE[scope], params).fetchone()
        if counted is None or counted[0] > cap:
            return None
        return [(m, v) for m, v in conn.execute(_SCOPE_VERSIONS[scope], params)]

    def confirm_visible(
        self,
        *,
        tenant_id: str,
        user_id: str,
        team_id: str | None = None,
        candidates: list[tuple[str, int]],
        in_scope: bool = False,
    ) -> dict[tuple[str, int], dict[str, Any]]:
        """The `candidates` (memory_id, version) the user sees now: current, not hidden by an accepted
        deletion, in scope under the tenant's sharing mode. Each maps to memory_id, version, user_id,
        team_id, category and subject_epoch; one query, whatever the size of the visible set.

        With `in_scope`, also those the scope's rule admits that are superseded or hidden, each row's
        `visible` telling which: the rule alone is what Chroma's metadata filter applies."""
        with self.transaction() as conn:
            scope = self.check_scope(conn, tenant_id, user_id, team_id)
            if not candidates:
                return {}
            params = {
                "tenant": tenant_id,
                "user": user_id,
                "team": team_id,
                "m": [m for m, _ in candidates],
                "v": [v for _, v in candidates],
            }
            with conn.cursor(row_factory=dict_row) as cur:
                rows = cur.execute(_CONFIRM_VISIBLE[(scope, in_scope)], params).fetchall()
        return {(r["memory_id"], r["version"]): r for r in rows}

    def _current_view(self, conn: psycopg.Connection, row: dict[str, Any]) -> dict[str, Any]:
        return {
            "memory_id": row["memory_id"],
            "version": row["version"],
            "text": self._open_text(conn, row),
            "user_id": row["user_id"],
            "team_id": row["team_id"],
            "memory_type": row["memory_type"],
            "shareable": row["shareable"],
            "category": row["category"],
            "confidence": row["confidence"],
            "do_not_sell": bool(row["memory_dns"] or row["subject_dns"]),
            "created_at": _iso(row["memory_created_at"]),
            "updated_at": _iso(row["updated_at"]),
        }

    def iter_export(self, *, tenant_id: str, subject: str) -> Iterator[dict[str, Any]]:
        """Every version of every memory the subject wrote, personal and team, streamed in batches."""
        validation.check_id("tenant", tenant_id)
        validation.check_id("subject", subject)
        with self.transaction() as conn:
            self._tenant_mode(conn, tenant_id)
        # A connection of its own: a server-side cursor lives as long as the caller keeps reading.
        with self._connect() as conn, conn.transaction():
            with conn.cursor(name="export_subject", row_factory=dict_row) as cur:
                cur.itersize = EXPORT_BATCH
                cur.execute(_SELECT_EXPORT, (tenant_id, subject))
                while batch := cur.fetchmany(EXPORT_BATCH):
                    # Keys are looked up per batch on the store's own short transactions: the export's
                    # long-lived one must hold no lock on the key tables (key compaction waits for it).
                    with self.transaction() as key_conn:
                        keys = self.keys.keys_by_id(key_conn, tenant_id, [row["key_id"] for row in batch])
                    yield from (self._export_row(row, keys) for row in batch)

    def _export_row(self, row: dict[str, Any], keys: dict[str, bytes]) -> dict[str, Any]:
        key = _key_of(row, keys)
        ids = (row["tenant_id"], row["memory_id"], row["version"])
        query_ct = row["original_query_ct"]
        return {
            "memory_id": row["memory_id"],
            "version": row["version"],
            "current": row["version"] == row["current_version"],
            "text": crypto.open_sealed(key, bytes(row["text_ct"]), _text_aad(*ids)).decode("utf-8"),
            "team_id": row["team_id"],
            "memory_type": row["memory_type"],
            "shareable": row["shareable"],
            "category": row["category"],
            "confidence": row["confidence"],
            "original_query": None
            if query_ct is None
            else crypto.open_sealed(key, bytes(query_ct), _query_aad(*ids)).decode("utf-8"),
            "do_not_sell": bool(row["memory_dns"] or row["subject_dns"]),
            "restored_from": row["restored_from"],
            "created_at": _iso(row["created_at"]),
            "superseded_at": _iso(row["superseded_at"]),
        }

    def export_json(self, *, tenant_id: str, subject: str) -> Iterator[str]:
        """The subject's export (GDPR Art. 15/20, CCPA) as chunks of one JSON document."""
        rows = self.iter_export(tenant_id=tenant_id, subject=subject)
        first_row = next(rows, None)  # validates before the first byte is produced
        header = {
            "format": "memory-pipelines.export.v1",
            "tenant": tenant_id,
            "subject": subject,
            "exported_at": datetime.now().astimezone().isoformat(),
        }
        yield json.dumps(header)[:-1] + ', "memories": ['
        if first_row is not None:
            yield "\n" + json.dumps(first_row)
            for row in rows:
                yield ",\n" + json.dumps(row)
        yield "\n]}\n"

    def current_versions(
        self, *, tenant_id: str, user_ids: list[str] | None = None, team_ids: list[str] | None = None
    ) -> list[CurrentVersion]:
        """Every current version of the tenant with its metadata (no text), ordered by memory_id.

        With `user_ids` or `team_ids`, only memories authored by those users or shared in those teams.
        """
        validation.check_id("tenant", tenant_id)
        with self.transaction() as conn:
            self._tenant_mode(conn, tenant_id)
            if user_ids is None and team_ids is None:
                return [CurrentVersion(*row) for row in conn.execute(_SELECT_CURRENT, (tenant_id,))]
            params = (tenant_id, user_ids or [], team_ids or [])
            return [CurrentVersion(*row) for row in conn.execute(_SELECT_CURRENT_OF_OWNERS, params)]

    def original_queries(self, *, tenant_id: str, memory_ids: list[str]) -> dict[str, str]:
        """memory_id -> the query that produced its current version (drift evaluation); hidden ones left out."""
        validation.check_id("tenant", tenant_id)
        out: dict[str, str] = {}
        with self.transaction() as conn, conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(
                _SELECT_QUERIES,
                (tenant_id, memory_ids),
            ).fetchall()
            for row in rows:
                query = self._open_query(conn, row)
                if query is not None:
                    out[row["memory_id"]] = query
        return out

    def open_texts(
        self,
        *,
        tenant_id: str,
        sources: list[tuple[str, int]],
        skip_unreadable: bool = False,
        visible_only: bool = False,
    ) -> dict[tuple[str, int], str]:
        """Decrypt the text of exactly these versions (what a derived store or a recall answer needs).

        `skip_unreadable` leaves out versions whose key is already destroyed (a resumed deletion);
        `visible_only` leaves out versions hidden by a deletion accepted at this moment.
        """
        out: dict[tuple[str, int], str] = {}
        if not sources:
            return out
        query = _SELECT_VISIBLE_TEXTS if visible_only else _SELECT_TEXTS
        with self.transaction() as conn, conn.cursor(row_factory=dict_row) as cur:
            if visible_only:
                self._tenant_mode(conn, tenant_id)
            for start in range(0, len(sources), 1000):
                chunk = sources[start : start + 1000]
                rows = cur.execute(query, ([m for m, _ in chunk], [v for _, v in chunk], tenant_id)).fetchall()
                keys = self.keys.keys_by_id(conn, tenant_id, [row["key_id"] for row in rows])
                for row in rows:
                    try:
                        aad = _text_aad(row["tenant_id"], row["memory_id"], row["version"])
                        text = crypto.open_sealed(_key_of(row, keys), bytes(row["text_ct"]), aad).decode("utf-8")
                        out[(row["memory_id"], row["version"])] = text
                    except (NotFoundError, crypto.DecryptionError):
                        if not skip_unreadable:
                            raise
        return out

    def teams(self, *, tenant_id: str) -> dict[str, list[str]]:
        """team_id -> current members."""
        with self.transaction() as conn:
            self._tenant_mode(conn, tenant_id)
            teams: dict[str, list[str]] = {
                r[0]: [] for r in conn.execute("SELECT team_id FROM memory.teams WHERE tenant_id = %s", (tenant_id,))
            }
            for team_id, user_id in conn.execute(
                "SELECT team_id, user_id FROM memory.team_members WHERE tenant_id = %s ORDER BY user_id",
                (tenant_id,),
            ):
                teams[team_id].append(user_id)
        return teams

    def tenant_exists(self, *, tenant_id: str) -> bool:
        with self.transaction() as conn:
            return (
                conn.execute("SELECT 1 FROM memory.tenants WHERE tenant_id = %s", (tenant_id,)).fetchone() is not None
            )

    def require_tenant(self, *, tenant_id: str) -> str:
        """The tenant's sharing mode; NotFoundError('tenant') when it does not exist."""
        validation.check_id("tenant", tenant_id)
        with self.transaction() as conn:
            return self._tenant_mode(conn, tenant_id)

    def change_seq(self, *, tenant_id: str) -> int:
        with self.transaction() as conn:
            row = conn.execute("SELECT change_seq FROM memory.tenants WHERE tenant_id = %s", (tenant_id,)).fetchone()
        if row is None:
            raise NotFoundError("tenant", f"unknown tenant {tenant_id!r}")
        return int(row[0])

    def tenant_stats(self, *, tenant_id: str) -> dict[str, Any]:
        """Counts for one tenant (no text): what the `memories` asset reports per partition."""
        validation.check_id("tenant", tenant_id)
        with self.transaction() as conn:
            mode = self._tenant_mode(conn, tenant_id)
            counts = conn.execute(
                """
                SELECT count(*),
                       count(*) FILTER (WHERE memory_type = 'personal'),
                       count(*) FILTER (WHERE memory_type = 'team_shared'),
                       count(*) FILTER (WHERE do_not_sell),
                       (SELECT count(*) FROM memory.memory_versions v WHERE v.tenant_id = %(t)s),
                       (SELECT count(*) FROM memory.subjects s WHERE s.tenant_id = %(t)s),
                       (SELECT count(*) FROM memory.teams tm WHERE tm.tenant_id = %(t)s),
                       (SELECT change_seq FROM memory.tenants WHERE tenant_id = %(t)s)
                FROM memory.memories WHERE tenant_id = %(t)s
                """,
                {"t": tenant_id},
            ).fetchone()
            assert counts is not None
            by_category = dict(
                conn.execute(
                    "SELECT v.category, count(*) FROM memory.memories m JOIN memory.memory_versions v"
                    " ON v.tenant_id = m.tenant_id AND v.memory_id = m.memory_id AND v.version = m.current_version"
                    " WHERE m.tenant_id = %s GROUP BY v.category ORDER BY v.category",
                    (tenant_id,),
                ).fetchall()
            )
        return {
            "tenant_id": tenant_id,
            "sharing_mode": mode,
            "memories": counts[0],
            "personal": counts[1],
            "team_shared": counts[2],
            "do_not_sell_memories": counts[3],
            "versions": counts[4],
            "subjects": counts[5],
            "teams": counts[6],
            "change_seq": counts[7],
            "by_category": by_category,
        }

    def integrity_problems(self, *, tenant_id: str) -> dict[str, int]:
        """Counts of rows that break the store's invariants (all zero when healthy)."""
        with self.transaction() as conn:
            row = conn.execute(
                """
                SELECT
                  (SELECT count(*) FROM memory.memories m WHERE m.tenant_id = %(t)s AND NOT EXISTS (
                     SELECT 1 FROM memory.memory_versions v WHERE v.tenant_id = m.tenant_id
                       AND v.memory_id = m.memory_id AND v.version = m.current_version
                       AND v.superseded_at IS NULL)),
                  (SELECT count(*) FROM memory.memory_versions v JOIN memory.memories m
                     ON m.tenant_id = v.tenant_id AND m.memory_id = v.memory_id
                     WHERE v.tenant_id = %(t)s AND v.version <> m.current_version AND v.superseded_at IS NULL),
                  (SELECT count(*) FROM memory.memory_versions v WHERE v.tenant_id = %(t)s AND NOT EXISTS (
                     SELECT 1 FROM keystore.subject_keys k WHERE k.tenant_id = v.tenant_id AND k.key_id = v.key_id))
                """,
                {"t": tenant_id},
            ).fetchone()
        assert row is not None
        return {
            "heads_without_current_version": row[0],
            "stale_versions_not_superseded": row[1],
            "versions_without_subject_key": row[2],
        }
