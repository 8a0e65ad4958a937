"""The reads derived stores (vectors, keyword index, summaries, analytics) and recall answers are
built from: the metadata of current versions, the decrypted texts of exact versions, and the original
queries behind current versions.
"""

from __future__ import annotations

from psycopg.rows import dict_row

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import NotFoundError
from memory_pipelines.lib.memories import crypto, tenants
from memory_pipelines.lib.memories.connections import Connections
from memory_pipelines.lib.memories.keys import KeyStore
from memory_pipelines.lib.memories.records import CurrentVersion
from memory_pipelines.lib.memories.sealing import Sealing, key_of, text_aad
from memory_pipelines.lib.memories.visibility import NOT_HIDDEN

__all__ = [
    "DerivedReads",
]

# Query texts are constants; every value travels as a bound parameter.
_CURRENT_BASE = (
    "SELECT m.memory_id, v.version, m.user_id, m.team_id, m.memory_type, v.shareable, v.category, v.confidence,"
    " (m.do_not_sell OR s.do_not_sell) AS do_not_sell, s.epoch, m.created_at, m.updated_at, v.created_at"
    " FROM memory.memories m"
    " JOIN memory.subjects s ON s.tenant_id = m.tenant_id AND s.user_id = m.user_id"
    " JOIN memory.memory_versions v ON v.tenant_id = m.tenant_id AND v.memory_id = m.memory_id"
    " AND v.version = m.current_version"
    " WHERE m.tenant_id = %s"
)
_SELECT_CURRENT = _CURRENT_BASE + NOT_HIDDEN + " ORDER BY m.memory_id"
_SELECT_QUERIES = (
    "SELECT v.tenant_id, v.memory_id, v.version, v.original_query_ct, v.key_id"  # noqa: S608
    " FROM memory.memories m JOIN memory.memory_versions v ON v.tenant_id = m.tenant_id"
    " AND v.memory_id = m.memory_id AND v.version = m.current_version"
    " JOIN memory.subjects s ON s.tenant_id = m.tenant_id AND s.user_id = m.user_id"
    " WHERE m.tenant_id = %s AND m.memory_id = ANY(%s)" + NOT_HIDDEN
)
_SELECT_CURRENT_OF_OWNERS = (
    _CURRENT_BASE + NOT_HIDDEN + " AND (m.user_id = ANY(%s) OR m.team_id = ANY(%s)) ORDER BY m.memory_id"
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
    " WHERE v.tenant_id = %s" + NOT_HIDDEN
)


class DerivedReads:
    """Current versions, exact versions' texts, and original queries, for derived stores and recall."""

    def __init__(self, connections: Connections, keys: KeyStore, sealing: Sealing) -> None:
        self.connections = connections
        self.keys = keys
        self.sealing = sealing

    def current_versions(
        self, *, tenant_id: str, user_ids: list[str] | None = None, team_ids: list[str] | None = None
    ) -> list[CurrentVersion]:
        """Every current version of the tenant with its metadata (no text), ordered by memory_id.

        With `user_ids` or `team_ids`, only memories authored by those users or shared in those teams.
        """
        validation.check_id("tenant", tenant_id)
        with self.connections.transaction() as conn:
            tenants.tenant_mode(conn, tenant_id)
            if user_ids is None and team_ids is None:
                return [CurrentVersion(*row) for row in conn.execute(_SELECT_CURRENT, (tenant_id,))]
            params = (tenant_id, user_ids or [], team_ids or [])
            return [CurrentVersion(*row) for row in conn.execute(_SELECT_CURRENT_OF_OWNERS, params)]

    def original_queries(self, *, tenant_id: str, memory_ids: list[str]) -> dict[str, str]:
        """memory_id -> the query that produced its current version (drift evaluation); hidden ones left out."""
        validation.check_id("tenant", tenant_id)
        out: dict[str, str] = {}
        with self.connections.transaction() as conn, conn.cursor(row_factory=dict_row) as cur:
            rows = cur.execute(
                _SELECT_QUERIES,
                (tenant_id, memory_ids),
            ).fetchall()
            for row in rows:
                query = self.sealing.open_query(conn, row)
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
        with self.connections.transaction() as conn, conn.cursor(row_factory=dict_row) as cur:
            if visible_only:
                tenants.tenant_mode(conn, tenant_id)
            for start in range(0, len(sources), 1000):
                chunk = sources[start : start + 1000]
                rows = cur.execute(query, ([m for m, _ in chunk], [v for _, v in chunk], tenant_id)).fetchall()
                keys = self.keys.keys_by_id(conn, tenant_id, [row["key_id"] for row in rows])
                for row in rows:
                    try:
                        aad = text_aad(row["tenant_id"], row["memory_id"], row["version"])
                        text = crypto.open_sealed(key_of(row, keys), bytes(row["text_ct"]), aad).decode("utf-8")
                        out[(row["memory_id"], row["version"])] = text
                    except (NotFoundError, crypto.DecryptionError):
                        if not skip_unreadable:
                            raise
        return out
