"""The blind keyword index against a writer of the same tenant who reads the database: the tokens of a
memory only its author may see are MACed under a key derived from the author's subject key, so MACs
of chosen tokens (written as one-word memories, read back from `derived.keyword_postings`) match
none of them; searches find what they found before; installs indexed by the older release upgrade."""

from __future__ import annotations

import shutil
import uuid
from typing import Any

import psycopg
import pytest

from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.infra import migrations
from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.keys import KeyStore
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.stores import lineage
from memory_pipelines.lib.stores.keyword.index import KeywordIndex, tokens

SECRET = "hiv biktarvy leipzig"
ALICE_TEXT = f"Alice: {SECRET}, refill every thirty days at the clinic"
CHOSEN = ("hiv", "biktarvy", "leipzig")


def postings_of(conn: psycopg.Connection, tenant: str, memory_ids: list[str]) -> set[bytes]:
    rows = conn.execute(
        "SELECT token_mac FROM derived.keyword_postings WHERE tenant_id = %s AND memory_id = ANY(%s)",
        (tenant, memory_ids),
    )
    return {bytes(r[0]) for r in rows}


def matched(conn: psycopg.Connection, tenant: str, victim: list[str], attacker: list[str]) -> int:
    """Postings of the attacker's memories whose MAC equals one of the victim's: what the attack reads."""
    row = conn.execute(
        "SELECT count(*) FROM derived.keyword_postings a JOIN derived.keyword_postings b"
        " ON b.tenant_id = a.tenant_id AND b.token_mac = a.token_mac"
        " WHERE a.tenant_id = %s AND a.memory_id = ANY(%s) AND b.memory_id = ANY(%s)",
        (tenant, victim, attacker),
    ).fetchone()
    assert row is not None
    return int(row[0])


def mallory_writes_chosen_tokens(store: MemoryStore, tenant: str) -> list[str]:
    """Each chosen token as a one-word memory every way a writer can: personal, shareable, and in her team."""
    ids = []
    for word in CHOSEN:
        ids.append(store.write(tenant_id=tenant, user_id="mallory", text=word).memory_id)
        ids.append(store.write(tenant_id=tenant, user_id="mallory", text=f"{word}!", shareable=True).memory_id)
        ids.append(store.write(tenant_id=tenant, user_id="mallory", text=f"{word}?", team_id="core").memory_id)
    return ids


@pytest.fixture
def world(store, derived, tenant) -> dict[str, Any]:
    """alice, bob and mallory in team core (progressive: the widest rule); alice's personal memory,
    her shareable one, bob's team memory; mallory's chosen tokens; the keyword index synced."""
    for user in ("alice", "bob", "mallory"):
        store.add_team_member(tenant_id=tenant, team_id="core", user_id=user)
    store.set_sharing_mode(tenant_id=tenant, sharing_mode="progressive")
    alice = store.write(tenant_id=tenant, user_id="alice", text=ALICE_TEXT).memory_id
    shared = store.write(
        tenant_id=tenant, user_id="alice", text="Alice runs the leipzig half marathon", shareable=True
    ).memory_id
    team = store.write(tenant_id=tenant, user_id="bob", text="Core offsite in leipzig, biktarvy", team_id="core")
    mallory = mallory_writes_chosen_tokens(store, tenant)
    derived.keywords.sync(tenant_id=tenant)
    return {"tenant": tenant, "alice": alice, "shared": shared, "team": team.memory_id, "mallory": mallory}


def keyword_ids(derived, tenant: str, user: str, query: str, team: str | None = None) -> set[str]:
    hits = derived.recaller.recall(
        tenant_id=tenant, user_id=user, team_id=team, query=query, mode="keyword", k=20, use_cache=False
    )
    return {hit["memory_id"] for hit in hits}


def test_chosen_plaintext_writer_matches_none_of_anothers_personal_postings(store, world):
    """The attack of the issue: on the release before, each of mallory's 9 chosen postings equals one
    of alice's (every posting was MACed under the one tenant key)."""
    tenant = world["tenant"]
    with store.transaction() as conn:
        alice_macs = postings_of(conn, tenant, [world["alice"]])
        assert len(alice_macs) == len(tokens(ALICE_TEXT))
        assert matched(conn, tenant, [world["alice"]], world["mallory"]) == 0
        # What alice's postings are: her tokens under her own keyword key, none under the tenant's.
        tenant_key = store.keys.tenant_subkey(conn, tenant, "keyword-index", create=False)
        alice_key = store.keys.subject_subkeys(conn, tenant, ["alice"], "keyword-index")["alice"]
        assert alice_macs == {crypto.mac(alice_key, t.encode()) for t in tokens(ALICE_TEXT)}
        assert not alice_macs & {crypto.mac(tenant_key, t.encode()) for t in tokens(ALICE_TEXT)}
        # Mallory's own personal memories are under her key: not even she can match them to anything.
        mine = [world["mallory"][i] for i in range(0, len(world["mallory"]), 3)]
        mallory_key = store.keys.subject_subkeys(conn, tenant, ["mallory"], "keyword-index")["mallory"]
        assert postings_of(conn, tenant, mine) == {crypto.mac(mallory_key, w.encode()) for w in CHOSEN}
        # The boundary, as the threat model states it: memories a teammate may come to see (team
        # memories, shareable ones) stay under the tenant key, so her chosen tokens match them.
        assert matched(conn, tenant, [world["team"]], world["mallory"]) == 2 * 2  # leipzig, biktarvy
        assert matched(conn, tenant, [world["shared"]], world["mallory"]) == 2  # leipzig


def test_searches_find_what_each_user_may_see(derived, store, world):
    tenant = world["tenant"]
    assert keyword_ids(derived, tenant, "alice", "biktarvy") == {world["alice"]}
    assert keyword_ids(derived, tenant, "alice", "leipzig") == {world["alice"], world["shared"]}
    team_view = keyword_ids(derived, tenant, "alice", "leipzig", team="core")
    assert {world["shared"], world["team"]} <= team_view and world["alice"] not in team_view
    hybrid = derived.recaller.recall(tenant_id=tenant, user_id="alice", query="biktarvy refill", use_cache=False)
    assert hybrid[0]["memory_id"] == world["alice"]
    # mallory finds her own and what the team may see, never alice's personal memory.
    assert keyword_ids(derived, tenant, "mallory", "biktarvy") == {world["mallory"][3], world["mallory"][4]}
    team_view = keyword_ids(derived, tenant, "mallory", "biktarvy leipzig", team="core")
    assert world["team"] in team_view and world["shared"] in team_view and world["alice"] not in team_view
    assert keyword_ids(derived, tenant, "bob", "leipzig", team="core") >= {world["team"], world["shared"]}
    # Without a user (benchmarks, tests): every indexed version, under every subject's key.
    unscoped = {memory_id for (memory_id, _), _ in derived.keywords.search(tenant_id=tenant, query=SECRET, limit=50)}
    assert {world["alice"], world["team"], world["shared"], *world["mallory"]} <= unscoped
    # A personal view of more memories than the small-scope bound walks the whole posting lists,
    # with the tenant's and the user's MACs both (full matches first, then counted hits).
    for limit in (1, 60):
        found = derived.keywords.search_visible(
            tenant_id=tenant, user_id="alice", team_id=None, query=SECRET, limit=limit, small_scope=0
        )
        assert [(source[0], score) for source, score, _ in found][:1] == [(world["alice"], 1.0)]
    assert derived.keywords.check(tenant_id=tenant) == {"records": 12, "without_lineage": 0, "not_current": 0}


@pytest.mark.parametrize("mode", ["strict", "shared_pool", "progressive"])
def test_sharing_mode_changes_need_no_rekeying(derived, store, world, mode):
    """The key follows what never changes for a version: after a mode change nothing is re-indexed,
    and each view's keyword answers are exactly its visible memories holding the token."""
    tenant = world["tenant"]
    store.set_sharing_mode(tenant_id=tenant, sharing_mode=mode)
    assert derived.keywords.sync(tenant_id=tenant)["indexed"] == 0
    for user in ("alice", "bob", "mallory"):
        for team in (None, "core"):
            visible = store.list_visible(tenant_id=tenant, user_id=user, team_id=team)
            for word in CHOSEN:
                expected = {m["memory_id"] for m in visible if word in tokens(m["text"])}
                assert keyword_ids(derived, tenant, user, word, team) == expected, (user, team, word)


def test_a_version_made_shareable_is_found_by_teammates_and_back(derived, store, world):
    """Shareable is per version: the new version is indexed under the key its own visibility calls for."""
    tenant, alice = world["tenant"], world["alice"]
    store.write(tenant_id=tenant, user_id="alice", memory_id=alice, text=ALICE_TEXT, shareable=True)
    assert derived.keywords.sync(tenant_id=tenant)["indexed"] == 1
    assert alice in keyword_ids(derived, tenant, "bob", "biktarvy", team="core")
    assert alice in keyword_ids(derived, tenant, "alice", "biktarvy")
    with store.transaction() as conn:
        assert matched(conn, tenant, [alice], world["mallory"]) == 3 * 2  # shared now: under the tenant key
    store.write(tenant_id=tenant, user_id="alice", memory_id=alice, text=ALICE_TEXT, shareable=False)
    assert derived.keywords.sync(tenant_id=tenant)["indexed"] == 1
    assert alice not in keyword_ids(derived, tenant, "bob", "biktarvy", team="core")
    assert alice in keyword_ids(derived, tenant, "alice", "biktarvy")
    with store.transaction() as conn:
        assert matched(conn, tenant, [alice], world["mallory"]) == 0


def test_shredding_the_subject_makes_her_postings_unlinkable_and_forget_removes_them(derived, store, world):
    tenant, alice = world["tenant"], world["alice"]
    assert derived.keywords.probe_hits(
        tenant_id=tenant, texts=[ALICE_TEXT], sources={(alice, 1)}, subjects=["alice"]
    ) == len(tokens(ALICE_TEXT))
    service = DeletionService(derived)
    job = service.shred_keys(tenant_id=tenant, subject="alice")["forget_job"]
    with store.transaction() as conn:
        # No key derives her MACs any more: not the tenant's, not any other subject's.
        assert store.keys.subject_subkeys(conn, tenant, ["alice"], "keyword-index") == {}
        assert postings_of(conn, tenant, [alice])  # the cascade has not run yet
    assert derived.keywords.probe_hits(tenant_id=tenant, texts=[ALICE_TEXT], sources={(alice, 1)}) == 0
    unscoped = derived.keywords.search(tenant_id=tenant, query="biktarvy", limit=50)
    assert alice not in {memory_id for (memory_id, _), _ in unscoped}
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
    with store.transaction() as conn:
        assert postings_of(conn, tenant, [alice, world["shared"]]) == set()
        assert postings_of(conn, tenant, [world["team"]])  # bob's team memory lives on


# -- an install indexed by the release before ---------------------------------------------------


def old_sync(old: MemoryStore, tenant: str) -> None:
    """What the release before wrote: every posting under the tenant keyword key, with its lineage."""
    current = old.current_versions(tenant_id=tenant)
    texts = old.open_texts(tenant_id=tenant, sources=[cv.source for cv in current])
    with old.transaction() as conn:
        key = old.keys.tenant_subkey(conn, tenant, "keyword-index", create=False)
        for cv in current:
            for token in tokens(texts[cv.source]):
                conn.execute(
                    "INSERT INTO derived.keyword_postings (tenant_id, token_mac, memory_id, version)"
                    " VALUES (%s, %s, %s, %s)",
                    (tenant, crypto.mac(key, token.encode()), cv.memory_id, cv.version),
                )
        lineage.insert_edges(
            conn, tenant_id=tenant, store="keyword_index", records=[(cv.record_id, cv.source) for cv in current]
        )


def test_an_older_install_stays_findable_and_is_rekeyed_by_its_next_sync(store, scratch_database, tmp_path):
    # Every migration but 0018: the postings are written as before it, by today's writes, which need
    # the later tables (version keys, 0021); 0018 touches nothing they made.
    before = tmp_path / "migrations-without-0018"
    before.mkdir()
    for version, _, path in migrations.available():
        if version != 18:
            shutil.copy(path, before / path.name)
    with psycopg.connect(scratch_database) as conn:
        assert "0018_keyword_subject_keys" not in migrations.migrate(conn, before)
    upgraded = MemoryStore(scratch_database, KeyStore(store.keys.master))
    tenant = "acme-" + uuid.uuid4().hex[:8]
    try:
        for user in ("alice", "bob", "mallory"):
            upgraded.add_team_member(tenant_id=tenant, team_id="core", user_id=user)
        upgraded.set_sharing_mode(tenant_id=tenant, sharing_mode="progressive")
        alice = upgraded.write(tenant_id=tenant, user_id="alice", text=ALICE_TEXT).memory_id
        team = upgraded.write(tenant_id=tenant, user_id="bob", text="Core offsite in leipzig", team_id="core")
        attacker = mallory_writes_chosen_tokens(upgraded, tenant)
        old_sync(upgraded, tenant)
        with upgraded.transaction() as conn:
            assert matched(conn, tenant, [alice], attacker) == 3 * 3  # the issue, reproduced
        with psycopg.connect(scratch_database) as conn:
            assert "0018_keyword_subject_keys" in migrations.migrate(conn)
            legacy = conn.execute(
                "SELECT DISTINCT memory_id FROM derived.keyword_postings WHERE tenant_id = %s AND legacy_key",
                (tenant,),
            ).fetchall()
        personal = {alice, *attacker[0::3]}  # alice's and mallory's personal, not shareable memories
        assert {r[0] for r in legacy} == personal
        index = KeywordIndex(upgraded)
        # Until the next sync the old postings answer, under the tenant key a personal view asks too.
        found = index.search_visible(tenant_id=tenant, user_id="alice", team_id=None, query="biktarvy", limit=5)
        assert [source for source, _, _ in found] == [(alice, 1)]
        counts = index.sync(tenant_id=tenant)
        assert counts["rekeyed"] == len(personal) and counts["indexed"] == len(personal)
        with upgraded.transaction() as conn:
            assert matched(conn, tenant, [alice], attacker) == 0
            assert matched(conn, tenant, [team.memory_id], attacker) == 2  # leipzig, as before
            assert conn.execute(
                "SELECT count(*) FROM derived.keyword_postings WHERE tenant_id = %s AND legacy_key", (tenant,)
            ).fetchone() == (0,)
        found = index.search_visible(tenant_id=tenant, user_id="alice", team_id=None, query="biktarvy", limit=5)
        assert [source for source, _, _ in found] == [(alice, 1)]
        assert index.sync(tenant_id=tenant)["indexed"] == 0
        assert index.check(tenant_id=tenant) == {"records": 2 + len(attacker), "without_lineage": 0, "not_current": 0}
    finally:
        upgraded.close()
