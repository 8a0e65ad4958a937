"""Versions, history and rollback on the real embedded PostgreSQL."""

import threading

import psycopg
import pytest

from memory_pipelines.lib.infra.errors import ConflictError, NotFoundError
from memory_pipelines.lib.memories.records import WriteResult
from tests.conftest import row_counts


def test_new_version_supersedes_and_history_keeps_everything(store, tenant):
    first = store.write(
        tenant_id=tenant, user_id="alice", text="Prefers tea", category="general", original_query="what do I drink?"
    )
    second = store.write(tenant_id=tenant, user_id="alice", text="Prefers coffee", memory_id=first.memory_id)
    assert (first.version, second.version) == (1, 2)
    assert second.memory_id == first.memory_id and second.changed

    history = store.history(tenant_id=tenant, memory_id=first.memory_id)
    assert [(h["version"], h["text"], h["current"]) for h in history] == [
        (1, "Prefers tea", False),
        (2, "Prefers coffee", True),
    ]
    assert history[0]["superseded_at"] is not None and history[1]["superseded_at"] is None
    # Unspecified fields carry over to the new version, the original query included.
    assert history[1]["original_query"] == "what do I drink?"
    assert [m["text"] for m in store.list_visible(tenant_id=tenant, user_id="alice")] == ["Prefers coffee"]


def test_rollback_appends_a_version_with_the_previous_text(store, tenant):
    first = store.write(tenant_id=tenant, user_id="alice", text="Lives in Lyon", category="general")
    store.write(tenant_id=tenant, user_id="alice", text="Lives in Porto", memory_id=first.memory_id, category="travel")
    rolled = store.rollback(tenant_id=tenant, memory_id=first.memory_id, user_id="alice")
    assert rolled == {
        "tenant_id": tenant,
        "memory_id": first.memory_id,
        "version": 3,
        "text": "Lives in Lyon",
        "restored_from": 1,
    }
    history = store.history(tenant_id=tenant, memory_id=first.memory_id)
    assert [(h["version"], h["text"], h["category"], h["current"]) for h in history] == [
        (1, "Lives in Lyon", "general", False),
        (2, "Lives in Porto", "travel", False),
        (3, "Lives in Lyon", "general", True),
    ]
    # Rolling back again undoes the rollback: version 4 carries version 2's text.
    again = store.rollback(tenant_id=tenant, memory_id=first.memory_id, user_id="alice")
    assert (again["version"], again["text"]) == (4, "Lives in Porto")


def test_identical_text_is_a_no_op(store, tenant, endpoints):
    first = store.write(tenant_id=tenant, user_id="alice", text="Owns a cat named Miso")
    before = row_counts(endpoints.store_conninfo)
    same_id = store.write(tenant_id=tenant, user_id="alice", text="Owns a cat named Miso", memory_id=first.memory_id)
    no_id = store.write(tenant_id=tenant, user_id="alice", text="Owns a cat named Miso")
    assert (same_id.memory_id, same_id.version, same_id.changed) == (first.memory_id, 1, False)
    assert (no_id.memory_id, no_id.version, no_id.changed) == (first.memory_id, 1, False)
    assert row_counts(endpoints.store_conninfo) == before
    # The same text by another user, or in a team, is a different memory.
    other = store.write(tenant_id=tenant, user_id="bob", text="Owns a cat named Miso")
    assert other.memory_id != first.memory_id and other.changed


def test_rollback_of_a_single_version_is_refused_and_writes_nothing(store, tenant, endpoints):
    only = store.write(tenant_id=tenant, user_id="alice", text="Runs marathons")
    before = row_counts(endpoints.store_conninfo)
    with pytest.raises(ConflictError) as err:
        store.rollback(tenant_id=tenant, memory_id=only.memory_id, user_id="alice")
    assert err.value.field == "memory_id" and "one version" in err.value.message
    assert row_counts(endpoints.store_conninfo) == before


def test_text_at_rest_is_ciphertext_bound_to_its_version(store, tenant, endpoints):
    written = store.write(tenant_id=tenant, user_id="alice", text="Secret plans for the weekend")
    with psycopg.connect(endpoints.store_conninfo) as conn:
        text_ct, key_id = conn.execute(
            "SELECT text_ct, key_id FROM memory.memory_versions WHERE tenant_id = %s AND memory_id = %s",
            (tenant, written.memory_id),
        ).fetchone()
        own_key = conn.execute(
            "SELECT memory_id, version FROM keystore.version_keys WHERE tenant_id = %s AND key_id = %s",
            (tenant, key_id),
        ).fetchone()
        author = conn.execute(
            "SELECT count(*) FROM keystore.subject_keys WHERE tenant_id = %s AND key_id = %s", (tenant, key_id)
        ).fetchone()
    assert b"Secret plans" not in bytes(text_ct)
    # Sealed under a key of this version alone, not its author's (issue 32): forgetting it destroys one.
    assert key_id.startswith("vk_") and own_key == (written.memory_id, 1) and author == (0,)


def test_store_integrity_holds_after_many_versions(store, tenant):
    memory = store.write(tenant_id=tenant, user_id="alice", text="v0")
    for n in range(1, 6):
        store.write(tenant_id=tenant, user_id="alice", text=f"v{n}", memory_id=memory.memory_id)
    store.rollback(tenant_id=tenant, memory_id=memory.memory_id, user_id="alice")
    assert store.integrity_problems(tenant_id=tenant) == {
        "heads_without_current_version": 0,
        "stale_versions_not_superseded": 0,
        "versions_without_key": 0,
    }
    stats = store.tenant_stats(tenant_id=tenant)
    assert (stats["memories"], stats["versions"]) == (1, 7)


def test_write_many_is_all_or_nothing_and_keeps_the_no_op_rule(store, tenant, endpoints):
    from memory_pipelines.lib.infra.errors import PermissionDeniedError, ValidationError

    existing = store.write(tenant_id=tenant, user_id="alice", text="Already known")
    results = store.write_many(
        tenant_id=tenant,
        items=[
            {"user_id": "alice", "text": "Already known"},
            {"user_id": "alice", "text": "Bulk one", "category": "medical", "original_query": "q?"},
            {"user_id": "bob", "text": "Bulk two", "do_not_sell": True},
            {"user_id": "bob", "text": "Bulk two"},  # duplicate inside the batch
        ],
    )
    assert [(r.changed, r.version) for r in results] == [(False, 1), (True, 1), (True, 1), (False, 1)]
    assert results[0].memory_id == existing.memory_id and results[3].memory_id == results[2].memory_id
    [row] = store.history(tenant_id=tenant, memory_id=results[1].memory_id)
    assert (row["text"], row["category"], row["original_query"]) == ("Bulk one", "medical", "q?")
    assert store.list_visible(tenant_id=tenant, user_id="bob")[0]["do_not_sell"] is True

    before = row_counts(endpoints.store_conninfo)
    bad_batches = [
        ([{"user_id": "alice", "text": "fine"}, {"user_id": "alice", "text": " "}], ValidationError, "items[1].text"),
        ([{"user_id": "a'b", "text": "x"}], ValidationError, "items[0].user_id"),
        ([{"user_id": "alice", "text": "x", "colour": "red"}], ValidationError, "items[0].colour"),
        ([{"user_id": "alice", "text": "x", "team_id": "nobody-team"}], NotFoundError, "team"),
    ]
    for items, error, field in bad_batches:
        with pytest.raises(error) as err:
            store.write_many(tenant_id=tenant, items=items)
        assert err.value.field == field
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="alice")
    before = row_counts(endpoints.store_conninfo)
    with pytest.raises(PermissionDeniedError):
        store.write_many(
            tenant_id=tenant,
            items=[
                {"user_id": "alice", "text": "ok", "team_id": "core"},
                {"user_id": "bob", "text": "not a member", "team_id": "core"},
            ],
        )
    assert row_counts(endpoints.store_conninfo) == before


def test_rewriting_the_same_text_and_original_query_is_a_no_op(store, tenant):
    first = store.write(tenant_id=tenant, user_id="alice", text="Likes tea", original_query="drinks?", category="food")
    again = store.write(tenant_id=tenant, user_id="alice", text="Likes tea", original_query="drinks?", category="food")
    assert (again.memory_id, again.version, again.changed) == (first.memory_id, 1, False)
    changed = store.write(tenant_id=tenant, user_id="alice", text="Likes tea", original_query="beverages?")
    assert (changed.version, changed.changed) == (2, True)


def test_a_first_write_waits_for_a_tenant_another_transaction_is_creating_and_lands_in_it(store, tenant):
    # The write makes and reads its tenant's row in one statement. A tenant another transaction made
    # while that statement waited is not in its snapshot: it must be read again, not called unknown.
    with psycopg.connect(store.conninfo) as other:
        other.execute("INSERT INTO memory.tenants (tenant_id, sharing_mode) VALUES (%s, 'shared_pool')", (tenant,))
        results: list[WriteResult] = []
        writer = threading.Thread(
            target=lambda: results.append(store.write(tenant_id=tenant, user_id="alice", text="first of the tenant"))
        )
        writer.start()
        writer.join(1.0)
        assert writer.is_alive(), "the write should wait for the other transaction's tenant row"
        other.commit()
        writer.join(30)
    assert not writer.is_alive()
    (written,) = results
    assert written.version == 1
    assert store.require_tenant(tenant_id=tenant) == "shared_pool"  # the other transaction's row, kept
    visible = store.list_visible(tenant_id=tenant, user_id="alice")
    assert [(m["memory_id"], m["text"]) for m in visible] == [(written.memory_id, "first of the tenant")]
