"""Statistics and health of a tenant's memories (no text): the counts the `memories` asset reports,
and counts of rows that break the store's invariants.
"""

from __future__ import annotations

from typing import Any

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.memories import tenants
from memory_pipelines.lib.memories.connections import Connections

__all__ = [
    "Statistics",
]


class Statistics:
    """Per-tenant counts and integrity checks, read on `connections`."""

    def __init__(self, connections: Connections) -> None:
        self.connections = connections

    def tenant_stats(self, *, tenant_id: str) -> dict[str, Any]:
        """Counts for one tenant (no text): what the `memories` asset reports per partition."""
        validation.check_id("tenant", tenant_id)
        with self.connections.transaction() as conn:
            mode = tenants.tenant_mode(conn, tenant_id)
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
        with self.connections.transaction() as conn:
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
                     SELECT 1 FROM keystore.version_keys k WHERE k.tenant_id = v.tenant_id AND k.key_id = v.key_id)
                     AND NOT EXISTS (SELECT 1 FROM keystore.subject_keys k WHERE k.tenant_id = v.tenant_id
                       AND k.key_id = v.key_id)
                     AND NOT EXISTS (SELECT 1 FROM keystore.retired_keys k WHERE k.tenant_id = v.tenant_id
                       AND k.key_id = v.key_id))
                """,
                {"t": tenant_id},
            ).fetchone()
        assert row is not None
        return {
            "heads_without_current_version": row[0],
            "stale_versions_not_superseded": row[1],
            "versions_without_key": row[2],
        }
