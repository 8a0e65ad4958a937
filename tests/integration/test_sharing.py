"""Personal and team views under each sharing mode, and tenant isolation."""

import pytest

from memory_pipelines.lib.infra.errors import NotFoundError, PermissionDeniedError


@pytest.fixture
def team_tenant(store, tenant):
    """alice and bob in team `core`, carol outside; each has personal, shareable and team memories."""
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="alice")
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="bob")
    store.add_team_member(tenant_id=tenant, team_id="other", user_id="carol")
    for user in ("alice", "bob", "carol"):
        store.write(tenant_id=tenant, user_id=user, text=f"{user} private")
        store.write(tenant_id=tenant, user_id=user, text=f"{user} shareable", shareable=True)
    store.write(tenant_id=tenant, user_id="alice", text="alice team note", team_id="core")
    store.write(tenant_id=tenant, user_id="bob", text="bob team note", team_id="core")
    store.write(tenant_id=tenant, user_id="carol", text="carol other-team note", team_id="other")
    return tenant


def texts(rows):
    return sorted(row["text"] for row in rows)


@pytest.mark.parametrize("mode", ["strict", "shared_pool", "progressive"])
def test_personal_view_is_only_ones_own_personal_memories(store, team_tenant, mode):
    store.set_sharing_mode(tenant_id=team_tenant, sharing_mode=mode)
    for user in ("alice", "bob", "carol"):
        rows = store.list_visible(tenant_id=team_tenant, user_id=user)
        assert texts(rows) == [f"{user} private", f"{user} shareable"]
        assert {row["user_id"] for row in rows} == {user}


@pytest.mark.parametrize(
    ("mode", "alice_sees", "bob_sees"),
    [
        ("strict", ["alice team note"], ["bob team note"]),
        ("shared_pool", ["alice team note", "bob team note"], ["alice team note", "bob team note"]),
        (
            "progressive",
            ["alice shareable", "alice team note", "bob shareable", "bob team note"],
            ["alice shareable", "alice team note", "bob shareable", "bob team note"],
        ),
    ],
)
def test_team_view_follows_the_tenant_sharing_mode(store, team_tenant, mode, alice_sees, bob_sees):
    store.set_sharing_mode(tenant_id=team_tenant, sharing_mode=mode)
    alice = store.list_visible(tenant_id=team_tenant, user_id="alice", team_id="core")
    bob = store.list_visible(tenant_id=team_tenant, user_id="bob", team_id="core")
    assert texts(alice) == alice_sees
    assert texts(bob) == bob_sees
    # Never a private memory, never carol's shareable memory (she is not in `core`).
    for row in alice + bob:
        assert "private" not in row["text"] and not row["text"].startswith("carol")
    # The creator is recorded on every row.
    assert {row["user_id"] for row in alice if row["text"].startswith("bob")} <= {"bob"}


def test_strict_mode_never_shows_another_users_personal_memories(store, team_tenant):
    store.set_sharing_mode(tenant_id=team_tenant, sharing_mode="strict")
    for viewer in ("alice", "bob"):
        for scope in (None, "core"):
            rows = store.list_visible(tenant_id=team_tenant, user_id=viewer, team_id=scope)
            assert {row["user_id"] for row in rows} == {viewer}


def test_team_view_requires_membership(store, team_tenant):
    with pytest.raises(PermissionDeniedError) as err:
        store.list_visible(tenant_id=team_tenant, user_id="carol", team_id="core")
    assert err.value.field == "team"
    with pytest.raises(NotFoundError, match="team"):
        store.list_visible(tenant_id=team_tenant, user_id="alice", team_id="nope")


def test_removed_member_loses_the_team_view_and_their_shareables_leave_it(store, team_tenant):
    store.set_sharing_mode(tenant_id=team_tenant, sharing_mode="progressive")
    store.remove_team_member(tenant_id=team_tenant, team_id="core", user_id="bob")
    with pytest.raises(PermissionDeniedError):
        store.list_visible(tenant_id=team_tenant, user_id="bob", team_id="core")
    alice = texts(store.list_visible(tenant_id=team_tenant, user_id="alice", team_id="core"))
    # bob's team note stays with the team; his personal shareable memory no longer enters it.
    assert alice == ["alice shareable", "alice team note", "bob team note"]
    with pytest.raises(PermissionDeniedError, match="not a member"):
        store.write(tenant_id=team_tenant, user_id="bob", text="late note", team_id="core")


def test_tenants_are_isolated(store, team_tenant):
    other = team_tenant + "-b"
    theirs = store.write(tenant_id=other, user_id="alice", text="alice in another tenant")
    mine = store.list_visible(tenant_id=team_tenant, user_id="alice")
    assert "alice in another tenant" not in texts(mine)
    assert texts(store.list_visible(tenant_id=other, user_id="alice")) == ["alice in another tenant"]
    with pytest.raises(NotFoundError) as err:
        store.history(tenant_id=team_tenant, memory_id=theirs.memory_id)
    assert err.value.field == "memory_id"
    with pytest.raises(NotFoundError):
        store.write(tenant_id=team_tenant, user_id="alice", text="hijack", memory_id=theirs.memory_id)
    with pytest.raises(NotFoundError):
        store.rollback(tenant_id=team_tenant, memory_id=theirs.memory_id, user_id="alice")
    exported = list(store.iter_export(tenant_id=team_tenant, subject="alice"))
    assert theirs.memory_id not in {row["memory_id"] for row in exported}
