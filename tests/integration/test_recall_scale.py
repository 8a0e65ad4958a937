"""Recall that never loads the user's visible set: the same answers as the algorithm it replaced (which
loaded it; kept in benchmarks/recall.py as the oracle) on a randomized tenant, and what it does better."""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest

from benchmarks.recall import old_recall
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.infra.errors import PermissionDeniedError
from memory_pipelines.lib.stores.recall import recall as recall_module

WORDS = (
    "kayak bicycle garden python rust coffee tea marathon piano violin berlin lisbon invoice budget "
    "allergy peanuts insulin deadline billing search onboarding dog cat parrot monday friday"
).split()
USERS = [f"u{n}" for n in range(8)]
TEAMS = {"red": USERS[0:4], "blue": USERS[2:6], "green": [USERS[0], USERS[6]]}  # u7: in no team
QUERIES = ["kayak garden coffee", "python rust deadline billing", "peanuts allergy insulin", "piano lisbon friday"]


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.sample(WORDS, rng.randint(3, 7))) + f" n{n}"


@pytest.fixture(scope="module")
def random_tenant(store, derived) -> dict[str, Any]:
    """Personal, shareable and team memories of 8 users in 3 overlapping teams; versions superseded
    before and after the indexes synced (stale vectors and postings stay until the next sync); a
    member removed after writing shareable memories; a memory and a subject whose deletions are
    accepted but not run (hidden in the store, still in both indexes)."""
    rng = random.Random(20240611)
    tenant = "t-scale-" + uuid.uuid4().hex[:8]
    for team, members in TEAMS.items():
        for user in members:
            store.add_team_member(tenant_id=tenant, team_id=team, user_id=user)
    store.add_team_member(tenant_id=tenant, team_id="blue", user_id=USERS[7])  # removed below
    memberships = {u: [t for t, members in TEAMS.items() if u in members] for u in USERS}
    memberships[USERS[7]] = ["blue"]
    written = []
    for n in range(160):
        user = rng.choice(USERS)
        team_id = rng.choice([None, None, *memberships[user]])
        shareable = team_id is None and rng.random() < 0.5
        result = store.write(tenant_id=tenant, user_id=user, text=_text(rng, n), team_id=team_id, shareable=shareable)
        written.append((result.memory_id, user))
    for n, (memory_id, user) in enumerate(rng.sample(written, 20)):  # superseded before the sync
        store.write(tenant_id=tenant, user_id=user, memory_id=memory_id, text=_text(rng, 1000 + n))
    derived.sync_all(tenant_id=tenant)
    for n, (memory_id, user) in enumerate(rng.sample(written, 20)):  # after it: the indexes hold old versions
        store.write(
            tenant_id=tenant,
            user_id=user,
            memory_id=memory_id,
            text=_text(rng, 2000 + n),
            shareable=rng.random() < 0.5 if n % 2 else None,
        )
    store.remove_team_member(tenant_id=tenant, team_id="blue", user_id=USERS[7])
    service = DeletionService(derived)
    hidden_memory = rng.choice([m for m, u in written if u != USERS[5]])
    service.request(tenant_id=tenant, memory_id=hidden_memory)
    service.request(tenant_id=tenant, subject=USERS[5])
    return {"tenant": tenant, "hidden_memory": hidden_memory, "forgotten": USERS[5]}


@pytest.mark.slow
@pytest.mark.parametrize("small_scope", [1000, 0], ids=["own-versions", "whole-indexes"])
@pytest.mark.parametrize("sharing_mode", ["strict", "shared_pool", "progressive"])
def test_same_answers_as_loading_the_visible_set(derived, store, random_tenant, sharing_mode, small_scope, monkeypatch):
    """Every scope here is small (searched among its own versions); with the bound at 0 the same
    scopes go through the tenant's whole indexes (nearest vectors unfiltered, posting lists)."""
    monkeypatch.setattr(recall_module, "_SMALL_SCOPE", small_scope)
    tenant = random_tenant["tenant"]
    store.set_sharing_mode(tenant_id=tenant, sharing_mode=sharing_mode)
    scopes: list[tuple[str, str | None]] = [(user, team) for team, members in TEAMS.items() for user in members]
    if sharing_mode == "strict":  # a personal view does not depend on the sharing mode: once is enough
        scopes += [(user, None) for user in USERS]
    compared = answered = 0
    for n, (user, team) in enumerate(scopes):
        for mode in ("semantic", "keyword", "hybrid"):
            query, k = QUERIES[(n + len(mode)) % len(QUERIES)], (3, 8)[n % 2]
            kwargs = {"tenant_id": tenant, "user_id": user, "team_id": team, "query": query, "k": k, "mode": mode}
            new = derived.recaller.recall(use_cache=False, **kwargs)
            assert new == old_recall(derived.recaller, **kwargs), (user, team, mode)
            compared += 1
            answered += bool(new)
            for hit in new:
                assert hit["memory_id"] != random_tenant["hidden_memory"]
                assert hit["user_id"] != random_tenant["forgotten"]
                assert hit["team_id"] in (None, team)
    assert compared == 3 * len(scopes)
    assert answered >= 2 * (len(scopes) - 3)  # not empty lists (the forgotten subject's own views are)


def test_a_non_member_gets_no_team_recall(derived, random_tenant):
    with pytest.raises(PermissionDeniedError) as err:
        derived.recaller.recall(tenant_id=random_tenant["tenant"], user_id=USERS[7], team_id="blue", query="kayak")
    assert err.value.field == "team"


def test_keyword_limit_counts_visible_candidates_only(derived, store, tenant):
    """Seventy memories of another user match every token of the query, more than the first question
    reads (4 x limit + 50); the two of alice's that match one token are still found with limit 2:
    the scope is applied before LIMIT, in SQL, and asked again without a bound when too few pass."""
    store.write_many(
        tenant_id=tenant, items=[{"user_id": "bob", "text": f"violin lessons on fridays, note {n}"} for n in range(70)]
    )
    mine = {store.write(tenant_id=tenant, user_id="alice", text=f"violin case number {n}").memory_id for n in range(2)}
    derived.sync_all(tenant_id=tenant)
    unscoped = derived.keywords.search(tenant_id=tenant, query="violin lessons fridays", limit=2)
    assert {memory_id for (memory_id, _), _ in unscoped}.isdisjoint(mine)
    found = derived.keywords.search_visible(
        tenant_id=tenant, user_id="alice", team_id=None, query="violin lessons fridays", limit=2
    )
    assert {memory_id for (memory_id, _), _, _ in found} == mine
    assert [round(score, 4) for _, score, _ in found] == [0.3333, 0.3333]
    assert {(row["user_id"], row["team_id"], row["category"], row["subject_epoch"]) for _, _, row in found} == {
        ("alice", None, "general", 0)
    }
    hits = derived.recaller.recall(tenant_id=tenant, user_id="alice", query="violin lessons fridays", mode="keyword")
    assert {h["memory_id"] for h in hits} == mine


def test_semantic_asks_again_when_too_few_candidates_survive(derived, store, tenant):
    """Thirty near-duplicates by a subject being forgotten fill Chroma's first answer (the forget has not
    run: their vectors are still there); the old recall returned nothing, the new one asks deeper."""
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="alice")
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="mallory")
    store.set_sharing_mode(tenant_id=tenant, sharing_mode="shared_pool")
    for n in range(30):
        store.write(tenant_id=tenant, user_id="mallory", team_id="core", text=f"The team kayak trip is on day {n}")
    kept = {
        store.write(tenant_id=tenant, user_id="alice", team_id="core", text=text).memory_id
        for text in ("Budget review with finance on Monday", "Alice paddles a kayak at weekends")
    }
    derived.sync_all(tenant_id=tenant)
    DeletionService(derived).request(tenant_id=tenant, subject="mallory")
    kwargs = {"tenant_id": tenant, "user_id": "alice", "team_id": "core", "query": "team kayak trip", "k": 2}
    assert old_recall(derived.recaller, mode="semantic", **kwargs) == []  # 2 + 20 fetched: all mallory's
    for mode in ("semantic", "hybrid"):
        hits = derived.recaller.recall(mode=mode, use_cache=False, **kwargs)
        assert {h["memory_id"] for h in hits} == kept, mode
        assert {h["user_id"] for h in hits} == {"alice"}


def test_a_cached_answer_is_confirmed_before_it_is_used(derived, store, tenant):
    """A cached answer naming a version hidden since (here by a tombstone the change sequence missed)
    is ranked again, not served; lease fences take each hit's author and epoch from the store."""
    first = store.write(tenant_id=tenant, user_id="alice", text="Keeps bees on the balcony")
    second = store.write(tenant_id=tenant, user_id="alice", text="Bees swarm in May")
    derived.sync_all(tenant_id=tenant)
    kwargs = {"tenant_id": tenant, "user_id": "alice", "query": "bees", "mode": "keyword"}
    answers = [derived.recaller.recall(**kwargs) for _ in range(2)]
    assert [[(h["memory_id"], h["cached"]) for h in a] for a in answers] == [
        sorted([(first.memory_id, False), (second.memory_id, False)]),
        sorted([(first.memory_id, True), (second.memory_id, True)]),
    ]
    with store.transaction() as conn:
        conn.execute(
            "INSERT INTO control.tombstones (tenant_id, memory_id, version, job_id) VALUES (%s, %s, 1, 'test')",
            (tenant, first.memory_id),
        )
    again = derived.recaller.recall(**kwargs)
    assert [(h["memory_id"], h["cached"]) for h in again] == [(second.memory_id, False)]


def test_full_matches_are_answered_first_and_alike(derived, store, tenant, monkeypatch):
    """When enough versions hold every token of the query, the answer comes from walking the rarest
    token's postings (no posting list counted whole): the same answer as the old recall, in every
    view, with the fall back to counting when the view holds too few full matches."""
    for user in ("ana", "ben", "cy"):
        store.add_team_member(tenant_id=tenant, team_id="core", user_id=user)
    rng = random.Random(7)
    items = []
    for n in range(150):
        words = rng.sample(WORDS, 4) + (["kayak", "lisbon", "friday"] if n % 3 == 0 else ["kayak"])
        user = ("ana", "ben", "cy")[n % 3 if n % 2 else (n // 2) % 3]
        item: dict[str, Any] = {"user_id": user, "text": " ".join(words) + f" n{n}"}
        if n % 5:
            item["team_id"] = "core"
        else:
            item["shareable"] = n % 10 == 0
        items.append(item)
    store.write_many(tenant_id=tenant, items=items)
    derived.sync_all(tenant_id=tenant)
    monkeypatch.setattr(recall_module, "_SMALL_SCOPE", 0)  # as if the team were large
    answered: list[int] = []
    full_matches = type(derived.keywords)._full_matches

    def spy(cur, scope, params):
        rows = full_matches(cur, scope, params)
        answered.append(len(rows) == params["limit"])
        return rows

    monkeypatch.setattr(type(derived.keywords), "_full_matches", staticmethod(spy))
    for sharing_mode in ("strict", "shared_pool", "progressive"):
        store.set_sharing_mode(tenant_id=tenant, sharing_mode=sharing_mode)
        for user, team in (("ana", "core"), ("ben", "core"), ("cy", None)):
            for k in (3, 10):
                kwargs = {"tenant_id": tenant, "user_id": user, "team_id": team, "k": k, "mode": "keyword"}
                new = derived.recaller.recall(query="friday kayak in lisbon", use_cache=False, **kwargs)
                assert new == old_recall(derived.recaller, query="friday kayak in lisbon", **kwargs)
                assert len(new) == k
                assert {h["score"] for h in new} <= {1.0, round(2 / 3, 6), round(1 / 3, 6)}
    assert len(answered) == 18
    assert 6 <= sum(answered) < 18  # both paths taken
