"""Blind keyword index in PostgreSQL: tokens are stored as HMAC(keyword key, normalised token).

Exact-token search works (the query's tokens are MACed the same way) while no token is readable at
rest. Only current versions are indexed; a superseded version's postings go when the index syncs.

Two keys. An author-only version (a personal memory's version not marked shareable: under every
sharing mode its author alone sees it) is MACed under a key derived from its author's subject key,
every other version under the tenant keyword key. A writer of the tenant who reads the database can
MAC chosen tokens under the tenant key (write them, read their postings), never under another
subject's key: other people's author-only tokens stay unmatched, and a subject's crypto-shredding
makes their postings unlinkable for good. What decides the key is fixed per version (a memory never
changes team; another shareable flag is another version), so no sharing-mode change re-keys
anything. Postings an older release wrote under the tenant key for author-only versions carry
`legacy_key` (migration 0018): still found (a personal view asks both keys), rewritten by the next
sync.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from typing import Any

import psycopg
from psycopg.rows import dict_row

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import NotFoundError
from memory_pipelines.lib.memories import crypto, ordering, table_partitions
from memory_pipelines.lib.memories.store import CurrentVersion, MemoryStore, visible_candidates_sql
from memory_pipelines.lib.stores import lineage

__all__ = [
    "KEY_PURPOSE",
    "STORE",
    "KeywordIndex",
    "Source",
    "author_only",
    "tokens",
]

STORE = "keyword_index"
KEY_PURPOSE = "keyword-index"  # of the tenant subkey, and of each subject's (lib/memories/keys.py)
Source = tuple[str, int]
# Versions with postings of an older release under the wrong key (migration 0018's partial index).
_LEGACY = "SELECT DISTINCT memory_id, version FROM derived.keyword_postings WHERE tenant_id = %s AND legacy_key"
_LEGACY_AMONG = (
    "SELECT DISTINCT p.memory_id, p.version FROM derived.keyword_postings p"
    " JOIN unnest(%s::text[], %s::int[]) AS w(memory_id, version) ON p.memory_id = w.memory_id"
    " AND p.version = w.version WHERE p.tenant_id = %s AND p.legacy_key"
)
# Matching postings counted per version; ties go to the smaller memory_id. Constant text, values bound.
_HITS = (
    "SELECT p.memory_id, p.version, count(*) AS hits FROM derived.keyword_postings p"
    " WHERE p.tenant_id = %(tenant)s AND p.token_mac = ANY(%(macs)s) GROUP BY p.memory_id, p.version"
)
_SEARCH = _HITS + " ORDER BY hits DESC, p.memory_id LIMIT %(limit)s"
# The best `depth` candidates (a bounded top-N sort, not a sort of the 10,000 that a common token
# has at 100,000 memories), each checked against the store's visibility rules in that order until
# LIMIT visible ones are found: the best visible, not the best of all. Ids (m_ and hex) sort alike
# in every collation; "C" compares bytes.
_SEARCH_VISIBLE = {
    scope: visible_candidates_sql(
        "(" + _HITS + ' ORDER BY hits DESC, p.memory_id COLLATE "C" LIMIT %(depth)s) AS c', scope
    )
    + ' ORDER BY c.hits DESC, c.memory_id COLLATE "C" LIMIT %(limit)s'
    for scope in (None, *validation.SHARING_MODES)
}
# The first answers when enough versions hold every token of the query: walk the rarest token's
# postings in memory_id order (its index order), keep those holding all the others (a probe each),
# check visibility in that order, stop at LIMIT; nothing is counted for the whole posting lists.
# Top answers, exactly: a full match outranks any other and ties go to the smaller memory_id.
_RARITY = (
    "SELECT w.mac, (SELECT count(*) FROM (SELECT 1 FROM derived.keyword_postings p WHERE p.tenant_id = %(tenant)s"
    " AND p.token_mac = w.mac LIMIT %(scan)s) x) AS seen FROM unnest(%(macs)s::bytea[]) AS w(mac)"
)
# The driver: the rarest token's postings in memory_id order (one key), or under each of several keys
# (a personal view asks the tenant's and the user's), merged. A version's postings are all under one
# key, so a full match holds the driver under its own key and exactly n of the query's MACs.
_ONE_DRIVER = (
    "SELECT p.memory_id, p.version FROM derived.keyword_postings p WHERE p.tenant_id = %(tenant)s"
    " AND p.token_mac = %(driver)s ORDER BY p.memory_id, p.version LIMIT %(scan)s"
)
_DRIVERS = (
    "SELECT x.memory_id, x.version FROM unnest(%(drivers)s::bytea[]) AS w(mac) CROSS JOIN LATERAL"
    " (SELECT p.memory_id, p.version FROM derived.keyword_postings p WHERE p.tenant_id = %(tenant)s"
    " AND p.token_mac = w.mac ORDER BY p.memory_id, p.version LIMIT %(scan)s) x"
    " ORDER BY x.memory_id, x.version LIMIT %(scan)s"
)


def _all_tokens(driver: str) -> str:
    """The versions of `driver` (one of the two constants above) holding all n tokens of the query."""
    return (
        "(SELECT d.memory_id, d.version, %(n)s::bigint AS hits FROM ("  # noqa: S608 - constant text
        + driver
        + ") d"
        " WHERE (SELECT count(*) FROM derived.keyword_postings q WHERE q.tenant_id = %(tenant)s"
        " AND q.token_mac = ANY(%(macs)s) AND q.memory_id = d.memory_id AND q.version = d.version) = %(n)s) AS c"
    )


_SEARCH_ALL_TOKENS = {
    (scope, several): visible_candidates_sql(_all_tokens(_DRIVERS if several else _ONE_DRIVER), scope)
    + " ORDER BY c.memory_id, c.version LIMIT %(limit)s"
    for scope in (None, *validation.SHARING_MODES)
    for several in (False, True)
}
_ALL_TOKENS_UP_TO = 50  # hybrid's 1,000 deep list is never all full matches: it counts at once
# A small scope (MemoryStore.small_scope): the postings of its versions are counted, a few index
# entries each, rather than the query tokens' posting lists across the whole tenant.
_AMONG = (
    "(SELECT p.memory_id, p.version, count(*) AS hits FROM unnest(%(m)s::text[], %(v)s::int[]) AS u(memory_id, version)"
    " JOIN derived.keyword_postings p ON p.tenant_id = %(tenant)s AND p.memory_id = u.memory_id"
    " AND p.version = u.version WHERE p.token_mac = ANY(%(macs)s) GROUP BY p.memory_id, p.version"
    ' ORDER BY hits DESC, p.memory_id COLLATE "C") AS c'
)
_SEARCH_AMONG = {
    scope: visible_candidates_sql(_AMONG, scope) + ' ORDER BY c.hits DESC, c.memory_id COLLATE "C" LIMIT %(limit)s'
    for scope in (None, *validation.SHARING_MODES)
}
_TOKEN = re.compile(r"\w+", re.UNICODE)
# Postings a sync writes before it measures again how often a token MAC repeats (a sample: tens of ms).
STATISTICS_AFTER = 1_000
_STOPWORDS = frozenset(
    "a an and are as at be but by for from has have he her his i in is it its me my of on or our she so "
    "that the their them they this to was we were what when where which who will with you your".split()
)


def tokens(text: str) -> set[str]:
    """Normalised tokens: NFKC, case-folded, word characters, stop words and 1-letter words dropped."""
    normal = unicodedata.normalize("NFKC", text).casefold()
    return {t for t in _TOKEN.findall(normal) if (len(t) > 1 or t.isdigit()) and t not in _STOPWORDS}


def author_only(cv: CurrentVersion) -> bool:
    """Seen by its author alone under every sharing mode: a personal memory's version not marked
    shareable (a team view admits personal memories only when shareable, in progressive mode)."""
    return cv.team_id is None and not cv.shareable


class KeywordIndex:
    """Sync and search of the tenant's blind keyword index."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def _key(self, tenant_id: str, *, create: bool = True) -> bytes:
        with self.store.transaction() as conn:
            return self.store.keys.tenant_subkey(conn, tenant_id, KEY_PURPOSE, create=create)

    @staticmethod
    def _legacy(conn: psycopg.Connection, tenant_id: str, sources: list[tuple[str, int]] | None = None) -> set[Source]:
        """Versions with postings an older release MACed under the tenant key though they are author-only
        (all of the tenant's, or those among `sources`): a partial index holds them alone."""
        if sources is None:
            return {(m, v) for m, v in conn.execute(_LEGACY, (tenant_id,))}
        return {(m, v) for m, v in conn.execute(_LEGACY_AMONG, (*lineage.pair_arrays(sources), tenant_id))}

    def sync(self, *, tenant_id: str) -> dict[str, int]:
        """Index every current version not yet indexed, and rewrite under its author's key each one an
        older release indexed under the tenant key; drop postings of versions no longer current."""
        current = {cv.record_id: cv for cv in self.store.current_versions(tenant_id=tenant_id)}
        with self.store.transaction() as conn:
            existing = lineage.records_of_store(conn, tenant_id=tenant_id, store=STORE)
            legacy = self._legacy(conn, tenant_id)
        stale = sorted(set(existing) - set(current))
        new = [cv for record_id, cv in current.items() if record_id not in existing or cv.source in legacy]
        nothing = {"records": len(current), "indexed": 0, "removed": 0, "postings_written": 0, "rekeyed": 0}
        if not stale and not new:
            return nothing
        try:
            key = self._key(tenant_id, create=False)  # derived writes never create keys
        except NotFoundError:
            return nothing
        stale = self._drop_stale(tenant_id, stale, existing)
        indexed = rekeyed = postings = 0
        for start in range(0, len(new), 2000):
            chunk_indexed, chunk_rekeyed, chunk_postings = self._index_chunk(tenant_id, key, new[start : start + 2000])
            indexed += chunk_indexed
            rekeyed += chunk_rekeyed
            postings += chunk_postings
        if postings >= STATISTICS_AFTER:  # how often a token MAC repeats, for the planner (no MAC kept)
            with self.store.transaction() as conn:
                table_partitions.sealed_statistics(conn, tenant_id, "derived.keyword_postings")
        return {
            "records": len(current),
            "indexed": indexed,
            "removed": len(stale),
            "postings_written": postings,
            "rekeyed": rekeyed,
        }

    def _drop_stale(self, tenant_id: str, stale: list[str], existing: dict[str, set[Source]]) -> list[str]:
        """Delete the postings and lineage of `stale` records; returns those dropped (not the hidden ones)."""
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
        return stale

    def _index_chunk(self, tenant_id: str, key: bytes, chunk: list[CurrentVersion]) -> tuple[int, int, int]:
        """Index one chunk of versions; (versions indexed, of them re-keyed, postings written)."""
        texts = self.store.open_texts(tenant_id=tenant_id, sources=[cv.source for cv in chunk], skip_unreadable=True)
        # Postings and their lineage commit together: a posting never exists without its edge;
        # nothing is indexed from a version forgotten since it was read.
        with self.store.transaction() as conn:
            hidden = ordering.guard_build(conn, tenant_id, [(cv.memory_id, cv.version, cv.epoch) for cv in chunk])
            # Syncs of one tenant in several processes (automation, the CLI) index disjointly:
            # one at a time per tenant, skipping what another indexed (or re-keyed) since we listed.
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 3))", ("keywords\x1f" + tenant_id,))
            done = set(
                lineage.records_of_ids(
                    conn, tenant_id=tenant_id, store=STORE, record_ids=[cv.record_id for cv in chunk]
                )
            )
            redo = self._legacy(conn, tenant_id, [cv.source for cv in chunk])
            chunk = [
                cv
                for cv in chunk
                if cv.source not in hidden and cv.source in texts and (cv.record_id not in done or cv.source in redo)
            ]
            authors = self.store.keys.subject_subkeys(
                conn, tenant_id, [cv.user_id for cv in chunk if author_only(cv)], KEY_PURPOSE
            )
            # Never the tenant key for an author-only version: one whose author's key was destroyed
            # since its text was read is the forget cascade's.
            chunk = [cv for cv in chunk if not author_only(cv) or cv.user_id in authors]
            postings = self._write_postings(conn, tenant_id, chunk, texts, tenant_key=key, author_keys=authors)
            lineage.insert_edges(
                conn, tenant_id=tenant_id, store=STORE, records=[(cv.record_id, cv.source) for cv in chunk]
            )
        return len(chunk), sum(cv.source in redo for cv in chunk), postings

    @staticmethod
    def _write_postings(
        conn: psycopg.Connection,
        tenant_id: str,
        chunk: list[CurrentVersion],
        texts: dict[Source, str],
        *,
        tenant_key: bytes,
        author_keys: dict[str, bytes],
    ) -> int:
        """Replace the postings of `chunk`'s versions with their tokens' MACs; returns postings written."""
        # Idempotent even where postings outlived their edge (an older release's restore):
        # a version's postings are replaced, never duplicated, never left under two keys.
        conn.execute(
            "DELETE FROM derived.keyword_postings p"
            " USING unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
            " WHERE p.tenant_id = %s AND p.memory_id = w.memory_id AND p.version = w.version",
            (*lineage.pair_arrays([cv.source for cv in chunk]), tenant_id),
        )
        postings = 0
        with (
            conn.cursor() as cur,
            cur.copy("COPY derived.keyword_postings (tenant_id, token_mac, memory_id, version) FROM STDIN") as copy,
        ):
            for cv in chunk:
                mac_key = author_keys[cv.user_id] if author_only(cv) else tenant_key
                for token in tokens(texts[cv.source]):
                    copy.write_row((tenant_id, crypto.mac(mac_key, token.encode()), cv.memory_id, cv.version))
                    postings += 1
        return postings

    def _macs(
        self, conn: psycopg.Connection, tenant_id: str, wanted: set[str], subjects: Iterable[str] = ()
    ) -> list[list[bytes]]:
        """Per token of `wanted` (sorted), its MAC under the tenant keyword key and under the keyword
        key of each of `subjects` whose subject key lives ([] when there is no token or no key left:
        nothing matches). Never creates a key."""
        if not wanted:
            return []
        keys: list[bytes] = []
        try:
            keys.append(self.store.keys.tenant_subkey(conn, tenant_id, KEY_PURPOSE, create=False))
        except NotFoundError:
            return []  # no tenant key (never indexed, or shredded): no subject key either
        keys += self.store.keys.subject_subkeys(conn, tenant_id, subjects, KEY_PURPOSE).values()
        return [[crypto.mac(key, token.encode()) for key in keys] for token in sorted(wanted)]

    def search(self, *, tenant_id: str, query: str, limit: int) -> list[tuple[tuple[str, int], float]]:
        """(memory_id, version) with the share of the query's tokens they contain, best first (every
        indexed version, visible or not: `search_visible` is what recall uses).

        With no user to search for, the query is MACed under every subject's key as well as the
        tenant's: one key lookup and one MAC a token per subject of the tenant (for evaluation,
        benchmarks and tests; recall never comes here)."""
        with self.store.transaction() as conn:
            subjects = [
                r[0] for r in conn.execute("SELECT user_id FROM memory.subjects WHERE tenant_id = %s", (tenant_id,))
            ]
            groups = self._macs(conn, tenant_id, tokens(query), subjects)
            if not groups:
                return []
            macs = [mac for group in groups for mac in group]
            rows = conn.execute(_SEARCH, {"tenant": tenant_id, "macs": macs, "limit": limit}).fetchall()
        return [((memory_id, version), hits / len(groups)) for memory_id, version, hits in rows]

    def search_visible(
        self,
        *,
        tenant_id: str,
        user_id: str,
        team_id: str | None,
        query: str,
        limit: int,
        small_scope: int = 0,
    ) -> list[tuple[tuple[str, int], float, dict[str, Any]]]:
        """Like `search`, among the versions the user sees only (current, not hidden, in scope: the
        store's rules, in the same SQL), so LIMIT counts visible answers. Each hit carries its row
        (user_id, team_id, category, subject_epoch), as `MemoryStore.confirm_visible` gives it.
        A scope of at most `small_scope` memories is searched among its own versions alone (few of
        the tenant's best candidates would be in it)."""
        with self.store.transaction() as conn:
            scope = self.store.check_scope(conn, tenant_id, user_id, team_id)
            # Only a personal view holds author-only versions (the user's own): a team view never
            # asks the user's key, and asks exactly what it asked before.
            groups = self._macs(conn, tenant_id, tokens(query), [user_id] if scope is None else ())
            if not groups:
                return []
            n = len(groups)
            macs = [mac for group in groups for mac in group]
            among = None
            if small_scope:
                among = self.store.scope_versions(conn, scope, tenant_id, user_id, team_id, cap=small_scope)
            if among == []:
                return []
            params = {
                "tenant": tenant_id,
                "user": user_id,
                "team": team_id,
                "macs": macs,
                "keys": len(groups[0]),  # MACs a token, token after token in `macs`; no statement names it
                "limit": limit,
            }
            with conn.cursor(row_factory=dict_row) as cur:
                if among is not None:
                    versions = {"m": [m for m, _ in among], "v": [v for _, v in among]}
                    rows = cur.execute(_SEARCH_AMONG[scope], {**params, **versions}).fetchall()
                    return [((r["memory_id"], r["version"]), r["hits"] / n, r) for r in rows]
                rows = self._full_matches(cur, scope, params) if limit <= _ALL_TOKENS_UP_TO else []
                if len(rows) < limit:
                    rows = cur.execute(_SEARCH_VISIBLE[scope], {**params, "depth": 4 * limit + 50}).fetchall()
                if len(rows) < limit:  # too few visible among the best: every candidate, then (LIMIT NULL)
                    rows = cur.execute(_SEARCH_VISIBLE[scope], {**params, "depth": None}).fetchall()
        return [((r["memory_id"], r["version"]), r["hits"] / n, r) for r in rows]

    @staticmethod
    def _full_matches(cur: psycopg.Cursor[Any], scope: str | None, params: dict[str, Any]) -> list[dict[str, Any]]:
        """The first LIMIT visible versions holding every token, if the rarest token's first postings
        (20 x LIMIT + 100 of them, under each key) hold that many; else fewer, and the caller counts
        every posting."""
        macs, keys = params["macs"], params.get("keys", 1)
        groups = [macs[i : i + keys] for i in range(0, len(macs), keys)]
        params = {**params, "n": len(groups), "scan": 20 * params["limit"] + 100}
        seen = {bytes(r["mac"]): r["seen"] for r in cur.execute(_RARITY, params).fetchall()}
        rarest = min(groups, key=lambda group: sum(seen.get(mac, 0) for mac in group))
        drivers = [mac for mac in rarest if seen.get(mac)]  # a key with no such posting walks nothing
        if not drivers:
            return []  # a token no version holds: no full match
        if len(drivers) == 1:
            return cur.execute(_SEARCH_ALL_TOKENS[(scope, False)], {**params, "driver": drivers[0]}).fetchall()
        return cur.execute(_SEARCH_ALL_TOKENS[(scope, True)], {**params, "drivers": drivers}).fetchall()

    def probe_hits(
        self, *, tenant_id: str, texts: list[str], sources: set[tuple[str, int]], subjects: Iterable[str] = ()
    ) -> int:
        """Postings of `sources` reachable from any token of `texts` (one query for every probe), MACed
        under the tenant key and the key of each of `subjects` and of the sources' authors the store
        still names, while their subject keys live (a destroyed one leaves nothing to probe with; the
        exact-id count finds every posting of a source, whatever its key)."""
        wanted = set().union(*(tokens(text) for text in texts)) if texts else set()
        if not wanted or not sources:
            return 0
        memory_ids, versions = lineage.pair_arrays(sorted(sources))
        with self.store.transaction() as conn:
            authors = [
                r[0]
                for r in conn.execute(
                    "SELECT DISTINCT user_id FROM memory.memories WHERE tenant_id = %s AND memory_id = ANY(%s)",
                    (tenant_id, sorted(set(memory_ids))),
                )
            ]
            groups = self._macs(conn, tenant_id, wanted, {*subjects, *authors})
            if not groups:
                return 0
            row = conn.execute(
                "SELECT count(*) FROM derived.keyword_postings p"
                " JOIN unnest(%s::text[], %s::int[]) AS s(memory_id, version)"
                " ON p.memory_id = s.memory_id AND p.version = s.version"
                " WHERE p.tenant_id = %s AND p.token_mac = ANY(%s)",
                (memory_ids, versions, tenant_id, [mac for group in groups for mac in group]),
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
