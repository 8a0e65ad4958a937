"""Recall: the memories a user may see that best match a query (semantic, keyword or hybrid).

Candidates come from the derived indexes, and the memory store confirms exactly those candidates
(current version, not hidden by an accepted deletion, sharing mode, team membership): a recall
never reads the user's whole visible set. The keyword index's SQL joins the store's rules, so its
LIMIT counts visible answers; Chroma's nearest vectors are checked in one query (its metadata
filter, whose cost grows with the vectors on the server, only when the scope is rare among them).
Hybrid adds each candidate's cosine similarity and keyword share (fusion.py).
Only the answers are decrypted. Each recall is cached by an HMAC of the query and its scope (ids and
versions only) with lineage and the asker's id, and reused until the tenant's memories change; a
SUBJECT forget removes every cached answer to the subject's own queries.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import NotFoundError
from memory_pipelines.lib.memories import crypto, ordering
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import RecallHit
from memory_pipelines.lib.stores import lineage
from memory_pipelines.lib.stores.chroma.index import VectorStore
from memory_pipelines.lib.stores.keyword.index import KeywordIndex
from memory_pipelines.lib.stores.recall import fusion

__all__ = [
    "CACHE_STORE",
    "MODES",
    "Recaller",
    "chroma_where",
    "drop_cache",
]

CACHE_STORE = "recall_cache"
MODES = validation.RECALL_MODES
# Keyword hits hybrid fuses: a semantic candidate deep in the keyword list still gets its share.
_KEYWORD_FUSED = 1000
# Semantic candidates the store rejects (superseded, hidden since) are made up for by asking Chroma
# again, 4x deeper each round, within this many rounds and candidates in scope.
_SEMANTIC_ROUNDS = 5
_SEMANTIC_MAX = 1000
# Deepest unfiltered question to Chroma; a scope rarer than that among the nearest is filtered by it.
_UNFILTERED_MAX = 2000
# A scope of at most this many memories (a personal view in a large tenant) is searched among its
# own versions in the keyword index.
_SMALL_SCOPE = 1000


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

    def recall(
        self,
        *,
        tenant_id: str,
        user_id: str,
        query: str,
        team_id: str | None = None,
        k: int = 5,
        mode: str = "hybrid",
        on_read: Callable[[list[tuple[str, int, str, int]]], None] | None = None,
        use_cache: bool = True,
    ) -> list[RecallHit]:
        """Top-k visible current memories for `query`: memory_id, version, text, score, and scope.

        Inside an agent run, `on_read` hears every recalled version (memory id, version, author,
        the author's epoch as read) before any text is opened: the run fences them on its lease, so
        its sinks get no permit once any of it is forgotten.
        `use_cache=False` measures the indexes themselves (evaluation).
        """
        validation.check_text("query", query)
        validation.check_recall(k, mode)
        scope = self.store.recall_scope(tenant_id=tenant_id, user_id=user_id, team_id=team_id)
        change_seq = scope["change_seq"]
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
        hits: fusion.Ranked = []
        rows: dict[tuple[str, int], dict[str, Any]] = {}
        from_cache = False
        if use_cache and cached is not None and cached[0] == change_seq:
            hits = [((m, v), s) for m, v, s in cached[1]]
            rows = self.store.confirm_visible(
                tenant_id=tenant_id, user_id=user_id, team_id=team_id, candidates=[h for h, _ in hits]
            )
            from_cache = all(source in rows for source, _ in hits)
        if not from_cache:
            hits, rows = self._rank(tenant_id, user_id, team_id, query, k, mode, scope)
            self._cache(tenant_id, user_id, cache_key, change_seq, hits)
        if on_read is not None:
            on_read([(m, v, rows[(m, v)]["user_id"], int(rows[(m, v)]["subject_epoch"])) for (m, v), _ in hits])
        # Decrypted only if still visible now: a deletion accepted while we ranked hides its scope.
        texts = self.store.open_texts(tenant_id=tenant_id, sources=[source for source, _ in hits], visible_only=True)
        hits = [(source, score) for source, score in hits if source in texts]
        return [
            {
                "memory_id": memory_id,
                "version": version,
                "text": texts[(memory_id, version)],
                "score": round(score, 6),
                "user_id": rows[(memory_id, version)]["user_id"],
                "team_id": rows[(memory_id, version)]["team_id"],
                "category": rows[(memory_id, version)]["category"],
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
    ) -> tuple[fusion.Ranked, dict[tuple[str, int], dict[str, Any]]]:
        """The top k (memory_id, version) and score, and the store's row of each candidate kept."""
        rows: dict[tuple[str, int], dict[str, Any]] = {}
        semantic, keyword = self._lists(tenant_id, user_id, team_id, query, k, mode, scope, rows)
        if mode == "semantic":
            return semantic[:k], rows
        if mode == "keyword":
            return keyword[:k], rows
        return fusion.fuse(semantic, keyword, k), rows

    def ranked_lists(
        self, *, tenant_id: str, user_id: str, team_id: str | None, query: str, k: int
    ) -> tuple[fusion.Ranked, fusion.Ranked]:
        """The semantic and keyword lists hybrid recall of the top k fuses, best first, each hit with
        its own score (for evaluation and benchmarks, which compare fusions on the same lists)."""
        validation.check_text("query", query)
        validation.check_recall(k, "hybrid")
        scope = self.store.recall_scope(tenant_id=tenant_id, user_id=user_id, team_id=team_id)
        return self._lists(tenant_id, user_id, team_id, query, k, "hybrid", scope, {})

    def _lists(
        self,
        tenant_id: str,
        user_id: str,
        team_id: str | None,
        query: str,
        k: int,
        mode: str,
        scope: dict[str, Any],
        rows: dict[tuple[str, int], dict[str, Any]],
    ) -> tuple[fusion.Ranked, fusion.Ranked]:
        """The semantic and keyword lists `mode` needs (the other one empty); `rows` gets the store's
        row of each hit."""
        fetch = min(max(4 * k, k + 20), 400)
        semantic: fusion.Ranked = []
        keyword: fusion.Ranked = []
        if mode in ("semantic", "hybrid"):
            semantic = self._semantic(tenant_id, user_id, team_id, query, k, fetch, scope, rows)
        if mode in ("keyword", "hybrid"):
            # Hybrid fuses deep into the list (fusion.py); keyword alone needs only the best k visible.
            limit = k if mode == "keyword" else max(fetch, _KEYWORD_FUSED)
            found = self.keywords.search_visible(
                tenant_id=tenant_id,
                user_id=user_id,
                team_id=team_id,
                query=query,
                limit=limit,
                small_scope=_SMALL_SCOPE,
            )
            keyword = [(source, score) for source, score, _ in found]
            rows.update((source, row) for source, _, row in found)
        return semantic, keyword

    def _semantic(
        self,
        tenant_id: str,
        user_id: str,
        team_id: str | None,
        query: str,
        k: int,
        fetch: int,
        scope: dict[str, Any],
        rows: dict[tuple[str, int], dict[str, Any]],
    ) -> fusion.Ranked:
        """The visible ones among the `fetch` nearest vectors in scope (the window), widened while
        fewer than k survive the store's confirmation (superseded, hidden since).

        Chroma's metadata filter costs time in proportion to the vectors on the server (measured:
        8 ms for a tenant of 1,100 alone, 140 ms to 1 s beside one of 110,000; restricting a query
        to ids costs as much), so the window is first looked for among the nearest vectors
        unfiltered, the store telling which are in scope (the same rule as the filter); only when
        too few of them are does Chroma filter."""
        where = chroma_where(user_id, team_id, scope["sharing_mode"], scope["members"])
        vector = self.vectors.embedder.embed([query])[0]
        window, depth = fetch, max(2 * fetch, 50)
        kept: fusion.Ranked = []
        for _ in range(_SEMANTIC_ROUNDS):
            unfiltered = depth <= _UNFILTERED_MAX
            ask = depth if unfiltered else window
            found = self.vectors.nearest(
                tenant_id=tenant_id, vector=vector, limit=ask, where=None if unfiltered else where
            )
            confirmed = self.store.confirm_visible(
                tenant_id=tenant_id,
                user_id=user_id,
                team_id=team_id,
                candidates=[source for source, _ in found],
                in_scope=True,
            )
            in_scope = [hit for hit in found if hit[0] in confirmed]
            exhausted = len(found) < ask
            kept = [hit for hit in in_scope[:window] if confirmed[hit[0]]["visible"]]
            rows.update((hit[0], confirmed[hit[0]]) for hit in kept)
            if unfiltered and len(in_scope) < window and not exhausted:
                # Too few in scope among the nearest: deeper, by the share in scope seen, or filtered.
                share = len(in_scope) / len(found)
                depth = max(4 * depth, math.ceil(1.25 * window / share)) if share else _UNFILTERED_MAX + 1
                continue
            if len(kept) >= k or (exhausted and len(in_scope) <= window) or window >= _SEMANTIC_MAX:
                break
            window, depth = min(4 * window, _SEMANTIC_MAX), 4 * depth
        return kept

    def _cache(
        self,
        tenant_id: str,
        user_id: str,
        cache_key: bytes,
        change_seq: int,
        hits: fusion.Ranked,
    ) -> None:
        """Cache an answer set under the asker's name: a SUBJECT forget of the asker removes it, whatever
        it names. Nothing is cached for an asker being forgotten (or unknown: nobody to forget)."""
        results = json.dumps([[m, v, s] for (m, v), s in hits])
        with self.store.transaction() as conn:
            if ordering.guard_build(conn, tenant_id, [source for source, _ in hits]):
                return  # an answer set naming forgotten versions is not worth caching
            asker = conn.execute(
                "SELECT forgotten_at IS NULL FROM memory.subjects WHERE tenant_id = %s AND user_id = %s",
                (tenant_id, user_id),
            ).fetchone()
            if asker is None or not asker[0]:
                return  # under the gate lock: ordered before the forget's acceptance, or seen after it
            conn.execute(
                "INSERT INTO derived.recall_cache (tenant_id, cache_key, change_seq, results, user_id)"
                " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (tenant_id, cache_key) DO UPDATE SET"
                " change_seq = EXCLUDED.change_seq, results = EXCLUDED.results, user_id = EXCLUDED.user_id,"
                " created_at = now()",
                (tenant_id, cache_key, change_seq, results, user_id),
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
