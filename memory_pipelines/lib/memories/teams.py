"""Teams of a tenant and their members: joining and leaving a team (each journalled as consent), and
the membership checks that team writes and team views rely on.
"""

from __future__ import annotations

import psycopg

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import NotFoundError, PermissionDeniedError
from memory_pipelines.lib.memories import consent, tenants
from memory_pipelines.lib.memories.connections import Connections
from memory_pipelines.lib.results import TeamMemberAdded, TeamMemberRemoved

__all__ = [
    "Teams",
    "require_member",
    "team_members",
]


def team_members(conn: psycopg.Connection, tenant_id: str, team_id: str) -> list[str]:
    """The team's current members, ordered."""
    return [
        r[0]
        for r in conn.execute(
            "SELECT user_id FROM memory.team_members WHERE tenant_id = %s AND team_id = %s ORDER BY user_id",
            (tenant_id, team_id),
        )
    ]


def _require_team(conn: psycopg.Connection, tenant_id: str, team_id: str) -> None:
    if (
        conn.execute(
            "SELECT 1 FROM memory.teams WHERE tenant_id = %s AND team_id = %s", (tenant_id, team_id)
        ).fetchone()
        is None
    ):
        raise NotFoundError("team", f"no team {team_id!r} in tenant {tenant_id!r}")


def require_member(conn: psycopg.Connection, tenant_id: str, team_id: str, user_id: str) -> None:
    """Refuse unless the team exists and the user is its member, held FOR SHARE until commit."""
    _require_team(conn, tenant_id, team_id)
    # FOR SHARE: a concurrent remove-member waits until this write or read is done.
    if (
        conn.execute(
            "SELECT 1 FROM memory.team_members WHERE tenant_id = %s AND team_id = %s AND user_id = %s FOR SHARE",
            (tenant_id, team_id, user_id),
        ).fetchone()
        is None
    ):
        raise PermissionDeniedError("team", f"user {user_id!r} is not a member of team {team_id!r}")


class Teams:
    """Team membership: add, remove and list, on `connections`."""

    def __init__(self, connections: Connections) -> None:
        self.connections = connections

    def add_team_member(self, *, tenant_id: str, team_id: str, user_id: str) -> TeamMemberAdded:
        """Add a user to a team, creating tenant and team if needed (idempotent)."""
        validation.check_id("tenant", tenant_id)
        validation.check_id("team", team_id)
        validation.check_id("user", user_id)
        with self.connections.transaction() as conn:
            tenants.ensure_tenant(conn, tenant_id)
            tenants.ensure_subject(conn, tenant_id, user_id)
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
            tenants.bump(conn, tenant_id)
            members = team_members(conn, tenant_id, team_id)
        return {
            "tenant_id": tenant_id,
            "team_id": team_id,
            "user_id": user_id,
            "added": added is not None,
            "members": members,
        }

    def remove_team_member(self, *, tenant_id: str, team_id: str, user_id: str) -> TeamMemberRemoved:
        """Remove a user from a team; the memories they wrote for it stay with the team."""
        validation.check_id("tenant", tenant_id)
        validation.check_id("team", team_id)
        validation.check_id("user", user_id)
        with self.connections.transaction() as conn:
            tenants.tenant_mode(conn, tenant_id)
            _require_team(conn, tenant_id, team_id)
            removed = conn.execute(
                "DELETE FROM memory.team_members WHERE tenant_id = %s AND team_id = %s AND user_id = %s "
                "RETURNING user_id",
                (tenant_id, team_id, user_id),
            ).fetchone()
            if removed is None:
                raise NotFoundError("user", f"user {user_id!r} is not a member of team {team_id!r}")
            consent.record(conn, tenant_id, "TEAM_MEMBER_REMOVED", team_id=team_id, subject_id=user_id)
            tenants.bump(conn, tenant_id)
            members = team_members(conn, tenant_id, team_id)
        return {"tenant_id": tenant_id, "team_id": team_id, "user_id": user_id, "removed": True, "members": members}

    def teams(self, *, tenant_id: str) -> dict[str, list[str]]:
        """team_id -> current members."""
        with self.connections.transaction() as conn:
            tenants.tenant_mode(conn, tenant_id)
            teams: dict[str, list[str]] = {
                r[0]: [] for r in conn.execute("SELECT team_id FROM memory.teams WHERE tenant_id = %s", (tenant_id,))
            }
            for team_id, user_id in conn.execute(
                "SELECT team_id, user_id FROM memory.team_members WHERE tenant_id = %s ORDER BY user_id",
                (tenant_id,),
            ):
                teams[team_id].append(user_id)
        return teams
