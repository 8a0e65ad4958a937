"""Who sees what, what a deletion hides from a build, and what retention takes, on the in-memory store
(lib/memories/in_memory.py): no database. tests/integration/test_in_memory_conformance.py runs the
same rules on PostgreSQL and requires the same answers."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

import pytest

from memory_pipelines.lib.infra.errors import NotFoundError, PermissionDeniedError, ValidationError
from memory_pipelines.lib.memories.in_memory import InMemoryStore
from memory_pipelines.lib.memories.protocol import MemoryRecords
from memory_pipelines.lib.retention import rules as retention

T = "acme"
DAY = date(2026, 6, 15)


def seen(store: MemoryRecords, user: str, team: str | None = None) -> list[str]:
    return [m["text"] for m in store.list_visible(tenant_id=T, user_id=user, team_id=team)]


@pytest.fixture
def store() -> InMemoryStore:
    """ann and bob in team `core`; cid outside it. Each writes one personal memory (ann's and cid's
    shareable) and ann and bob one team memory."""
    s = InMemoryStore(now=datetime(2026, 1, 1, tzinfo=UTC))
    s.create_tenant(tenant_id=T, sharing_mode="strict")
    for user in ("ann", "bob"):
        s.add_team_member(tenant_id=T, team_id="core", user_id=user)
    for user, shareable in (("ann", True), ("bob", False), ("cid", True)):
        s.write(tenant_id=T, user_id=user, text=f"{user} personal", shareable=shareable)
        s.now += timedelta(seconds=1)
    for user in ("ann", "bob"):
        s.write(tenant_id=T, user_id=user, text=f"{user} team", team_id="core")
        s.now += timedelta(seconds=1)
    return s


def test_each_sharing_mode_shows_its_team_view(store: InMemoryStore) -> None:
    assert seen(store, "ann") == ["ann personal"]  # a personal view never shows team memories
    assert seen(store, "ann", "core") == ["ann team"]  # strict: own team memories only
    store.set_sharing_mode(tenant_id=T, sharing_mode="shared_pool")
    assert seen(store, "ann", "core") == ["ann team", "bob team"]
    store.set_sharing_mode(tenant_id=T, sharing_mode="progressive")
    # progressive: the pool plus members' shareable personal memories (cid's is shareable, cid is no member)
    assert seen(store, "bob", "core") == ["ann personal", "ann team", "bob team"]
    assert seen(store, "ann") == ["ann personal"]


def test_a_view_outside_the_team_or_tenant_is_refused_by_name(store: InMemoryStore) -> None:
    with pytest.raises(PermissionDeniedError) as denied:
        store.list_visible(tenant_id=T, user_id="cid", team_id="core")
    assert denied.value.field == "team"
    with pytest.raises(NotFoundError):
        store.list_visible(tenant_id="nobody", user_id="ann")
    with pytest.raises(PermissionDeniedError):
        store.write(tenant_id=T, user_id="cid", text="cid team", team_id="core")
    with pytest.raises(ValidationError) as bad:
        store.write(tenant_id=T, user_id="ann", text="x", category="nonsense category!")
    assert bad.value.field == "category"


def test_versions_change_the_view_and_an_identical_write_changes_nothing(store: InMemoryStore) -> None:
    [mine] = store.list_visible(tenant_id=T, user_id="ann")
    again = store.write(tenant_id=T, user_id="ann", text="ann personal", memory_id=mine["memory_id"])
    assert (again.version, again.changed) == (1, False)
    newer = store.write(tenant_id=T, user_id="ann", text="ann moved", memory_id=mine["memory_id"], category="travel")
    assert (newer.version, newer.changed) == (2, True)
    [now] = store.list_visible(tenant_id=T, user_id="ann")
    assert (now["text"], now["version"], now["category"], now["shareable"]) == ("ann moved", 2, "travel", True)
    with pytest.raises(PermissionDeniedError):
        store.write(tenant_id=T, user_id="bob", text="not yours", memory_id=mine["memory_id"])


def test_an_accepted_deletion_hides_at_once_from_every_view(store: InMemoryStore) -> None:
    store.set_sharing_mode(tenant_id=T, sharing_mode="progressive")
    [ann_personal] = store.list_visible(tenant_id=T, user_id="ann")
    store.tombstone(tenant_id=T, memory_id=ann_personal["memory_id"])
    assert seen(store, "ann") == [] and seen(store, "bob", "core") == ["ann team", "bob team"]
    with pytest.raises(NotFoundError):  # a forgotten memory takes no new version
        store.write(tenant_id=T, user_id="ann", text="back", memory_id=ann_personal["memory_id"])
    store.forget_subject(tenant_id=T, user_id="bob")
    assert seen(store, "ann", "core") == ["ann team"]
    store.close_tenant(tenant_id=T)
    with pytest.raises(NotFoundError):
        seen(store, "ann")


def test_a_build_discards_what_was_forgotten_while_it_worked(store: InMemoryStore) -> None:
    """lib/memories/ordering.py: the versions a build read, checked under the gate before it commits."""
    ann = store.list_visible(tenant_id=T, user_id="ann", team_id="core")[0]["memory_id"]
    [bob] = [m["memory_id"] for m in store.list_visible(tenant_id=T, user_id="bob")]
    epoch = store.epoch(tenant_id=T, user_id="bob")
    read = [(ann, 1, None), (bob, 1, epoch), ("no-such-memory", 1, None), (ann, 7, None)]
    assert store.hidden_sources(tenant_id=T, sources=read) == {("no-such-memory", 1), (ann, 7)}
    store.write(tenant_id=T, user_id="ann", text="ann team v2", memory_id=ann)
    assert (ann, 1) not in store.hidden_sources(tenant_id=T, sources=read)  # superseded is not forgotten
    store.forget_subject(tenant_id=T, user_id="bob")
    assert (bob, 1) in store.hidden_sources(tenant_id=T, sources=read)
    # bob's epoch moved on: a read under the old epoch is hidden even if bob writes again under the new one
    assert store.epoch(tenant_id=T, user_id="bob") == epoch + 1
    store.tombstone(tenant_id=T, memory_id=ann)
    assert store.hidden_sources(tenant_id=T, sources=[(ann, 2, None)]) == {(ann, 2)}
    store.close_tenant(tenant_id=T)
    assert store.hidden_sources(tenant_id=T, sources=[(bob, 1, None), (ann, 1, None)]) == {(bob, 1), (ann, 1)}


def written(store: InMemoryStore, category: str, days_before: int, user: str = "ann") -> str:
    """A memory first written at noon `days_before` days before DAY."""
    store.now = datetime(DAY.year, DAY.month, DAY.day, 12, tzinfo=UTC) - timedelta(days=days_before)
    return store.write(tenant_id=T, user_id=user, text=f"{category} {days_before}", category=category).memory_id


POLICIES = retention.Policies(version="t", keep_days={"medical": 30, "general": 365}, immediate=frozenset({"legal"}))


def test_a_period_ends_on_the_day_of_its_last_day_not_a_day_early() -> None:
    assert retention.period_end(DAY, 30) == datetime(2026, 5, 17, tzinfo=UTC)
    s = InMemoryStore()
    s.create_tenant(tenant_id=T)
    ended = written(s, "medical", 30)  # written 30 days before DAY at noon: its 30 days end during DAY
    kept = written(s, "medical", 29)
    assert retention.expired(s, day=DAY, policies=POLICIES) == {T: {"medical": [ended]}}
    assert retention.expired(s, day=DAY + timedelta(days=1), policies=POLICIES) == {
        T: {"medical": sorted([ended, kept])}
    }
    assert retention.expired(s, day=DAY - timedelta(days=1), policies=POLICIES) == {}


def test_retention_follows_the_current_category_and_skips_what_is_hidden_or_closed() -> None:
    s = InMemoryStore()
    s.create_tenant(tenant_id=T)
    general_old = written(s, "general", 400)
    moved = written(s, "general", 100)
    s.write(tenant_id=T, user_id="ann", text="now medical", memory_id=moved, category="medical")
    forgotten = written(s, "medical", 90)
    s.tombstone(tenant_id=T, memory_id=forgotten)
    bobs = written(s, "medical", 90, user="bob")
    s.forget_subject(tenant_id=T, user_id="bob")
    legal = written(s, "legal", 0)
    unknown = written(s, "food", 5000)  # no policy: kept forever
    assert retention.expired(s, day=DAY, policies=POLICIES) == {T: {"general": [general_old], "medical": [moved]}}
    assert retention.immediate(s, policies=POLICIES) == {T: [legal]}
    assert retention.expired(s, day=DAY, policies=POLICIES, tenant_id="other") == {}
    assert {bobs, forgotten, unknown}.isdisjoint(
        m for cats in retention.expired(s, day=DAY, policies=POLICIES).values() for ids in cats.values() for m in ids
    )
    s.close_tenant(tenant_id=T)  # a restore's gate: nothing swept behind it
    assert retention.expired(s, day=DAY, policies=POLICIES) == {} and retention.immediate(s, policies=POLICIES) == {}


def test_a_sweep_day_must_have_ended() -> None:
    today = date(2026, 6, 16)
    assert retention.check_sweep_day("2026-06-15", today=today) == DAY
    for bad in ("2026-06-16", "2099-01-01", "0001-01-01", "15/06/2026"):
        with pytest.raises(ValidationError) as refused:
            retention.check_sweep_day(bad, today=today)
        assert refused.value.field == "date"
