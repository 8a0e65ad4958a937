"""Who sees which memory: the SQL of the visibility rules (a personal view, or a team view by the
tenant's sharing mode: strict, shared_pool, progressive), the rule that hides what a deletion
accepted, and the reads that apply them (listing a user's memories, recall's scope checks).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.memories import tenants
from memory_pipelines.lib.memories.connections import Connections
from memory_pipelines.lib.memories.records import iso
from memory_pipelines.lib.memories.sealing import Sealing
from memory_pipelines.lib.memories.teams import require_member, team_members
from memory_pipelines.lib.results import VisibleMemory

__all__ = [
    "NOT_HIDDEN",
    "NOT_TOMBSTONED",
    "SELECT_MEMORY",
    "Visibility",
    "check_scope",
    "scope_versions",
    "visible_candidates_sql",
]

# Query texts are constants; every value travels as a bound parameter.
# Hide at once: a forgotten subject's memories and tombstoned versions vanish from every read the
# moment a deletion request is accepted, before any store is touched.
NOT_HIDDEN = (
    " AND s.forgotten_at IS NULL AND NOT EXISTS (SELECT 1 FROM control.tombstones t"
    " WHERE t.tenant_id = v.tenant_id AND t.memory_id = v.memory_id AND t.version = v.version)"
)
NOT_TOMBSTONED = (
    " AND NOT EXISTS (SELECT 1 FROM control.tombstones t"
    " WHERE t.tenant_id = v.tenant_id AND t.memory_id = v.memory_id AND t.version = v.version)"
)
SELECT_MEMORY = (
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
    mode: SELECT_MEMORY
    + " AND v.version = m.current_version WHERE m.tenant_id = %(tenant)s"
    + NOT_HIDDEN
    + where
    + " ORDER BY m.created_at, m.memory_id"
    for mode, where in _VISIBLE_WHERE.items()
}
# Recall: the rules of _SELECT_VISIBLE applied to candidates `c` only, so a recall never loads the
# user's whole visible set. Each LATERAL ... OFFSET 0 is one primary-key probe per candidate, in the
# candidates' order, whatever the planner guesses of a tenant's size: left to it, generic plans of
# the plain join scanned all of a tenant's memories. The scope rule (_VISIBLE_WHERE) goes in WHERE;
# _NOW is the rest of _SELECT_VISIBLE: the current version, and NOT_HIDDEN's two tests.
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


def _visible_rows(
    conn: psycopg.Connection, tenant_id: str, user_id: str, team_id: str | None, mode: str
) -> list[dict[str, Any]]:
    params = {"tenant": tenant_id, "user": user_id, "team": team_id}
    if team_id is not None:
        require_member(conn, tenant_id, team_id, user_id)
    query = _SELECT_VISIBLE[None if team_id is None else mode]
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, params).fetchall()


def check_scope(conn: psycopg.Connection, tenant_id: str, user_id: str, team_id: str | None) -> str | None:
    """Validate a recall scope on `conn` (tenant open, user a member of the team); returns the key
    of its visibility rule for `visible_candidates_sql`: None for the personal view, else the mode."""
    validation.check_id("tenant", tenant_id)
    validation.check_id("user", user_id)
    validation.check_optional_id("team", team_id)
    mode = tenants.tenant_mode(conn, tenant_id)
    if team_id is None:
        return None
    require_member(conn, tenant_id, team_id, user_id)
    return mode


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


class Visibility:
    """The memories a user may see now, texts opened by `sealing`, and recall's checks of candidates."""

    def __init__(self, connections: Connections, sealing: Sealing) -> None:
        self.connections = connections
        self.sealing = sealing

    def list_visible(self, *, tenant_id: str, user_id: str, team_id: str | None = None) -> list[VisibleMemory]:
        """Current memories a user sees: their personal view, or a team view by the tenant's sharing mode.

        strict: the user's own memories in the team (team_id + user_id).
        shared_pool: every team memory, each with its creator.
        progressive: the team pool (every team memory) plus personal memories that a current
        member marked shareable.
        """
        validation.check_id("tenant", tenant_id)
        validation.check_id("user", user_id)
        validation.check_optional_id("team", team_id)
        with self.connections.transaction() as conn:
            mode = tenants.tenant_mode(conn, tenant_id)
            rows = _visible_rows(conn, tenant_id, user_id, team_id, mode)
            return [self._current_view(conn, row) for row in rows]

    def visible_scope(self, *, tenant_id: str, user_id: str, team_id: str | None = None) -> dict[str, Any]:
        """What a user may see, without decrypting: sharing mode, team members, visible (memory_id, version)."""
        validation.check_id("tenant", tenant_id)
        validation.check_id("user", user_id)
        validation.check_optional_id("team", team_id)
        with self.connections.transaction() as conn:
            mode = tenants.tenant_mode(conn, tenant_id)
            rows = _visible_rows(conn, tenant_id, user_id, team_id, mode)
            members = team_members(conn, tenant_id, team_id) if team_id is not None else [user_id]
        return {
            "sharing_mode": mode,
            "members": members,
            "visible": {(r["memory_id"], r["version"]): r for r in rows},
        }

    def recall_scope(self, *, tenant_id: str, user_id: str, team_id: str | None = None) -> dict[str, Any]:
        """What recall needs before it asks the indexes (no memory is read): sharing mode, the team's
        members (the user alone in a personal view) and the tenant's change sequence."""
        with self.connections.transaction() as conn:
            check_scope(conn, tenant_id, user_id, team_id)
            row = conn.execute(
                "SELECT sharing_mode, change_seq FROM memory.tenants WHERE tenant_id = %s", (tenant_id,)
            ).fetchone()
            assert row is not None  # check_scope found it in this transaction
            members = team_members(conn, tenant_id, team_id) if team_id is not None else [user_id]
        return {"sharing_mode": str(row[0]), "members": members, "change_seq": int(row[1])}

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
        with self.connections.transaction() as conn:
            scope = check_scope(conn, tenant_id, user_id, team_id)
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

    def _current_view(self, conn: psycopg.Connection, row: dict[str, Any]) -> VisibleMemory:
        return {
            "memory_id": row["memory_id"],
            "version": row["version"],
            "text": self.sealing.open_text(conn, row),
            "user_id": row["user_id"],
            "team_id": row["team_id"],
            "memory_type": row["memory_type"],
            "shareable": row["shareable"],
            "category": row["category"],
            "confidence": row["confidence"],
            "do_not_sell": bool(row["memory_dns"] or row["subject_dns"]),
            "created_at": iso(row["memory_created_at"]),
            "updated_at": iso(row["updated_at"]),
        }
