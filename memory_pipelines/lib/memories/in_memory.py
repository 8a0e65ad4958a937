"""An in-memory memory store, for unit tests of the logic that reads one (as httpx's `MockTransport`
stands in for a network): the rules of who sees what, what a deletion hides, and what retention
takes, written once more as plain Python over plain records.

It keeps no keys and seals nothing, so it proves nothing about storage; it answers the same
questions as `MemoryStore` (through the Protocols in lib/memories/protocol.py and
lib/retention/rules.py), and tests/integration/test_in_memory_conformance.py runs one scenario on
both and requires equal answers, so a rule changed in the SQL and not here (or the reverse) fails.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import NotFoundError, PermissionDeniedError
from memory_pipelines.lib.memories.records import WriteResult
from memory_pipelines.lib.memories.write_rules import DEFAULT_CATEGORY, DEFAULT_CONFIDENCE
from memory_pipelines.lib.results import TeamMemberAdded, TenantMode, VisibleMemory

__all__ = ["InMemoryStore", "Memory", "Version", "sees"]


@dataclass
class Version:
    version: int
    text: str
    category: str
    shareable: bool
    confidence: float
    created_at: datetime


@dataclass
class Memory:
    tenant_id: str
    memory_id: str
    user_id: str
    team_id: str | None
    created_at: datetime
    versions: list[Version] = field(default_factory=list)

    @property
    def current(self) -> Version:
        return self.versions[-1]


def sees(memory: Memory, *, user_id: str, team_id: str | None, mode: str, members: Iterable[str]) -> bool:
    """The scope rule of one view (lib/memories/visibility.py's _VISIBLE_WHERE): a personal view sees the
    user's own personal memories; a team view by the tenant's mode sees the user's own team memories
    (strict), every team memory (shared_pool), or those plus members' shareable personal ones
    (progressive)."""
    if team_id is None:
        return memory.user_id == user_id and memory.team_id is None
    if mode == "strict":
        return memory.team_id == team_id and memory.user_id == user_id
    if mode == "shared_pool":
        return memory.team_id == team_id
    return memory.team_id == team_id or (
        memory.team_id is None and memory.current.shareable and memory.user_id in set(members)
    )


@dataclass
class _Subject:
    epoch: int = 1
    forgotten: bool = False


@dataclass
class _Tenant:
    mode: str
    closed: bool = False  # deleted, or behind a restore's gate


class InMemoryStore:
    """Tenants, teams, subjects, versioned memories and tombstones in dicts; `now` dates new writes."""

    def __init__(self, *, now: datetime | None = None) -> None:
        self.now = now or datetime.now(UTC)
        self.memories: dict[tuple[str, str], Memory] = {}
        self.tombstones: set[tuple[str, str, int]] = set()
        self._tenants: dict[str, _Tenant] = {}
        self._subjects: dict[tuple[str, str], _Subject] = {}
        self._members: dict[tuple[str, str], list[str]] = {}

    # -- the questions MemoryStore answers ------------------------------------------------------

    def create_tenant(self, *, tenant_id: str, sharing_mode: str = "strict") -> TenantMode:
        validation.check_id("tenant", tenant_id)
        validation.check_sharing_mode(sharing_mode)
        self._tenants.setdefault(tenant_id, _Tenant(sharing_mode)).mode = sharing_mode
        return {"tenant_id": tenant_id, "sharing_mode": sharing_mode}

    def set_sharing_mode(self, *, tenant_id: str, sharing_mode: str) -> TenantMode:
        validation.check_sharing_mode(sharing_mode)
        self._open(tenant_id).mode = sharing_mode
        return {"tenant_id": tenant_id, "sharing_mode": sharing_mode}

    def add_team_member(self, *, tenant_id: str, team_id: str, user_id: str) -> TeamMemberAdded:
        validation.check_id("team", team_id)
        validation.check_id("user", user_id)
        self._tenants.setdefault(tenant_id, _Tenant("strict"))
        self._subjects.setdefault((tenant_id, user_id), _Subject())
        members = self._members.setdefault((tenant_id, team_id), [])
        added = user_id not in members
        if added:
            members.append(user_id)
        return {
            "tenant_id": tenant_id,
            "team_id": team_id,
            "user_id": user_id,
            "added": added,
            "members": sorted(members),
        }

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
    ) -> WriteResult:
        """A new memory, or with `memory_id` a new version of one (fields left None keep the current
        version's); the same text and fields as the current version change nothing."""
        validation.check_id("tenant", tenant_id)
        validation.check_id("user", user_id)
        validation.check_text("text", text)
        if category is not None:
            validation.check_category(category)
        self._tenants.setdefault(tenant_id, _Tenant("strict"))
        self._subjects.setdefault((tenant_id, user_id), _Subject())
        self._open(tenant_id)
        if memory_id is None:
            if team_id is not None:
                self._require_member(tenant_id, team_id, user_id)
            memory = Memory(tenant_id, str(uuid.uuid4()), user_id, team_id, self.now)
            memory.versions.append(
                Version(
                    1,
                    text,
                    category or DEFAULT_CATEGORY,
                    bool(shareable),
                    DEFAULT_CONFIDENCE if confidence is None else confidence,
                    self.now,
                )
            )
            self.memories[(tenant_id, memory.memory_id)] = memory
            return _result(memory, 1, changed=True)
        memory = self._memory(tenant_id, memory_id)
        if memory.user_id != user_id:
            raise PermissionDeniedError("user_id", f"only the author of memory {memory_id!r} writes it")
        head = memory.current
        new = Version(
            head.version + 1,
            text,
            head.category if category is None else category,
            head.shareable if shareable is None else shareable,
            head.confidence if confidence is None else confidence,
            self.now,
        )
        if (new.text, new.category, new.shareable, new.confidence) == (
            head.text,
            head.category,
            head.shareable,
            head.confidence,
        ):
            return _result(memory, head.version, changed=False)
        memory.versions.append(new)
        return _result(memory, new.version, changed=True)

    def list_visible(self, *, tenant_id: str, user_id: str, team_id: str | None = None) -> list[VisibleMemory]:
        """The current, not hidden memories `user_id` sees, oldest first (MemoryStore.list_visible)."""
        mode = self._open(tenant_id).mode
        members = self._members.get((tenant_id, team_id), []) if team_id is not None else [user_id]
        if team_id is not None:
            self._require_member(tenant_id, team_id, user_id)
        found = [
            m
            for (t, _), m in self.memories.items()
            if t == tenant_id
            and not self._hidden(m, m.current.version)
            and sees(m, user_id=user_id, team_id=team_id, mode=mode, members=members)
        ]
        return [_view(m) for m in sorted(found, key=lambda m: (m.created_at, m.memory_id))]

    def hidden_sources(self, *, tenant_id: str, sources: Iterable[tuple[str, int, int | None]]) -> set[tuple[str, int]]:
        """Which versions a build read (with the author epoch read, or None) are forgotten now
        (lib/memories/ordering.py's hidden_sources): gone, tombstoned, their author forgotten or at a
        later epoch, or the tenant closed."""
        tenant = self._tenants.get(tenant_id)
        hidden = set()
        for memory_id, version, epoch in sources:
            memory = self.memories.get((tenant_id, memory_id))
            subject = self._subjects.get((tenant_id, memory.user_id)) if memory else None
            if (
                tenant is None
                or tenant.closed
                or memory is None
                or subject is None
                or all(v.version != version for v in memory.versions)
                or self._hidden(memory, version)
                or (epoch is not None and subject.epoch != epoch)
            ):
                hidden.add((memory_id, version))
        return hidden

    def epoch(self, *, tenant_id: str, user_id: str) -> int:
        return self._subjects[(tenant_id, user_id)].epoch

    # -- RetentionReads (lib/retention/rules.py) ------------------------------------------------

    def expiring(self, *, written_before: dict[str, datetime], tenant_id: str | None) -> list[tuple[str, str, str]]:
        """(tenant, memory id, category) of current, not hidden memories of open tenants whose current
        category is a key of `written_before`, first written before its value; by category, sorted."""
        return [
            row
            for category, end in sorted(written_before.items())
            for row in self.in_categories(categories=[category], tenant_id=tenant_id)
            if self.memories[(row[0], row[1])].created_at < end
        ]

    def in_categories(self, *, categories: list[str], tenant_id: str | None) -> list[tuple[str, str, str]]:
        """The same, of the given categories whenever written."""
        return sorted(
            (m.tenant_id, m.memory_id, m.current.category)
            for m in self.memories.values()
            if (tenant_id is None or m.tenant_id == tenant_id)
            and not self._tenants[m.tenant_id].closed
            and m.current.category in categories
            and not self._hidden(m, m.current.version)
        )

    # -- what a deletion's acceptance or a restore does to the rows -------------------------------

    def tombstone(self, *, tenant_id: str, memory_id: str) -> None:
        """A MEMORY forget accepted: every version of the memory hidden."""
        for version in self._memory(tenant_id, memory_id).versions:
            self.tombstones.add((tenant_id, memory_id, version.version))

    def forget_subject(self, *, tenant_id: str, user_id: str) -> None:
        """A SUBJECT forget accepted: the subject's memories hidden, and a new epoch for what comes later."""
        subject = self._subjects[(tenant_id, user_id)]
        subject.forgotten = True
        subject.epoch += 1

    def close_tenant(self, *, tenant_id: str, closed: bool = True) -> None:
        """A tenant deleted, or behind a restore's gate (closed=False reopens it)."""
        self._tenants[tenant_id].closed = closed

    # -- rules ------------------------------------------------------------------------------------

    def _hidden(self, memory: Memory, version: int) -> bool:
        subject = self._subjects[(memory.tenant_id, memory.user_id)]
        return subject.forgotten or (memory.tenant_id, memory.memory_id, version) in self.tombstones

    def _open(self, tenant_id: str) -> _Tenant:
        tenant = self._tenants.get(tenant_id)
        if tenant is None or tenant.closed:
            raise NotFoundError("tenant", f"tenant {tenant_id!r} does not exist")
        return tenant

    def _memory(self, tenant_id: str, memory_id: str) -> Memory:
        memory = self.memories.get((tenant_id, memory_id))
        if memory is None or self._hidden(memory, memory.current.version):
            raise NotFoundError("memory_id", f"memory {memory_id!r} not found")
        return memory

    def _require_member(self, tenant_id: str, team_id: str, user_id: str) -> None:
        if user_id not in self._members.get((tenant_id, team_id), []):
            raise PermissionDeniedError("team", f"user {user_id!r} is not a member of team {team_id!r}")


def _result(memory: Memory, version: int, *, changed: bool) -> WriteResult:
    return WriteResult(memory.tenant_id, memory.memory_id, version, memory.user_id, memory.team_id, changed)


def _view(memory: Memory) -> VisibleMemory:
    head = memory.current
    return {
        "memory_id": memory.memory_id,
        "version": head.version,
        "text": head.text,
        "user_id": memory.user_id,
        "team_id": memory.team_id,
        "memory_type": "personal" if memory.team_id is None else "team_shared",
        "shareable": head.shareable,
        "category": head.category,
        "confidence": head.confidence,
        "do_not_sell": False,
        "created_at": memory.created_at.isoformat(),
        "updated_at": head.created_at.isoformat(),
    }
