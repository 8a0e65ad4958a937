"""Blind keyword index in PostgreSQL: tokens are stored as HMAC(tenant keyword key, normalised token).

Exact-token search works (the query's tokens are MACed the same way) while no token is readable at
rest. Only current versions are indexed; a superseded version's postings go when the index syncs.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from memory_pipelines.lib import crypto, lineage, ordering
from memory_pipelines.lib.errors import NotFoundError
from memory_pipelines.lib.store import MemoryStore

STORE = "keyword_index"
_TOKEN = re.compile(r"\w+", re.UNICODE)
_STOPWORDS = frozenset(
    "a an and are as at be but by for from has have he her his i in is it its me my of on or our she so "
    "that the their them they this to was we were what when where which who will with you your".split()
)


def tokens(text: str) -> set[str]:
    """Normalised tokens: NFKC, case-folded, word characters, stop words and 1-letter words dropped."""
    normal = unicodedata.normalize("NFKC", text).casefold()
    return {t for t in _TOKEN.findall(normal) if (len(t) > 1 or t.isdigit()) and t not in _STOPWORDS}


class KeywordIndex:
    """Sync and search of the tenant's blind keyword index."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def _key(self, tenant_id: str, *, create: bool = True) -> bytes:
        with self.store.transaction() as conn:
            return self.store.keys.tenant_subkey(conn, tenant_id, "keyword-index", create=create)

    def sync(self, *, tenant_id: str) -> dict[str, int]:
        """Index every current version not yet indexed; drop postings of versions no longer current."""
        current = {cv.record_id: cv for cv in self.store.current_versions(tenant_id=tenant_id)}
        with self.store.transaction() as conn:
            existing = lineage.records_of_store(conn, tenant_id=tenant_id, store=STORE)
        stale = sorted(set(existing) - set(current))
        new = [cv for record_id, cv in current.items() if record_id not in existing]
        if not stale and not new:
            return {"records": len(current), "indexed": 0, "removed": 0, "postings_written": 0}
        try:
            key = self._key(tenant_id, create=False)  # derived writes never create keys
        except NotFoundError:
            return {"records": len(current), "indexed": 0, "removed": 0, "postings_written": 0}
        postings = 0
        with self.store.transaction() as conn:
            # Versions whose deletion was accepted are left to the forget cascade (it verifies them).
            hidden = ordering.guard_build(
                conn, tenant_id, [src for r in stale for src in existing[r]], missing_is_hidden=False
            )
            stale = [r for r in stale if not (existing[r] & hidden)]
            if stale:
                stale_sources = [src for record_id in stale for src in existing[record_id]]
                memory_ids, versions = lineage.pair_arrays(stale_sources)
                conn.execute(
                    "DELETE FROM derived.keyword_postings p"
                    " USING unnest(%s::text[], %s::int[]) AS s(memory_id, version)"
                    " WHERE p.tenant_id = %s AND p.memory_id = s.memory_id AND p.version = s.version",
                    (memory_ids, versions, tenant_id),
                )
                lineage.remove_records(conn, tenant_id=tenant_id, store=STORE, record_ids=stale)
        indexed = 0
        for start in range(0, len(new), 2000):
            chunk = new[start : start + 2000]
            texts = self.store.open_texts(
                tenant_id=tenant_id, sources=[cv.source for cv in chunk], skip_unreadable=True
            )
            # Postings and their lineage commit together: a posting never exists without its edge;
            # nothing is indexed from a version forgotten since it was read.
            with self.store.transaction() as conn:
                hidden = ordering.guard_build(conn, tenant_id, [(cv.memory_id, cv.version, cv.epoch) for cv in chunk])
                # Syncs of one tenant in several processes (automation, the CLI) index disjointly:
                # one at a time per tenant, skipping what another indexed since we listed.
                conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 3))", ("keywords\x1f" + tenant_id,))
                done = set(
                    lineage.records_of_ids(
                        conn, tenant_id=tenant_id, store=STORE, record_ids=[cv.record_id for cv in chunk]
                    )
                )
                chunk = [
                    cv for cv in chunk if cv.source not in hidden and cv.source in texts and cv.record_id not in done
                ]
                indexed += len(chunk)
                # Idempotent even where postings outlived their edge (an older release's restore):
                # a version's postings are replaced, never duplicated.
                conn.execute(
                    "DELETE FROM derived.keyword_postings p"
                    " USING unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
                    " WHERE p.tenant_id = %s AND p.memory_id = w.memory_id AND p.version = w.version",
                    (*lineage.pair_arrays([cv.source for cv in chunk]), tenant_id),
                )
                with (
                    conn.cursor() as cur,
                    cur.copy(
                        "COPY derived.keyword_postings (tenant_id, token_mac, memory_id, version) FROM STDIN"
                    ) as copy,
                ):
                    for cv in chunk:
                        for token in tokens(texts[cv.source]):
                            copy.write_row((tenant_id, crypto.mac(key, token.encode()), cv.memory_id, cv.version))
                            postings += 1
                lineage.insert_edges(
                    conn, tenant_id=tenant_id, store=STORE, records=[(cv.record_id, cv.source) for cv in chunk]
                )
        return {"records": len(current), "indexed": indexed, "removed": len(stale), "postings_written": postings}

    def search(self, *, tenant_id: str, query: str, limit: int) -> list[tuple[tuple[str, int], float]]:
        """(memory_id, version) with the share of the query's tokens they contain, best first."""
        wanted = tokens(query)
        if not wanted:
            return []
        try:
            key = self._key(tenant_id, create=False)
        except NotFoundError:
            return []  # no tenant key (never indexed, or shredded): nothing can match
        macs = [crypto.mac(key, token.encode()) for token in sorted(wanted)]
        with self.store.transaction() as conn:
            rows = conn.execute(
                "SELECT memory_id, version, count(*) FROM derived.keyword_postings"
                " WHERE tenant_id = %s AND token_mac = ANY(%s) GROUP BY memory_id, version"
                " ORDER BY count(*) DESC, memory_id LIMIT %s",
                (tenant_id, macs, limit),
            ).fetchall()
        return [((memory_id, version), count / len(wanted)) for memory_id, version, count in rows]

    def probe_hits(self, *, tenant_id: str, texts: list[str], sources: set[tuple[str, int]]) -> int:
        """Postings of `sources` reachable from any token of `texts` (one query for every probe)."""
        wanted = sorted(set().union(*(tokens(text) for text in texts))) if texts else []
        if not wanted or not sources:
            return 0
        try:
            key = self._key(tenant_id, create=False)
        except NotFoundError:
            return 0
        macs = [crypto.mac(key, token.encode()) for token in wanted]
        memory_ids, versions = lineage.pair_arrays(sorted(sources))
        with self.store.transaction() as conn:
            row = conn.execute(
                "SELECT count(*) FROM derived.keyword_postings p"
                " JOIN unnest(%s::text[], %s::int[]) AS s(memory_id, version)"
                " ON p.memory_id = s.memory_id AND p.version = s.version"
                " WHERE p.tenant_id = %s AND p.token_mac = ANY(%s)",
                (memory_ids, versions, tenant_id, macs),
            ).fetchone()
        return int(row[0]) if row else 0

    def check(self, *, tenant_id: str) -> dict[str, Any]:
        """Counts that must be zero: postings without lineage, postings of versions that are not current."""
        current = {cv.source for cv in self.store.current_versions(tenant_id=tenant_id)}
        with self.store.transaction() as conn:
            indexed = {
                (m, v)
                for m, v in conn.execute(
                    "SELECT DISTINCT memory_id, version FROM derived.keyword_postings WHERE tenant_id = %s",
                    (tenant_id,),
                )
            }
            edges = lineage.records_of_store(conn, tenant_id=tenant_id, store=STORE)
            pending = ordering.hidden_sources(
                conn, tenant_id, sorted(indexed - current), missing_is_hidden=False
            )  # the cascade's to delete
        with_lineage = {src for sources in edges.values() for src in sources}
        return {
            "records": len(indexed),
            "without_lineage": len(indexed - with_lineage),
            "not_current": len(indexed - current - pending),
        }
