"""Bulk writes of new memories in chunks that each commit on their own, so a deletion never waits long.

A chunk's transaction holds the tenant's gate lock (shared) only for database work: keys are
fetched and made (a version key per item, lib/memories/version_keys.py) and texts sealed and MACed
before it opens. A deletion's acceptance (the gate, exclusive)
therefore waits for at most one chunk, about `CHUNK_ITEMS` rows of COPY. Planner statistics are
refreshed whenever the tenant has doubled since the last ANALYZE: a plan made for an empty
partition probes the foreign keys through the wrong index, and costs grow with every row.

The first chunk checks every subject and team of the whole batch, so a refusal known at the start
writes nothing. A refusal that only arises later (a subject forgotten mid-write) stops the write
with `PartialWriteError`, naming what was written; the same items can be written again safely:
those already stored come back unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from memory_pipelines.lib.infra import faults, validation
from memory_pipelines.lib.infra.errors import (
    ConflictError,
    MemoryPipelinesError,
    PartialWriteError,
    ServiceError,
    ValidationError,
)
from memory_pipelines.lib.memories import crypto, ordering, table_partitions, tenants
from memory_pipelines.lib.memories.connections import Connections
from memory_pipelines.lib.memories.keys import KeyStore
from memory_pipelines.lib.memories.records import WriteResult
from memory_pipelines.lib.memories.sealing import query_aad, text_aad
from memory_pipelines.lib.memories.teams import require_member
from memory_pipelines.lib.memories.version_keys import NewVersionKey
from memory_pipelines.lib.memories.write_rules import DEFAULT_CATEGORY, DEFAULT_CONFIDENCE, SAME_TEXTS

__all__ = [
    "CHUNK_ITEMS",
    "FIELDS",
    "FIRST_ANALYZE",
    "HOLD_SECONDS",
    "BulkWriter",
    "check_items",
]

# A chunk holds the gate about this long (its size follows the measured cost per item, within the
# bounds): a deletion's acceptance waits for one chunk at most. 250 items took 26 ms here.
HOLD_SECONDS = 0.012
CHUNK_ITEMS = (25, 100, 2000)  # smallest, first, largest
# A tenant this small is analyzed once it reaches this size; after that, whenever it doubles.
FIRST_ANALYZE = 1000
FIELDS = frozenset(
    {"user_id", "text", "team_id", "shareable", "category", "confidence", "original_query", "do_not_sell"}
)
_KEY_RETRIES = 3


@dataclass(frozen=True)
class _Sealed:
    """One item ready to COPY: its fields, sealed under its version's key, MACed under its author's."""

    user_id: str
    team_id: str | None
    text_mac: bytes
    subject_key_id: str
    version_key: NewVersionKey
    head: tuple[Any, ...]
    version: tuple[Any, ...]


def check_items(items: object) -> list[dict[str, Any]]:
    """Every item of a bulk write, checked (types exactly) before anything is written."""
    checked = validation.check_items("items", items)
    for n, item in enumerate(checked):
        field = f"items[{n}]"
        unknown = set(item) - FIELDS
        if unknown:
            raise ValidationError(f"{field}.{sorted(unknown)[0]}", "is not a memory field")
        validation.check_id(f"{field}.user_id", item.get("user_id"))
        validation.check_text(f"{field}.text", item.get("text"))
        validation.check_optional_id(f"{field}.team_id", item.get("team_id"))
        if item.get("category") is not None:
            validation.check_category(item["category"], f"{field}.category")
        if item.get("confidence") is not None:
            item["confidence"] = validation.check_confidence(item["confidence"], f"{field}.confidence")
        validation.check_optional_text(f"{field}.original_query", item.get("original_query"))
        validation.check_optional_bool(f"{field}.shareable", item.get("shareable"))
        validation.check_optional_bool(f"{field}.do_not_sell", item.get("do_not_sell"))
    return checked


class BulkWriter:
    """Writes one batch of new memories of one tenant, chunk by chunk (see the module docstring), on
    `connections`, with keys from `keys`."""

    def __init__(
        self, connections: Connections, keys: KeyStore, tenant_id: str, *, hold_seconds: float = HOLD_SECONDS
    ) -> None:
        self.connections = connections
        self.keys = keys
        self.tenant_id = tenant_id
        self.hold_seconds = hold_seconds
        self._subject_keys: dict[str, tuple[str, bytes]] = {}
        self._mac_keys: dict[str, bytes] = {}

    def write(self, items: list[dict[str, Any]]) -> list[WriteResult]:
        """Write checked items; results in item order."""
        results: list[WriteResult] = []
        if not items:
            return results
        size = self._check(items)  # everything known now is refused before anything lands
        analyze_at = max(FIRST_ANALYZE, 2 * size)
        smallest, size_now, largest = CHUNK_ITEMS
        start = 0
        while start < len(items):
            chunk = items[start : start + size_now]
            try:
                written, new, held = self._write_chunk(chunk)
            except (MemoryPipelinesError, psycopg.Error) as exc:
                if not results:
                    raise
                cause = exc if isinstance(exc, MemoryPipelinesError) else ServiceError("postgres", str(exc))
                raise PartialWriteError(cause, written=[r.as_dict() for r in results], total=len(items)) from exc
            results.extend(written)
            faults.point("write_many.chunk_committed")
            start += len(chunk)
            size_now = min(largest, max(smallest, int(len(chunk) * self.hold_seconds / max(held, 1e-4))))
            size += new
            if size >= analyze_at:
                with self.connections.transaction() as conn:
                    table_partitions.analyze_tenant(conn, self.tenant_id)
                analyze_at = 2 * size
        return results

    def _check(self, items: Sequence[dict[str, Any]]) -> int:
        """Refuses what is known now; returns the planner's estimate of the tenant's versions."""
        with self.connections.transaction() as conn:
            ordering.lock_tenant_shared(conn, self.tenant_id)
            self._lock_and_check(conn, items)
            return table_partitions.estimated_rows(conn, self.tenant_id, "memory.memory_versions")

    def _lock_and_check(self, conn: psycopg.Connection, items: Sequence[dict[str, Any]]) -> None:
        """Under the gate: the tenant is open, no author is being forgotten, every team author is a
        member (held FOR SHARE until commit, so a removal waits)."""
        tenant_id = self.tenant_id
        tenants.ensure_tenant(conn, tenant_id)
        users = sorted({item["user_id"] for item in items})
        # The same per-subject lock as a single write, so identical concurrent writes make one memory.
        conn.execute(
            "SELECT count(pg_advisory_xact_lock(hashtextextended(k, 0)))"
            " FROM (SELECT %s || chr(31) || u AS k FROM unnest(%s::text[]) AS u ORDER BY 1) AS l",
            (tenant_id, users),
        )
        # Under the gate no acceptance can mark a subject: a plain read is enough, no row is rewritten.
        conn.execute(
            "INSERT INTO memory.subjects (tenant_id, user_id) SELECT %s, unnest(%s::text[])"
            " ON CONFLICT (tenant_id, user_id) DO NOTHING",
            (tenant_id, users),
        )
        forgotten = conn.execute(
            "SELECT user_id, forgotten_at IS NOT NULL FROM memory.subjects WHERE tenant_id = %s AND user_id = ANY(%s)",
            (tenant_id, users),
        ).fetchall()
        for user_id in sorted(u for u, gone in forgotten if gone)[:1]:
            raise ConflictError(
                "user", f"subject {user_id!r} is being forgotten; writes resume when that job completes"
            )
        pairs = sorted({(i["team_id"], i["user_id"]) for i in items if i.get("team_id")})
        if not pairs:
            return
        members = conn.execute(
            "SELECT team_id, user_id FROM memory.team_members WHERE tenant_id = %s"
            " AND (team_id, user_id) IN (SELECT * FROM unnest(%s::text[], %s::text[])) FOR SHARE",
            (tenant_id, [t for t, _ in pairs], [u for _, u in pairs]),
        ).fetchall()
        found = {(str(t), str(u)) for t, u in members}
        for team_id, user_id in pairs:
            if (team_id, user_id) not in found:
                require_member(conn, tenant_id, team_id, user_id)  # raises the usual error

    def _write_chunk(self, chunk: list[dict[str, Any]]) -> tuple[list[WriteResult], int, float]:
        """Seals and commits one chunk; returns its results, how many are new, and how long it held the gate."""
        for _ in range(_KEY_RETRIES):
            sealed = self._seal(chunk)
            began = time.perf_counter()
            written = self._commit(chunk, sealed)
            if written is not None:
                return (*written, time.perf_counter() - began)
            self._subject_keys.clear()  # a key was destroyed since it was fetched: fetch again, seal again
            self._mac_keys.clear()
        raise ConflictError("user", "an author's key kept being destroyed during the write; try again")

    def _seal(self, chunk: list[dict[str, Any]]) -> list[_Sealed]:
        """Outside any lock: new ids, sealed texts and text MACs for every item of the chunk."""
        wanted: dict[str, int] = {}
        for item in chunk:
            wanted[item["user_id"]] = wanted.get(item["user_id"], 0) + 1
        memory_ids = [validation.new_memory_id() for _ in chunk]
        # The authors' subject keys and version keys (one statement, and more when keys or groups are
        # made); the version keys commit here, before their rows, out of the gate's hold: an erasure's
        # rekey of their group from now on rewraps them with its other members, and those of items the
        # commit finds already written are deleted there. A subject destroyed meanwhile takes them along
        # (its groups go), and the commit finds its subject key changed.
        with self.connections.transaction() as conn:
            # No flush of its own: the chunk's commit flushes the WAL up to itself, these keys included;
            # a crash before it loses keys that no row names.
            conn.execute("SET LOCAL synchronous_commit = off")
            made = self.keys.for_writes(conn, self.tenant_id, wanted)
            for user_id, keys in made.items():
                self._subject_keys[user_id] = (keys.subject_key_id, keys.subject_key)
            version_keys = [made[item["user_id"]].version_keys.pop() for item in chunk]
            rows = [(key, memory_id, 1) for key, memory_id in zip(version_keys, memory_ids, strict=True)]
            self.keys.versions.insert(conn, self.tenant_id, rows)
        tenant_id = self.tenant_id
        sealed = []
        for item, memory_id, version_key in zip(chunk, memory_ids, version_keys, strict=True):
            user_id, team_id = item["user_id"], item.get("team_id")
            subject_key_id, subject_key = self._subject_keys[user_id]
            key = version_key.key
            mac_key = self._mac_keys.get(subject_key_id)  # by key: a conversion may replace the subject's
            if mac_key is None:
                mac_key = self._mac_keys[subject_key_id] = crypto.derive_key(subject_key, b"memory-text-mac")
            query = item.get("original_query")
            text_mac = crypto.mac(mac_key, item["text"].encode("utf-8"))
            sealed.append(
                _Sealed(
                    user_id=user_id,
                    team_id=team_id,
                    text_mac=text_mac,
                    subject_key_id=subject_key_id,
                    version_key=version_key,
                    head=(
                        tenant_id,
                        memory_id,
                        user_id,
                        team_id,
                        "personal" if team_id is None else "team_shared",
                        bool(item.get("do_not_sell")),
                        1,
                    ),
                    version=(
                        tenant_id,
                        memory_id,
                        1,
                        bool(item.get("shareable")),
                        item.get("category") or DEFAULT_CATEGORY,
                        DEFAULT_CONFIDENCE if item.get("confidence") is None else item["confidence"],
                        crypto.seal(key, item["text"].encode("utf-8"), text_aad(tenant_id, memory_id, 1)),
                        text_mac,
                        None
                        if query is None
                        else crypto.seal(key, query.encode("utf-8"), query_aad(tenant_id, memory_id, 1)),
                        version_key.key_id,
                    ),
                )
            )
        return sealed

    def _commit(self, chunk: list[dict[str, Any]], sealed: list[_Sealed]) -> tuple[list[WriteResult], int] | None:
        """One transaction under the gate: checks, no-op detection, COPY. None when a key is gone."""
        tenant_id = self.tenant_id
        with self.connections.transaction() as conn:
            ordering.lock_tenant_shared(conn, tenant_id)
            self._lock_and_check(conn, chunk)
            key_ids = sorted({s.subject_key_id for s in sealed})
            # FOR KEY SHARE: a key cannot be destroyed under MACs this transaction commits.
            alive = conn.execute(
                "SELECT key_id FROM keystore.subject_keys WHERE tenant_id = %s AND key_id = ANY(%s) FOR KEY SHARE",
                (tenant_id, key_ids),
            ).fetchall()
            if len(alive) != len(key_ids):
                return None
            existing: dict[tuple[str, str | None, bytes], tuple[str, int]] = {}
            # Only visible memories are the same memory: one being forgotten is gone once its job
            # completes, so an identical text is a new memory (the gate lock orders this read).
            for memory_id, version, user_id, team_id, text_mac in conn.execute(
                SAME_TEXTS, (tenant_id, [s.text_mac for s in sealed])
            ):
                existing[(user_id, team_id, bytes(text_mac))] = (memory_id, version)
            results, heads, versions, unused = [], [], [], []
            for s in sealed:
                found = existing.get((s.user_id, s.team_id, s.text_mac))
                if found is not None:
                    results.append(WriteResult(tenant_id, found[0], found[1], s.user_id, s.team_id, False))
                    unused.append(s.version_key.key_id)
                    continue
                memory_id = s.head[1]
                existing[(s.user_id, s.team_id, s.text_mac)] = (memory_id, 1)
                heads.append(s.head)
                versions.append(s.version)
                results.append(WriteResult(tenant_id, memory_id, 1, s.user_id, s.team_id, True))
            if unused:  # made for items that were already written: never to seal anything
                conn.execute(
                    "DELETE FROM keystore.version_keys WHERE tenant_id = %s AND key_id = ANY(%s)", (tenant_id, unused)
                )
            if heads:
                with conn.cursor() as cur:
                    with cur.copy(
                        "COPY memory.memories (tenant_id, memory_id, user_id, team_id, memory_type, do_not_sell,"
                        " current_version) FROM STDIN"
                    ) as copy:
                        for head in heads:
                            copy.write_row(head)
                    with cur.copy(
                        "COPY memory.memory_versions (tenant_id, memory_id, version, shareable, category,"
                        " confidence, text_ct, text_mac, original_query_ct, key_id) FROM STDIN"
                    ) as copy:
                        for row in versions:
                            copy.write_row(row)
                tenants.bump(conn, tenant_id)
        return results, len(heads)
