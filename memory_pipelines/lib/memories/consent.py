"""The consent and access journal: changes a restore must never undo.

A restore restores content, never older consent or access. Each do-not-sell change (per memory and
per subject), team membership change and sharing-mode change appends an entry to
`control.consent_journal` in the transaction that makes it (ids and flags only, never text). A
backup records the PostgreSQL snapshot it read; a restore replays, after loading the backup, the
entries that snapshot did not see, so every change made after the backup (or committing while it
was taken) survives restoring it. For each key the latest entry wins: the per-key row lock the
change takes orders its entries in commit order.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

__all__ = [
    "KINDS",
    "record",
    "replay",
    "snapshot",
]

KINDS = ("MEMORY_DO_NOT_SELL", "SUBJECT_DO_NOT_SELL", "TEAM_MEMBER_ADDED", "TEAM_MEMBER_REMOVED", "SHARING_MODE")


def record(
    conn: psycopg.Connection,
    tenant_id: str,
    kind: str,
    *,
    memory_id: str | None = None,
    subject_id: str | None = None,
    team_id: str | None = None,
    flag: bool | None = None,
    mode: str | None = None,
) -> None:
    """Append one entry, in the caller's transaction (the one that makes the change)."""
    if kind not in KINDS:
        raise ValueError(f"unknown consent journal kind {kind!r}")
    conn.execute(
        "INSERT INTO control.consent_journal (tenant_id, kind, memory_id, subject_id, team_id, flag, mode)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s)",
        (tenant_id, kind, memory_id, subject_id, team_id, flag, mode),
    )


def snapshot(conn: psycopg.Connection) -> str:
    """The snapshot the current statement reads (a REPEATABLE READ transaction's own), as text."""
    row = conn.execute("SELECT pg_current_snapshot()::text").fetchone()
    assert row is not None
    return str(row[0])


# The entries a backup's snapshot did not see (every entry when the backup recorded none: it predates
# the journal, so all of them are newer). Bound: %(t)s tenant, %(snap)s snapshot text or NULL.
_NEWER = (
    "SELECT * FROM control.consent_journal c WHERE c.tenant_id = %(t)s"
    " AND (%(snap)s::text IS NULL OR NOT pg_visible_in_snapshot(c.xid, %(snap)s::text::pg_snapshot))"
)
_LATEST = {
    "memories": "SELECT DISTINCT ON (memory_id) memory_id, flag FROM ({newer}) n"
    " WHERE kind = 'MEMORY_DO_NOT_SELL' ORDER BY memory_id, seq DESC",
    "subjects": "SELECT DISTINCT ON (subject_id) subject_id, flag FROM ({newer}) n"
    " WHERE kind = 'SUBJECT_DO_NOT_SELL' ORDER BY subject_id, seq DESC",
    "members": "SELECT DISTINCT ON (team_id, subject_id) team_id, subject_id, kind, created_at FROM ({newer}) n"
    " WHERE kind IN ('TEAM_MEMBER_ADDED', 'TEAM_MEMBER_REMOVED') ORDER BY team_id, subject_id, seq DESC",
    "sharing": "SELECT mode FROM ({newer}) n WHERE kind = 'SHARING_MODE' ORDER BY seq DESC LIMIT 1",
}


def _latest(name: str) -> sql.Composable:
    return sql.SQL(_LATEST[name].format(newer=_NEWER))


def replay(
    conn: psycopg.Connection,
    tenant_id: str,
    *,
    since: str | None,
    memories: str = "memory.memories",
    teams: str = "memory.teams",
    team_members: str = "memory.team_members",
) -> dict[str, int]:
    """Apply the entries the snapshot `since` did not see to the restored rows (the restore's staging
    tables by default names, or the real ones); returns the entries replayed and rows changed.
    Subjects and the tenant's sharing mode are never replaced by a restore: they are set in place."""
    params: dict[str, Any] = {"t": tenant_id, "snap": since}
    count = conn.execute(sql.SQL("SELECT count(*) FROM ({}) n").format(sql.SQL(_NEWER)), params).fetchone()
    changed: dict[str, int] = {"entries_replayed": int(count[0]) if count else 0}
    if not changed["entries_replayed"]:
        return changed
    mems, tms, tns = (_table(name) for name in (memories, team_members, teams))
    changed["memory_do_not_sell"] = conn.execute(
        sql.SQL(
            "UPDATE {} m SET do_not_sell = l.flag FROM ({}) l WHERE m.tenant_id = %(t)s"
            " AND m.memory_id = l.memory_id AND m.do_not_sell IS DISTINCT FROM l.flag"
        ).format(mems, _latest("memories")),
        params,
    ).rowcount
    changed["subject_do_not_sell"] = conn.execute(
        sql.SQL(
            "UPDATE memory.subjects s SET do_not_sell = l.flag FROM ({}) l WHERE s.tenant_id = %(t)s"
            " AND s.user_id = l.subject_id AND s.do_not_sell IS DISTINCT FROM l.flag"
        ).format(_latest("subjects")),
        params,
    ).rowcount
    changed["members_removed"] = conn.execute(
        sql.SQL(
            "DELETE FROM {} tm USING ({}) l WHERE tm.tenant_id = %(t)s AND l.kind = 'TEAM_MEMBER_REMOVED'"
            " AND tm.team_id = l.team_id AND tm.user_id = l.subject_id"
        ).format(tms, _latest("members")),
        params,
    ).rowcount
    # A team made after the backup comes back with its members (the staging tables have no keys, so
    # NOT EXISTS rather than ON CONFLICT).
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (tenant_id, team_id, created_at) SELECT %(t)s, l.team_id, min(l.created_at)"
            " FROM ({}) l WHERE l.kind = 'TEAM_MEMBER_ADDED' AND NOT EXISTS (SELECT 1 FROM {} x"
            " WHERE x.tenant_id = %(t)s AND x.team_id = l.team_id) GROUP BY l.team_id"
        ).format(tns, _latest("members"), tns),
        params,
    )
    # A member who joined again after the backup (say after a forget of them removed the backup's
    # membership) joined at the entry's time: the restore's epoch rule must not take that for an old row.
    readded = conn.execute(
        sql.SQL(
            "UPDATE {} tm SET added_at = l.created_at FROM ({}) l WHERE tm.tenant_id = %(t)s"
            " AND l.kind = 'TEAM_MEMBER_ADDED' AND tm.team_id = l.team_id AND tm.user_id = l.subject_id"
            " AND tm.added_at < l.created_at"
        ).format(tms, _latest("members")),
        params,
    ).rowcount
    changed["members_added"] = (
        readded
        + conn.execute(
            sql.SQL(
                "INSERT INTO {} (tenant_id, team_id, user_id, added_at) SELECT %(t)s, l.team_id, l.subject_id,"
                " l.created_at FROM ({}) l WHERE l.kind = 'TEAM_MEMBER_ADDED' AND EXISTS (SELECT 1 FROM"
                " memory.subjects s WHERE s.tenant_id = %(t)s AND s.user_id = l.subject_id) AND NOT EXISTS"
                " (SELECT 1 FROM {} x WHERE x.tenant_id = %(t)s AND x.team_id = l.team_id AND x.user_id = l.subject_id)"
            ).format(tms, _latest("members"), tms),
            params,
        ).rowcount
    )
    changed["sharing_mode"] = conn.execute(
        sql.SQL(
            "UPDATE memory.tenants t SET sharing_mode = l.mode FROM ({}) l WHERE t.tenant_id = %(t)s"
            " AND t.sharing_mode IS DISTINCT FROM l.mode"
        ).format(_latest("sharing")),
        params,
    ).rowcount
    return changed


def _table(name: str) -> sql.Composable:
    """A schema-qualified table, or an unqualified one (a temporary table of this session)."""
    return sql.Identifier(*name.split("."))
