"""The in-memory store (lib/memories/in_memory.py) answers as PostgreSQL does: one scenario played on
both, every view, every build check and the retention rules compared. A rule changed on one side only
fails here; the unit tests on the fake (tests/unit/test_in_memory_rules.py) stand on it."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.memories import ordering
from memory_pipelines.lib.memories.in_memory import InMemoryStore
from memory_pipelines.lib.memories.protocol import MemoryRecords
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.retention import rules as retention

DAY = date(2026, 6, 15)
START = datetime(2025, 1, 1, 12, tzinfo=UTC)
USERS = ("ann", "bob", "cid")
FIELDS = ("version", "text", "user_id", "team_id", "memory_type", "shareable", "category")
POLICIES = retention.Policies(
    version="t", keep_days={"medical": 30, "general": 365, "travel": 200}, immediate=frozenset({"legal"})
)


class Side:
    """One store, and how a deletion's acceptance, a restore's gate and the clock reach it."""

    def __init__(self, records: MemoryRecords, tenant: str) -> None:
        self.records, self.tenant = records, tenant
        self.ids: dict[str, str] = {}  # text of the first version -> memory id

    def write(self, user: str, text: str, days_ago: int, **fields: Any) -> None:
        result = self.records.write(tenant_id=self.tenant, user_id=user, text=text, **fields)
        self.ids.setdefault(text, result.memory_id)
        self.written(result.memory_id, START + timedelta(days=days_ago * -1))

    def written(self, memory_id: str, when: datetime) -> None:
        raise NotImplementedError

    def tombstone(self, memory_id: str) -> None:
        raise NotImplementedError

    def forget(self, user: str) -> None:
        raise NotImplementedError

    def gate(self, closed: bool) -> None:
        raise NotImplementedError

    def epoch(self, user: str) -> int:
        raise NotImplementedError

    def hidden(self, sources: list[tuple[str, int, int | None]]) -> set[tuple[str, int]]:
        raise NotImplementedError

    def reads(self) -> retention.RetentionReads:
        raise NotImplementedError


class Fake(Side):
    records: InMemoryStore

    def written(self, memory_id: str, when: datetime) -> None:
        self.records.memories[(self.tenant, memory_id)].created_at = when

    def tombstone(self, memory_id: str) -> None:
        self.records.tombstone(tenant_id=self.tenant, memory_id=memory_id)

    def forget(self, user: str) -> None:
        self.records.forget_subject(tenant_id=self.tenant, user_id=user)

    def gate(self, closed: bool) -> None:
        self.records.close_tenant(tenant_id=self.tenant, closed=closed)

    def epoch(self, user: str) -> int:
        return self.records.epoch(tenant_id=self.tenant, user_id=user)

    def hidden(self, sources: list[tuple[str, int, int | None]]) -> set[tuple[str, int]]:
        return self.records.hidden_sources(tenant_id=self.tenant, sources=sources)

    def reads(self) -> retention.RetentionReads:
        return self.records


class Real(Side):
    def __init__(self, store: MemoryStore, service: DeletionService, tenant: str) -> None:
        super().__init__(store, tenant)
        self.store, self.service = store, service

    def written(self, memory_id: str, when: datetime) -> None:
        with self.store.transaction() as conn:
            conn.execute(
                "UPDATE memory.memories SET created_at = %s WHERE tenant_id = %s AND memory_id = %s",
                (when, self.tenant, memory_id),
            )

    def tombstone(self, memory_id: str) -> None:
        self.service.request(tenant_id=self.tenant, memory_id=memory_id)

    def forget(self, user: str) -> None:
        self.service.request(tenant_id=self.tenant, subject=user)

    def gate(self, closed: bool) -> None:
        with self.store.transaction() as conn:
            conn.execute(
                "UPDATE memory.tenants SET restoring_since = CASE WHEN %s THEN now() END WHERE tenant_id = %s",
                (closed, self.tenant),
            )

    def epoch(self, user: str) -> int:
        with self.store.transaction() as conn:
            row = conn.execute(
                "SELECT epoch FROM memory.subjects WHERE tenant_id = %s AND user_id = %s", (self.tenant, user)
            ).fetchone()
        assert row is not None
        return int(row[0])

    def hidden(self, sources: list[tuple[str, int, int | None]]) -> set[tuple[str, int]]:
        with self.store.transaction() as conn:
            return ordering.hidden_sources(conn, self.tenant, sources)

    def reads(self) -> retention.RetentionReads:
        return retention.StoreRetentionReads(self.store)


def views(side: Side) -> dict[str, list[tuple[Any, ...]]]:
    """Every user's personal and team view, memories named by their first text."""
    by_id = {memory_id: text for text, memory_id in side.ids.items()}
    out = {}
    for user in USERS:
        for team in (None, "core"):
            if team and user == "cid":
                continue
            rows = side.records.list_visible(tenant_id=side.tenant, user_id=user, team_id=team)
            out[f"{user}/{team}"] = sorted((by_id[r["memory_id"]], *(dict(r)[k] for k in FIELDS)) for r in rows)
    return out


def build_checks(side: Side, epochs: dict[str, int]) -> set[tuple[str, int]]:
    """Which reads of versions 1 and 2 of every memory, under the epochs taken before, are hidden now."""
    authors = {"ann": "ann", "bob": "bob", "cid": "cid"}
    sources: list[tuple[str, int, int | None]] = [
        (memory_id, version, epochs[authors[text.split()[0]]])
        for text, memory_id in side.ids.items()
        for version in (1, 2)
    ]
    by_id = {memory_id: text for text, memory_id in side.ids.items()}
    return {(by_id[m], v) for m, v in side.hidden(sources)}


def expired(side: Side, **extra: Any) -> dict[str, Any]:
    by_id = {memory_id: text for text, memory_id in side.ids.items()}
    found = retention.expired(side.reads(), day=DAY, policies=POLICIES, tenant_id=side.tenant, **extra)
    soon = retention.immediate(side.reads(), policies=POLICIES, tenant_id=side.tenant)
    return {
        "expired": {c: sorted(by_id[m] for m in ids) for c, ids in found.get(side.tenant, {}).items()},
        "immediate": sorted(by_id[m] for m in soon.get(side.tenant, [])),
    }


def play(side: Side) -> list[Any]:
    """The scenario, and what each store answered at each step."""
    t, r = side.tenant, side.records
    r.create_tenant(tenant_id=t, sharing_mode="strict")
    for user in ("ann", "bob"):
        r.add_team_member(tenant_id=t, team_id="core", user_id=user)
    side.write("ann", "ann knee surgery", 600, category="medical", shareable=True)
    side.write("ann", "ann likes trains", 400, category="general")
    side.write("bob", "bob window seat", 500, category="general", shareable=True)
    side.write("bob", "bob team plan", 10, team_id="core", category="work")
    side.write("ann", "ann team note", 700, team_id="core", category="travel")
    side.write("cid", "cid shareable", 900, category="general", shareable=True)
    side.write("cid", "cid legal hold", 1, category="legal")
    # ann's trains become travel (200 days): retention follows the current version's category.
    r.write(
        tenant_id=t,
        user_id="ann",
        text="ann likes night trains",
        memory_id=side.ids["ann likes trains"],
        category="travel",
    )
    epochs = {u: side.epoch(u) for u in USERS}
    answers: list[Any] = []
    for mode in ("strict", "shared_pool", "progressive"):
        r.set_sharing_mode(tenant_id=t, sharing_mode=mode)
        answers.append((mode, views(side)))
    answers += [build_checks(side, epochs), expired(side)]
    side.tombstone(side.ids["ann knee surgery"])
    answers += [views(side), build_checks(side, epochs), expired(side)]
    side.forget("bob")
    answers += [views(side), build_checks(side, epochs), expired(side)]
    side.gate(True)
    answers += [build_checks(side, epochs), expired(side)]
    side.gate(False)
    return answers


def test_the_in_memory_store_answers_as_postgresql_does(store: MemoryStore, derived, tenant: str) -> None:
    real = play(Real(store, DeletionService(derived), tenant))
    fake = play(Fake(InMemoryStore(), tenant))
    assert len(real) == len(fake) == 13
    for step, (on_postgres, in_memory) in enumerate(zip(real, fake, strict=True)):
        assert on_postgres == in_memory, f"step {step}"
    # The scenario is not empty: each rule it compares took something somewhere.
    progressive = dict(real[2][1])
    assert ("bob window seat" in {row[0] for row in progressive["ann/core"]}) and real[4]["immediate"]
    assert real[4]["expired"] == {
        "general": ["bob window seat", "cid shareable"],
        "medical": ["ann knee surgery"],
        "travel": ["ann likes trains", "ann team note"],
    }
    assert real[10] == {
        "expired": {"general": ["cid shareable"], "travel": ["ann likes trains", "ann team note"]},
        "immediate": ["cid legal hold"],
    }
    assert real[12] == {"expired": {}, "immediate": []}  # behind a restore's gate, nothing is swept
