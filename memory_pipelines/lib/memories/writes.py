"""Writes: a new memory or a new version of one, sealed under a key of its own, with the no-op rule
(identical text and fields to a current version write nothing), bulk writes (lib/memories/bulk_write.py),
and the do-not-sell flags (CCPA opt-out) of a memory or a subject.
"""

from __future__ import annotations

from typing import Any

import psycopg

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import NotFoundError, PermissionDeniedError, ValidationError
from memory_pipelines.lib.memories import consent, crypto, ordering, tenants
from memory_pipelines.lib.memories.bulk_write import BulkWriter, check_items
from memory_pipelines.lib.memories.connections import Connections
from memory_pipelines.lib.memories.keys import KeyStore
from memory_pipelines.lib.memories.records import WriteResult
from memory_pipelines.lib.memories.sealing import Sealing
from memory_pipelines.lib.memories.teams import require_member
from memory_pipelines.lib.memories.version_keys import NewVersionKey
from memory_pipelines.lib.memories.versions import (
    Versions,
    next_version,
    read_head,
    require_author,
    supersede_and_point,
)
from memory_pipelines.lib.memories.write_rules import DEFAULT_CATEGORY, DEFAULT_CONFIDENCE, SAME_TEXT
from memory_pipelines.lib.results import DoNotSell

__all__ = [
    "DEFAULT_CATEGORY",
    "DEFAULT_CONFIDENCE",
    "Writes",
]


def _write_target(
    conn: psycopg.Connection, tenant_id: str, user_id: str, memory_id: str | None, team_id: str | None
) -> tuple[dict[str, Any] | None, str | None]:
    """The head a write lands on when `memory_id` names one (else None) and the team it writes in
    (a new version stays in its memory's team). Creates tenant and subject as needed; refuses a
    write its author may not make (not the memory's author, not a member of the team)."""
    head = None
    if memory_id is not None:
        head = _head_for_write(conn, tenant_id, user_id, memory_id, team_id)
        team_id = head["team_id"]
    else:
        tenants.ensure_tenant(conn, tenant_id)
    tenants.ensure_subject(conn, tenant_id, user_id)
    if team_id is not None:
        require_member(conn, tenant_id, team_id, user_id)
    return head, team_id


def _head_for_write(
    conn: psycopg.Connection, tenant_id: str, user_id: str, memory_id: str, team_id: str | None
) -> dict[str, Any]:
    tenants.tenant_mode(conn, tenant_id)
    head = read_head(conn, tenant_id, memory_id, lock=True)
    if head["user_id"] != user_id:
        raise PermissionDeniedError(
            "memory_id", f"memory {memory_id} belongs to another user; only its author writes new versions"
        )
    if team_id is not None and head["team_id"] != team_id:
        where = "is personal" if head["team_id"] is None else f"belongs to team {head['team_id']!r}"
        raise ValidationError("team", f"memory {memory_id} {where}; a new version cannot move it")
    return head


def _head_by_mac(
    conn: psycopg.Connection, tenant_id: str, user_id: str, team_id: str | None, text_mac: bytes
) -> dict[str, Any] | None:
    # Two indexed lookups rather than one join: on a young table without statistics the
    # planner picked a nested loop over every memory of the tenant (O(n) per write).
    # A memory being forgotten is never the same memory (see write_many).
    candidates = conn.execute(SAME_TEXT, (tenant_id, text_mac)).fetchall()
    for (memory_id,) in candidates:
        try:
            head = read_head(conn, tenant_id, memory_id, lock=True)
        except NotFoundError:
            continue  # hidden or gone since the lookup
        if head["user_id"] == user_id and head["team_id"] == team_id:
            return head
    return None


class Writes:
    """Single and bulk writes, and do-not-sell flags: rows made by `versions`, keys from `keys`."""

    def __init__(self, connections: Connections, keys: KeyStore, sealing: Sealing, versions: Versions) -> None:
        self.connections = connections
        self.keys = keys
        self.sealing = sealing
        self.versions = versions

    def write(
        self,
        *,
        tenant_id: str,
        user_id: str,
        text: str,
        memory_id: str | None = None,
        team_id: str | None = None,
        shareable: bool | None = None,
        category: str | None = None,
        confidence: float | None = None,
        original_query: str | None = None,
        do_not_sell: bool | None = None,
    ) -> WriteResult:
        """Write a memory or a new version of one. Unspecified fields keep the current version's values.

        Identical text and fields to the current version (of `memory_id`, or of any of the
        subject's memories in the same team scope when no id is given) is a no-op.
        """
        validation.check_id("tenant", tenant_id)
        validation.check_id("user", user_id)
        validation.check_text("text", text)
        if memory_id is not None:
            validation.check_memory_id("memory_id", memory_id)
        validation.check_optional_id("team", team_id)
        if category is not None:
            validation.check_category(category)
        if confidence is not None:
            confidence = validation.check_confidence(confidence)
        if original_query is not None:
            validation.check_text("original_query", original_query)
        validation.check_optional_bool("shareable", shareable)
        validation.check_optional_bool("do_not_sell", do_not_sell)

        with self.connections.transaction() as conn:
            # Ordered against deletion acceptance and the restore gate (lib/memories/ordering.py); then
            # serialised per subject, so two identical concurrent writes make one memory.
            ordering.lock_writer(conn, tenant_id, user_id)
            head, team_id = _write_target(conn, tenant_id, user_id, memory_id, team_id)
            # The subject key MACs the text (the no-op rule); the text is sealed under a key of its version.
            _, key, (version_key,) = self.keys.for_writes(conn, tenant_id, {user_id: 1})[user_id]
            text_mac = crypto.mac(crypto.derive_key(key, b"memory-text-mac"), text.encode("utf-8"))
            if head is None:
                head = _head_by_mac(conn, tenant_id, user_id, team_id, text_mac)
            if head is None:
                result = self._insert_new(
                    conn,
                    tenant_id=tenant_id,
                    user_id=user_id,
                    team_id=team_id,
                    version_key=version_key,
                    text=text,
                    text_mac=text_mac,
                    shareable=bool(shareable),
                    category=category or DEFAULT_CATEGORY,
                    confidence=DEFAULT_CONFIDENCE if confidence is None else confidence,
                    original_query=original_query,
                    do_not_sell=bool(do_not_sell),
                )
            else:
                result = self._insert_version(
                    conn,
                    head=head,
                    version_key=version_key,
                    text=text,
                    text_mac=text_mac,
                    shareable=shareable,
                    category=category,
                    confidence=confidence,
                    original_query=original_query,
                    do_not_sell=do_not_sell,
                )
            if result.changed:
                tenants.bump(conn, tenant_id)
            return result

    def write_many(self, *, tenant_id: str, items: list[dict[str, Any]]) -> list[WriteResult]:
        """Bulk-write new memories (no `memory_id`); results in item order.

        Each item has `user_id`, `text` and optionally `team_id`, `shareable`, `category`,
        `confidence`, `original_query`, `do_not_sell`. The no-op rule holds as for `write`: an
        item identical to a current memory of its author in the same scope returns that memory.
        Every item is checked before anything is written; the write commits in chunks (see
        lib/memories/bulk_write.py), and one stopped part way raises `PartialWriteError` naming what landed.
        """
        validation.check_id("tenant", tenant_id)
        return BulkWriter(self.connections, self.keys, tenant_id).write(check_items(items))

    def _insert_new(
        self,
        conn: psycopg.Connection,
        *,
        tenant_id: str,
        user_id: str,
        team_id: str | None,
        version_key: NewVersionKey,
        text: str,
        text_mac: bytes,
        shareable: bool,
        category: str,
        confidence: float,
        original_query: str | None,
        do_not_sell: bool,
    ) -> WriteResult:
        memory_id = validation.new_memory_id()
        memory_type = "personal" if team_id is None else "team_shared"
        self.versions.insert_version_row(
            conn,
            tenant_id=tenant_id,
            memory_id=memory_id,
            version=1,
            key=version_key,
            text=text,
            text_mac=text_mac,
            shareable=shareable,
            category=category,
            confidence=confidence,
            original_query=original_query,
            restored_from=None,
            memory={"user": user_id, "team": team_id, "type": memory_type, "dns": do_not_sell},
        )
        return WriteResult(tenant_id, memory_id, 1, user_id, team_id, True)

    def _insert_version(
        self,
        conn: psycopg.Connection,
        *,
        head: dict[str, Any],
        version_key: NewVersionKey,
        text: str,
        text_mac: bytes,
        shareable: bool | None,
        category: str | None,
        confidence: float | None,
        original_query: str | None,
        do_not_sell: bool | None,
    ) -> WriteResult:
        tenant_id, memory_id = head["tenant_id"], head["memory_id"]
        new_fields: dict[str, Any] = {
            "shareable": head["shareable"] if shareable is None else shareable,
            "category": head["category"] if category is None else category,
            "confidence": head["confidence"] if confidence is None else confidence,
        }
        flags_changed = do_not_sell is not None and do_not_sell != head["do_not_sell"]
        if flags_changed:
            conn.execute(
                "UPDATE memory.memories SET do_not_sell = %s, updated_at = now() "
                "WHERE tenant_id = %s AND memory_id = %s",
                (do_not_sell, tenant_id, memory_id),
            )
            consent.record(conn, tenant_id, "MEMORY_DO_NOT_SELL", memory_id=memory_id, flag=do_not_sell)
        head_version = {**head, "version": head["current_version"]}
        same_query = original_query is None or original_query == self.sealing.open_query(conn, head_version)
        same = (
            bytes(head["text_mac"]) == text_mac
            and same_query
            and all(new_fields[name] == head[name] for name in new_fields)
        )
        if same:
            return WriteResult(
                tenant_id, memory_id, head["current_version"], head["user_id"], head["team_id"], flags_changed
            )
        version = next_version(conn, tenant_id, memory_id, head["current_version"])
        supersede_and_point(conn, tenant_id, memory_id, version)
        self.versions.insert_version_row(
            conn,
            tenant_id=tenant_id,
            memory_id=memory_id,
            version=version,
            key=version_key,
            text=text,
            text_mac=text_mac,
            original_query=self.sealing.open_query(conn, head_version) if original_query is None else original_query,
            restored_from=None,
            **new_fields,
        )
        return WriteResult(tenant_id, memory_id, version, head["user_id"], head["team_id"], True)

    def set_do_not_sell(
        self,
        *,
        tenant_id: str,
        user_id: str,
        value: bool = True,
        memory_id: str | None = None,
        subject: str | None = None,
    ) -> DoNotSell:
        """CCPA opt-out for one memory or for every memory of a subject (present and future).

        `user_id` is the acting user: a memory's author flags it, a subject flags themselves.
        """
        validation.check_id("tenant", tenant_id)
        validation.check_id("user", user_id)
        validation.check_bool("value", value)
        if (memory_id is None) == (subject is None):
            raise ValidationError("memory_id", "give exactly one of memory_id or subject")
        if subject is not None:
            validation.check_id("subject", subject)
            if subject != user_id:
                raise PermissionDeniedError("subject", "only the subject sets their own do-not-sell flag")
        with self.connections.transaction() as conn:
            tenants.tenant_mode(conn, tenant_id)
            if memory_id is not None:
                validation.check_memory_id("memory_id", memory_id)
                head = read_head(conn, tenant_id, memory_id, lock=True)
                require_author(head, user_id, "sets its do-not-sell flag")
                conn.execute(
                    "UPDATE memory.memories SET do_not_sell = %s, updated_at = now() "
                    "WHERE tenant_id = %s AND memory_id = %s",
                    (value, tenant_id, memory_id),
                )
                consent.record(conn, tenant_id, "MEMORY_DO_NOT_SELL", memory_id=memory_id, flag=value)
                result: DoNotSell = {"tenant_id": tenant_id, "memory_id": memory_id, "do_not_sell": value}
            else:
                assert subject is not None
                tenants.ensure_subject(conn, tenant_id, subject)
                conn.execute(
                    "UPDATE memory.subjects SET do_not_sell = %s WHERE tenant_id = %s AND user_id = %s",
                    (value, tenant_id, subject),
                )
                consent.record(conn, tenant_id, "SUBJECT_DO_NOT_SELL", subject_id=subject, flag=value)
                result = {"tenant_id": tenant_id, "subject": subject, "do_not_sell": value}
            tenants.bump(conn, tenant_id)
        return result
