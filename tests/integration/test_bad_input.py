"""Every bad input: a clear error naming the field, and nothing written (row counts unchanged)."""

import psycopg
import pytest

from memory_pipelines.lib.infra.errors import (
    ConflictError,
    MemoryPipelinesError,
    NotFoundError,
    PermissionDeniedError,
    ValidationError,
)
from memory_pipelines.lib.infra.validation import MAX_TEXT_BYTES
from tests.conftest import row_counts

METACHARS = ["x'; DROP TABLE memory.memories; --", 'a"b', "a;b", "a b", "a%s", "a\\b", "a--", "a/*b*/"]


@pytest.fixture
def seeded(store, tenant):
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="alice")
    alice = store.write(tenant_id=tenant, user_id="alice", text="alice personal")
    bob = store.write(tenant_id=tenant, user_id="bob", text="bob personal")
    return tenant, alice, bob


def assert_rejected(endpoints, call, error_type, field):
    before = row_counts(endpoints.store_conninfo)
    with pytest.raises(error_type) as err:
        call()
    assert err.value.field == field, str(err.value)
    assert field in str(err.value)
    assert row_counts(endpoints.store_conninfo) == before


def test_empty_and_oversized_text(store, endpoints, seeded):
    tenant, _, _ = seeded
    for text in ["", "   ", "\n\t "]:
        assert_rejected(
            endpoints, lambda t=text: store.write(tenant_id=tenant, user_id="alice", text=t), ValidationError, "text"
        )
    big = "x" * (MAX_TEXT_BYTES + 1)
    assert_rejected(
        endpoints, lambda: store.write(tenant_id=tenant, user_id="alice", text=big), ValidationError, "text"
    )
    assert_rejected(
        endpoints, lambda: store.write(tenant_id="brand-new", user_id="alice", text=big), ValidationError, "text"
    )


def test_unknown_tenant_for_reads(store, endpoints):
    ghost = "ghost-tenant-x"
    memory_id = "m_" + "0" * 32
    for call in (
        lambda: store.list_visible(tenant_id=ghost, user_id="alice"),
        lambda: store.history(tenant_id=ghost, memory_id=memory_id),
        lambda: store.rollback(tenant_id=ghost, memory_id=memory_id, user_id="alice"),
        lambda: list(store.iter_export(tenant_id=ghost, subject="alice")),
        lambda: store.tenant_stats(tenant_id=ghost),
        lambda: store.set_sharing_mode(tenant_id=ghost, sharing_mode="strict"),
    ):
        assert_rejected(endpoints, call, NotFoundError, "tenant")


def test_memory_of_another_user_or_tenant(store, endpoints, seeded):
    tenant, alice, bob = seeded
    assert_rejected(
        endpoints,
        lambda: store.write(tenant_id=tenant, user_id="alice", text="overwrite bob", memory_id=bob.memory_id),
        PermissionDeniedError,
        "memory_id",
    )
    store.write(tenant_id=tenant + "-2", user_id="alice", text="elsewhere")
    assert_rejected(
        endpoints,
        lambda: store.write(tenant_id=tenant + "-2", user_id="alice", text="x", memory_id=alice.memory_id),
        NotFoundError,
        "memory_id",
    )
    assert_rejected(
        endpoints, lambda: store.history(tenant_id=tenant + "-2", memory_id=alice.memory_id), NotFoundError, "memory_id"
    )
    # Moving a personal memory into a team by writing a version is refused too.
    assert_rejected(
        endpoints,
        lambda: store.write(tenant_id=tenant, user_id="alice", text="moved", memory_id=alice.memory_id, team_id="core"),
        ValidationError,
        "team",
    )


def test_malformed_ids(store, endpoints, seeded):
    tenant, _, _ = seeded
    for bad in ["m_1", "1", "M_" + "a" * 32, "m_" + "a" * 31 + "'"]:
        assert_rejected(
            endpoints, lambda b=bad: store.history(tenant_id=tenant, memory_id=b), ValidationError, "memory_id"
        )
        assert_rejected(
            endpoints,
            lambda b=bad: store.write(tenant_id=tenant, user_id="alice", text="t", memory_id=b),
            ValidationError,
            "memory_id",
        )
    for bad in ["", "-x", "a" * 65, "ünï"]:
        assert_rejected(
            endpoints, lambda b=bad: store.write(tenant_id=b, user_id="alice", text="t"), ValidationError, "tenant"
        )


@pytest.mark.parametrize("meta", METACHARS)
def test_sql_metacharacters_in_every_id_field_are_rejected(store, endpoints, seeded, meta):
    tenant, _, _ = seeded
    calls = {
        "tenant": lambda: store.write(tenant_id=meta, user_id="alice", text="t"),
        "user": lambda: store.write(tenant_id=tenant, user_id=meta, text="t"),
        "team": lambda: store.write(tenant_id=tenant, user_id="alice", text="t", team_id=meta),
        "memory_id": lambda: store.write(tenant_id=tenant, user_id="alice", text="t", memory_id=meta),
        "category": lambda: store.write(tenant_id=tenant, user_id="alice", text="t", category=meta),
        "subject": lambda: list(store.iter_export(tenant_id=tenant, subject=meta)),
        "sharing_mode": lambda: store.set_sharing_mode(tenant_id=tenant, sharing_mode=meta),
    }
    for field, call in calls.items():
        assert_rejected(endpoints, call, ValidationError, field)
    assert_rejected(
        endpoints, lambda: store.add_team_member(tenant_id=tenant, team_id=meta, user_id="bob"), ValidationError, "team"
    )


def test_sql_metacharacters_in_text_fields_are_stored_verbatim(store, endpoints, seeded):
    tenant, _, _ = seeded
    text = "Robert'); DROP TABLE memory.memories;-- $1 %s \\x00 /* */"
    written = store.write(tenant_id=tenant, user_id="alice", text=text, original_query=text)
    [row] = store.history(tenant_id=tenant, memory_id=written.memory_id)
    assert (row["text"], row["original_query"]) == (text, text)
    with psycopg.connect(endpoints.store_conninfo) as conn:
        assert conn.execute("SELECT to_regclass('memory.memories')").fetchone()[0] is not None


def test_team_write_by_a_non_member(store, endpoints, seeded):
    tenant, _, _ = seeded
    assert_rejected(
        endpoints,
        lambda: store.write(tenant_id=tenant, user_id="bob", text="sneak", team_id="core"),
        PermissionDeniedError,
        "team",
    )
    assert_rejected(
        endpoints,
        lambda: store.write(tenant_id=tenant, user_id="alice", text="x", team_id="nope"),
        NotFoundError,
        "team",
    )


def test_rollback_of_one_version_and_bad_numbers(store, endpoints, seeded):
    tenant, alice, _ = seeded
    assert_rejected(
        endpoints,
        lambda: store.rollback(tenant_id=tenant, memory_id=alice.memory_id, user_id="alice"),
        ConflictError,
        "memory_id",
    )
    for bad in (-0.1, 1.5, float("nan")):
        assert_rejected(
            endpoints,
            lambda b=bad: store.write(tenant_id=tenant, user_id="alice", text="t", confidence=b),
            ValidationError,
            "confidence",
        )
    assert_rejected(
        endpoints,
        lambda: store.remove_team_member(tenant_id=tenant, team_id="core", user_id="bob"),
        NotFoundError,
        "user",
    )


def test_every_error_is_a_memory_pipelines_error_with_a_field():
    for cls in (ValidationError, NotFoundError, PermissionDeniedError, ConflictError):
        err = cls("field_x", "message")
        assert isinstance(err, MemoryPipelinesError)
        assert str(err) == "field_x: message"


def test_a_sweep_of_a_day_not_ended_is_refused_through_the_api(store, derived, endpoints, tenant):
    from datetime import UTC, datetime, timedelta

    from memory_pipelines.lib.forget.deletion import DeletionService
    from memory_pipelines.lib.retention import rules as retention

    store.write(tenant_id=tenant, user_id="ann", text="Ann parks on level 2", category="general")
    service = DeletionService(derived)
    today = datetime.now(UTC).date()
    # tenant_id keeps a regression from sweeping the other tests' tenants of the session.
    for day in ("2099-01-01", today, today + timedelta(days=1)):
        assert_rejected(
            endpoints, lambda d=day: retention.sweep(service, day=d, tenant_id=tenant), ValidationError, "date"
        )
    assert service.list_jobs(tenant_id=tenant) == []
    assert len(store.list_visible(tenant_id=tenant, user_id="ann")) == 1
    # A preview of a future day is allowed: counts only, nothing requested.
    assert retention.preview(store, day="2099-01-01")["tenants"][tenant] == {"general": 1}
    assert service.list_jobs(tenant_id=tenant) == []


def test_an_unknown_evaluation_mode_is_refused(store, endpoints, tenant):
    from memory_pipelines.lib.evaluation import evaluator as evaluation

    assert_rejected(endpoints, lambda: evaluation.trend(store, tenant_id=tenant, mode="x"), ValidationError, "mode")


@pytest.mark.parametrize("bad", ["caf\udce9", "\ud800", "a\x00b"])
def test_text_fields_refuse_lone_surrogates_and_nul(store, endpoints, seeded, bad):
    tenant, alice, _ = seeded
    assert_rejected(
        endpoints, lambda: store.write(tenant_id=tenant, user_id="alice", text=bad), ValidationError, "text"
    )
    assert_rejected(
        endpoints,
        lambda: store.write(tenant_id=tenant, user_id="alice", text="ok", original_query=bad),
        ValidationError,
        "original_query",
    )
    assert_rejected(
        endpoints,
        lambda: store.write(tenant_id=tenant, user_id="alice", text=bad, memory_id=alice.memory_id),
        ValidationError,
        "text",
    )
