"""Recall: the memories a user may see that best match a query (semantic, keyword or hybrid).

Candidates come from the derived indexes; the memory store decides what is visible (sharing mode,
current version, team membership) and only the answers are decrypted. Each recall is cached by
an HMAC of the query and its scope (ids and versions only) with lineage, and reused until the
tenant's memories change.
"""

from __future__ import annotations

import json
from typing import Any

from memory_pipelines.lib import crypto, lineage, ordering, validation
from memory_pipelines.lib.errors import NotFoundError, ValidationError
from memory_pipelines.lib.keyword import KeywordIndex
from memory_pipelines.lib.store import MemoryStore
from memory_pipelines.lib.vectors import VectorStore

CACHE_STORE = "recall_cache"
MODES = ("semantic", "keyword", "hybrid")
_RRF_K = 60  # reciprocal rank fusion constant (Cormack et al.)


def chroma_where(user_id: str, team_id: str | None, sharing_mode: str, members: list[str]) -> dict[str, Any]:
    """Chroma metadata filter matching the store's visibility rules (the store re-checks every hit)."""
    if team_id is None:
        return {"$and": [{"user_id": user_id}, {"team_id": ""}]}
    if sharing_mode == "strict":
        return {"$and": [{"user_id": user_id}, {"team_id": team_id}]}
    if sharing_mode == "shared_pool":
        return {"team_id": team_id}
    return {
        "$or": [
            {"team_id": team_id},
            {"$and": [{"team_id": ""}, {"shareable": True}, {"user_id": {"$in": members}}]},
        ]
    }


class Recaller:
    def __init__(self, *, store: MemoryStore, vectors: VectorStore, keywords: KeywordIndex) -> None:
        self.store = store
        self.vectors = vectors
        self.keywords = keywords
        self._gate: Any = None

    @property
    def gate(self) -> Any:
        """The deletion gate recall fences runs on (created on first use: most recalls have no run)."""
        if self._gate is None:
            from memory_pipelines.lib.gate import Gate

            self._gate = Gate(self.store)
        return self._gate

    def recall(
        self,
        *,
        tenant_id: str,
        user_id: str,
        query: str,
        team_id: str | None = None,
        k: int = 5,
        mode: str = "hybrid",
        lease_id: str | None = None,
        use_cache: bool = True,
    ) -> list[dict[str, Any]]:
        """Top-k visible current memories for `query`: memory_id, version, text, score, and scope.

        Inside an agent run (`lease_id`), every recalled version is fenced on the lease with its
        author's epoch as read, so the run's sinks get no permit once any of it is forgotten.
        `use_cache=False` measures the indexes themselves (evaluation).
        """
        validation.check_text("query", query)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 100:
            raise ValidationError("k", "must be an integer from 1 to 100")
        if mode not in MODES:
            raise ValidationError("mode", f"must be one of {', '.join(MODES)}")
        scope = self.store.visible_scope(tenant_id=tenant_id, user_id=user_id, team_id=team_id)
        visible: dict[tuple[str, int], dict[str, Any]] = scope["visible"]
        change_seq = self.store.change_seq(tenant_id=tenant_id)
        if not visible:
            return []
        with self.store.transaction() as conn:
            try:
                subkey = self.store.keys.tenant_subkey(conn, tenant_id, "recall-cache", create=False)
            except NotFoundError:
                return []  # no tenant key: nothing was ever written, or the tenant was shredded
            cache_key = crypto.mac(subkey, json.dumps([user_id, team_id, mode, k, query]).encode())
            cached = conn.execute(
                "SELECT change_seq, results FROM derived.recall_cache WHERE tenant_id = %s AND cache_key = %s",
                (tenant_id, cache_key),
            ).fetchone()
        hits: list[tuple[tuple[str, int], float]]
        if (
            use_cache
            and cached is not None
            and cached[0] == change_seq
            and all((m, v) in visible for m, v, _ in cached[1])
        ):
            hits = [((m, v), s) for m, v, s in cached[1]]
            from_cache = True
        else:
            hits = self._rank(tenant_id, user_id, team_id, query, k, mode, scope)
            self._cache(tenant_id, cache_key, change_seq, hits)
            from_cache = False
        if lease_id is not None:
            from memory_pipelines.lib.gate import Fence

            self.gate.record_reads(
                lease_id=lease_id,
                fences=[
                    Fence(m, v, visible[(m, v)]["user_id"], int(visible[(m, v)]["subject_epoch"])) for (m, v), _ in hits
                ],
            )
        # Decrypted only if still visible now: a deletion accepted while we ranked hides its scope.
        texts = self.store.open_texts(tenant_id=tenant_id, sources=[source for source, _ in hits], visible_only=True)
        hits = [(source, score) for source, score in hits if source in texts]
        return [
            {
                "memory_id": memory_id,
                "version": version,
                "text": texts[(memory_id, version)],
                "score": round(score, 6),
                "user_id": visible[(memory_id, version)]["user_id"],
                "team_id": visible[(memory_id, version)]["team_id"],
                "category": visible[(memory_id, version)]["category"],
                "cached": from_cache,
            }
            for (memory_id, version), score in hits
        ]

    def _rank(
        self,
        tenant_id: str,
        user_id: str,
        team_id: str | None,
        query: str,
        k: int,
        mode: str,
        scope: dict[str, Any],
    ) -> list[tuple[tuple[str, int], float]]:
        visible = scope["visible"]
        # Over-fetch: the store drops hits that are superseded or out of scope after the index query.
        fetch = min(max(4 * k, k + 20), 400)
        semantic: list[tuple[tuple[str, int], float]] = []
        keyword: list[tuple[tuple[str, int], float]] = []
        if mode in ("semantic", "hybrid") and visible:
            where = chroma_where(user_id, team_id, scope["sharing_mode"], scope["members"])
            semantic = [
                h
                for h in self.vectors.query(tenant_id=tenant_id, text=query, limit=fetch, where=where)
                if h[0] in visible
            ]
        if mode in ("keyword", "hybrid") and visible:
            keyword = [
                h
                for h in self.keywords.search(tenant_id=tenant_id, query=query, limit=max(fetch, 1000))
                if h[0] in visible
            ]
        if mode == "semantic":
            return semantic[:k]
        if mode == "keyword":
            return keyword[:k]
        fused: dict[tuple[str, int], float] = {}
        for ranked in (semantic, keyword):
            for rank, (source, _) in enumerate(ranked):
                fused[source] = fused.get(source, 0.0) + 1.0 / (_RRF_K + rank + 1)
        return sorted(fused.items(), key=lambda item: (-item[1], item[0]))[:k]

    def _cache(
        self, tenant_id: str, cache_key: bytes, change_seq: int, hits: list[tuple[tuple[str, int], float]]
    ) -> None:
        results = json.dumps([[m, v, s] for (m, v), s in hits])
        with self.store.transaction() as conn:
            if ordering.guard_build(conn, tenant_id, [source for source, _ in hits]):
                return  # an answer set naming forgotten versions is not worth caching
            conn.execute(
                "INSERT INTO derived.recall_cache (tenant_id, cache_key, change_seq, results) VALUES (%s, %s, %s, %s)"
                " ON CONFLICT (tenant_id, cache_key) DO UPDATE SET change_seq = EXCLUDED.change_seq,"
                " results = EXCLUDED.results, created_at = now()",
                (tenant_id, cache_key, change_seq, results),
            )
            lineage.record_edges(
                conn, tenant_id=tenant_id, store=CACHE_STORE, record_id=cache_key.hex(), sources=[s for s, _ in hits]
            )


def drop_cache(store: MemoryStore, *, tenant_id: str) -> int:
    """Forget every cached recall of a tenant (its indexes changed); returns entries dropped."""
    with store.transaction() as conn:
        dropped = conn.execute("DELETE FROM derived.recall_cache WHERE tenant_id = %s", (tenant_id,)).rowcount
        conn.execute("DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s", (tenant_id, CACHE_STORE))
    return dropped
