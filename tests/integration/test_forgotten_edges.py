"""Issue 20, items 1, 7, 8 and 9: edges where forgotten data came back or stayed readable.

Each test reproduces the report on real engines (embedded PostgreSQL, Chroma, DuckDB; a fresh tenant
on the session server, the CLI where the report used it) and holds the fixed behaviour:

1. a retention sweep between restores of an older and a newer backup never brings the memory back;
7. analytics hides an accepted deletion at once, before the cascade reaches the analytics rows;
8. bulk writes never dedupe onto a memory being forgotten; rollback works again after a
   single-version forget is COMPLETE, to the newest version still there, and says what it skipped;
9. explain never decrypts what was hidden after its visibility check; re-executing a launchpad forget
   run never creates a second job; a SUBJECT forget removes the cached recalls of the subject's queries.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import UTC, datetime, timedelta
from typing import Any

import dagster as dg
import pytest

from memory_pipelines.defs.forget.jobs import FORGET_JOB, forget_run_config
from memory_pipelines.lib.agent_runs.runs import AgentRuns
from memory_pipelines.lib.backups.service import BackupService
from memory_pipelines.lib.backups.storage import LocalBackupStorage
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.ledger import DeletionLedger
from memory_pipelines.lib.infra.errors import ConflictError, NotFoundError
from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.retention import rules as retention
from memory_pipelines.lib.stores.analytics.store import AnalyticsStore
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def backdate(store, tenant: str, memory_id: str, days: int) -> None:
    """Move a memory's first write, and every version it has now, `days` back in time."""
    when = datetime.now(UTC) - timedelta(days=days)
    with store.transaction() as conn:
        conn.execute(
            "UPDATE memory.memories SET created_at = %s WHERE tenant_id = %s AND memory_id = %s",
            (when, tenant, memory_id),
        )
        conn.execute(
            "UPDATE memory.memory_versions SET created_at = %s WHERE tenant_id = %s AND memory_id = %s",
            (when, tenant, memory_id),
        )


def rows_of(store, tenant: str, memory_id: str) -> list[int]:
    with store.transaction() as conn:
        return [
            r[0]
            for r in conn.execute(
                "SELECT version FROM memory.memory_versions WHERE tenant_id = %s AND memory_id = %s ORDER BY 1",
                (tenant, memory_id),
            )
        ]


# -- 1. retention, then restores of older and newer backups ---------------------------------------


def test_01_a_swept_memory_never_comes_back_from_an_older_or_a_newer_backup(store, derived, tenant, tmp_path):
    """The report, step by step: M v1 (general, 800 days old) -> B1 -> M v2 -> B2 -> restore B1 (drops
    v2) -> sweep of yesterday (COMPLETE, list empty) -> restore B2 must not bring v2's text back."""
    backups = BackupService(
        store, LocalBackupStorage(tmp_path / "backups"), staging=tmp_path / "staging", job_records=DeletionLedger(store)
    )
    first = store.write(tenant_id=tenant, user_id="ann", text="Ann's old passport ends 7731", category="general")
    backdate(store, tenant, first.memory_id, 800)
    b1 = backups.backup(tenant_id=tenant)
    second = store.write(
        tenant_id=tenant, user_id="ann", memory_id=first.memory_id, text="Ann's new passport ends 0442"
    )
    assert second.version == 2
    b2 = backups.backup(tenant_id=tenant)
    assert backups.restore(tenant_id=tenant, backup_id=b1["backup_id"])["state"] == "COMPLETE"
    assert rows_of(store, tenant, first.memory_id) == [1]  # the older backup knows nothing of v2

    yesterday = datetime.now(UTC).date() - timedelta(days=1)
    swept = retention.sweep(DeletionService(derived), day=yesterday, tenant_id=tenant)
    assert swept["jobs"][tenant]["state"] == "COMPLETE"
    assert store.list_visible(tenant_id=tenant, user_id="ann") == []

    for backup in (b2, b1, b2):  # the newer backup (which alone holds v2), the older one, the newer again
        report = backups.restore(tenant_id=tenant, backup_id=backup["backup_id"])
        assert report["state"] == "COMPLETE"
        assert set(report["verification"].values()) == {0}
        assert store.list_visible(tenant_id=tenant, user_id="ann") == []
        exported = list(store.iter_export(tenant_id=tenant, subject="ann"))
        assert exported == [], [row["text"] for row in exported]
        assert rows_of(store, tenant, first.memory_id) == []


# -- 7. analytics hides accepted deletions at once ------------------------------------------------


def _analytics(derived, tenant: str) -> dict[str, tuple[int, int]]:
    result = derived.analytics.query(
        "SELECT user_pseudonym, count(*), sum(text_length) FROM memories GROUP BY 1 ORDER BY 1", tenant_id=tenant
    )
    return {row[0]: (row[1], row[2]) for row in result["rows"]}


def test_07_analytics_hides_a_deletion_from_its_acceptance(store, derived, tenant):
    for text in ("Alice is pregnant", "Alice sings"):
        store.write(tenant_id=tenant, user_id="alice", text=text)
    bob = [store.write(tenant_id=tenant, user_id="bob", text=t) for t in ("Bob rows", "Bob cooks", "Bob bikes")]
    bob[2] = store.write(tenant_id=tenant, user_id="bob", memory_id=bob[2].memory_id, text="Bob bikes to work")
    derived.analytics.rebuild(store=store, tenant_id=tenant)
    before = _analytics(derived, tenant)
    assert sorted(n for n, _ in before.values()) == [2, 3]
    [alice_p] = [p for p, (n, _) in before.items() if n == 2]
    [bob_p] = [p for p, (n, _) in before.items() if n == 3]

    service = DeletionService(derived)
    subject = service.request(tenant_id=tenant, subject="alice")
    assert _analytics(derived, tenant) == {bob_p: before[bob_p]}
    assert alice_p not in json.dumps(derived.analytics.query("SELECT * FROM memories", tenant_id=tenant))
    whole = service.request(tenant_id=tenant, memory_id=bob[0].memory_id)
    one = service.request(tenant_id=tenant, memory_id=bob[2].memory_id, version=2)
    left = _analytics(derived, tenant)
    assert left == {bob_p: (1, len("Bob cooks"))}, "the files still hold both, the query must not show them"

    # Once COMPLETE, the cascade has taken the rows out of the files; what is left shows as before.
    service.run_batch(tenant_id=tenant, job_ids=[subject["job_id"], whole["job_id"], one["job_id"]])
    derived.analytics.rebuild(store=store, tenant_id=tenant)
    assert _analytics(derived, tenant) == {bob_p: (2, len("Bob cooks") + len("Bob bikes"))}
    # The subject writes again after COMPLETE: counted again (same pseudonym, new rows).
    store.write(tenant_id=tenant, user_id="alice", text="Alice hikes")
    derived.analytics.rebuild(store=store, tenant_id=tenant)
    assert _analytics(derived, tenant)[alice_p] == (1, len("Alice hikes"))

    # A retention sweep, pending: hidden at once too.
    kept = store.write(tenant_id=tenant, user_id="carol", text="Carol's old note", category="general")
    backdate(store, tenant, kept.memory_id, 800)
    derived.analytics.rebuild(store=store, tenant_id=tenant)
    assert len(_analytics(derived, tenant)) == 3
    yesterday = datetime.now(UTC).date() - timedelta(days=1)
    retention.sweep(service, day=yesterday, tenant_id=tenant, run=False)
    assert len(_analytics(derived, tenant)) == 2

    # TENANT: refused at once, as every other read.
    service.request(tenant_id=tenant, all_tenant=True, confirm=tenant)
    with pytest.raises(NotFoundError) as err:
        _analytics(derived, tenant)
    assert err.value.field == "tenant"


def test_07_the_cli_analytics_query_hides_a_pending_subject_forget(cli_env, store, derived, tenant):
    store.write(tenant_id=tenant, user_id="alice", text="Alice sees a cardiologist")
    store.write(tenant_id=tenant, user_id="bob", text="Bob likes tea")
    AnalyticsStore(store=store).rebuild(store=store, tenant_id=tenant)
    sql = "SELECT count(DISTINCT user_pseudonym), count(*), sum(text_length) FROM memories"

    def query() -> list[Any]:
        result = run_cli("analytics", "--tenant", tenant, "--sql", sql, home=cli_env["home"], env=cli_env["env"])
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["rows"]

    assert query() == [[2, 2, len("Alice sees a cardiologist") + len("Bob likes tea")]]
    DeletionService(derived).request(tenant_id=tenant, subject="alice")
    assert query() == [[1, 1, len("Bob likes tea")]]


# -- 8. edges of versions --------------------------------------------------------------------------


def test_08_a_bulk_write_never_dedupes_onto_a_memory_being_forgotten(store, derived, tenant):
    service = DeletionService(derived)
    doomed = store.write(tenant_id=tenant, user_id="alice", text="Alice's gate code is 5120")
    edited = store.write(tenant_id=tenant, user_id="alice", text="Alice parks on level 2")
    edited = store.write(tenant_id=tenant, user_id="alice", memory_id=edited.memory_id, text="Alice parks on level 3")
    jobs = [
        service.request(tenant_id=tenant, memory_id=doomed.memory_id)["job_id"],
        service.request(tenant_id=tenant, memory_id=edited.memory_id, version=2)["job_id"],
    ]
    written = store.write_many(
        tenant_id=tenant,
        items=[
            {"user_id": "alice", "text": "Alice's gate code is 5120"},
            {"user_id": "alice", "text": "Alice parks on level 3"},
        ],
    )
    assert [w.changed for w in written] == [True, True]
    assert {w.memory_id for w in written}.isdisjoint({doomed.memory_id, edited.memory_id})
    # The single write takes the same rule (it raised `no memory` for a doomed one): the bulk's copy now.
    single = store.write(tenant_id=tenant, user_id="alice", text="Alice's gate code is 5120")
    assert (single.memory_id, single.changed) == (written[0].memory_id, False)
    service.run_batch(tenant_id=tenant, job_ids=jobs)
    assert all(service.status(job_id=j)["state"] == "COMPLETE" for j in jobs)
    texts = sorted(m["text"] for m in store.list_visible(tenant_id=tenant, user_id="alice"))
    assert texts == ["Alice parks on level 2", "Alice parks on level 3", "Alice's gate code is 5120"]


def test_08_a_single_write_of_a_doomed_text_makes_a_new_memory(store, derived, tenant):
    doomed = store.write(tenant_id=tenant, user_id="alice", text="Alice banks with Nordea")
    job = DeletionService(derived).request(tenant_id=tenant, memory_id=doomed.memory_id)
    again = store.write(tenant_id=tenant, user_id="alice", text="Alice banks with Nordea")
    assert again.changed and again.memory_id != doomed.memory_id
    DeletionService(derived).run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert [m["text"] for m in store.list_visible(tenant_id=tenant, user_id="alice")] == ["Alice banks with Nordea"]


def test_08_rollback_works_again_once_a_single_version_forget_is_complete(store, derived, tenant):
    service = DeletionService(derived)
    first = store.write(tenant_id=tenant, user_id="alice", text="Lives in Lyon")
    memory_id = first.memory_id
    store.write(tenant_id=tenant, user_id="alice", memory_id=memory_id, text="Lives in Porto")
    store.write(tenant_id=tenant, user_id="alice", memory_id=memory_id, text="Lives in Oslo")
    job = service.request(tenant_id=tenant, memory_id=memory_id, version=2)
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
    rolled = store.rollback(tenant_id=tenant, memory_id=memory_id, user_id="alice")
    assert rolled == {
        "tenant_id": tenant,
        "memory_id": memory_id,
        "version": 4,
        "text": "Lives in Lyon",
        "restored_from": 1,
        "skipped": [2],
    }
    history = store.history(tenant_id=tenant, memory_id=memory_id)
    assert [(h["version"], h["text"]) for h in history] == [
        (1, "Lives in Lyon"),
        (3, "Lives in Oslo"),
        (4, "Lives in Lyon"),
    ]
    again = store.rollback(tenant_id=tenant, memory_id=memory_id, user_id="alice")
    assert (again["version"], again["text"], again["restored_from"], "skipped" in again) == (
        5,
        "Lives in Oslo",
        3,
        False,
    )

    # The version before the current one forgotten, and nothing older: a clear refusal, not "being forgotten".
    only = store.write(tenant_id=tenant, user_id="alice", text="Drives a Fiat")
    store.write(tenant_id=tenant, user_id="alice", memory_id=only.memory_id, text="Drives a Volvo")
    done = service.request(tenant_id=tenant, memory_id=only.memory_id, version=1)
    service.run_batch(tenant_id=tenant, job_ids=[done["job_id"]])
    with pytest.raises(ConflictError) as err:
        store.rollback(tenant_id=tenant, memory_id=only.memory_id, user_id="alice")
    assert "being forgotten" not in err.value.message and "nothing to roll back to" in err.value.message
    assert "version 1 was forgotten" in err.value.message


def test_08_rollback_passes_over_a_version_being_forgotten(store, derived, tenant):
    service = DeletionService(derived)
    memory_id = store.write(tenant_id=tenant, user_id="alice", text="Reads Proust").memory_id
    store.write(tenant_id=tenant, user_id="alice", memory_id=memory_id, text="Reads Woolf")
    store.write(tenant_id=tenant, user_id="alice", memory_id=memory_id, text="Reads Mann")
    job = service.request(tenant_id=tenant, memory_id=memory_id, version=2)
    rolled = store.rollback(tenant_id=tenant, memory_id=memory_id, user_id="alice")
    assert (rolled["text"], rolled["restored_from"], rolled["skipped"]) == ("Reads Proust", 1, [2])
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert "Reads Woolf" not in [h["text"] for h in store.history(tenant_id=tenant, memory_id=memory_id)]


# -- 9a. explain: visibility and decryption are one check ------------------------------------------


def test_09a_explain_never_decrypts_what_a_deletion_hid_after_its_check(store, derived, tenant, monkeypatch):
    """A deletion accepted between explain's visibility check and its decryption (made to happen there:
    the decryption first lets a forget in, from another thread, and waits for it up to 3 s)."""
    store.write(tenant_id=tenant, user_id="alice", text="Alice takes lithium every morning")
    derived.sync_all(tenant_id=tenant)
    runs = AgentRuns(derived)
    lease = runs.open(tenant_id=tenant, subject_id="alice", run_id="run-1")
    [hit] = runs.recall(lease_id=lease, query="which medication does alice take?", k=1)
    assert runs.explain(tenant_id=tenant, run_id="run-1")["memories"][0]["text"] == hit["text"]

    service = DeletionService(derived, drain_timeout=1.0)
    real = store.open_texts
    seen: dict[str, Any] = {}

    def open_texts_after_a_forget(**kwargs: Any) -> dict[tuple[str, int], str]:
        accepted = threading.Event()

        def forget() -> None:
            seen["job"] = service.request(tenant_id=tenant, subject="alice")
            accepted.set()

        thread = threading.Thread(target=forget)
        thread.start()
        seen["thread"] = thread
        seen["accepted_before_decrypt"] = accepted.wait(3.0)
        return real(**kwargs)

    monkeypatch.setattr(store, "open_texts", open_texts_after_a_forget)
    explained = runs.explain(tenant_id=tenant, run_id="run-1")
    seen["thread"].join(30)
    monkeypatch.undo()
    [memory] = explained["memories"]
    if seen["accepted_before_decrypt"]:
        assert memory["text"] is None and memory["state"] == "forgotten", "decrypted after the deletion was accepted"
    assert service.status(job_id=seen["job"]["job_id"])["state"] == "REQUESTED"
    after = runs.explain(tenant_id=tenant, run_id="run-1")["memories"][0]
    assert (after["state"], after["text"]) == ("forgotten", None)


# -- 9b. re-executing a launchpad forget run -----------------------------------------------------


@pytest.fixture
def home_env(session_settings):
    os.environ["MEMORY_PIPELINES_HOME"] = str(session_settings.home)
    yield
    os.environ.pop("MEMORY_PIPELINES_CHROMA_URL", None)


def forget_job_def() -> dg.JobDefinition:
    from memory_pipelines.definitions import defs

    return defs().resolve_job_def(FORGET_JOB)


def test_09b_reexecuting_a_launchpad_forget_run_reuses_its_job(store, derived, tenant, home_env):
    store.write(tenant_id=tenant, user_id="alice", text="Alice's spare key is under the blue pot")
    store.write(tenant_id=tenant, user_id="bob", text="Bob waters the ferns")
    derived.sync_all(tenant_id=tenant)
    service = DeletionService(derived)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [tenant])
        first = dg.execute_job(
            dg.reconstructable(forget_job_def),
            instance=instance,
            run_config=forget_run_config(job_ids=[], scope="SUBJECT", subject="alice", basis="gdpr-art17"),
            tags={"dagster/partition": tenant},
        )
        assert first.success
        [job] = service.list_jobs(tenant_id=tenant)
        assert job["state"] == "COMPLETE"
        # Alice writes again after her forget completed; then someone re-executes the whole run.
        later = store.write(tenant_id=tenant, user_id="alice", text="Alice now rides a green bike")
        parent = first.run_id
        for _ in range(2):  # a re-execution, then a re-execution of it: the same root run, the same job
            again = dg.execute_job(
                dg.reconstructable(forget_job_def),
                instance=instance,
                reexecution_options=dg.ReexecutionOptions(parent_run_id=parent),
                tags={"dagster/partition": tenant},  # as the UI's re-execution copies the parent's tags
            )
            assert again.success
            parent = again.run_id
        assert [j["job_id"] for j in service.list_jobs(tenant_id=tenant)] == [job["job_id"]]
        assert service.status(job_id=job["job_id"])["attempts"] == 1
        assert [m["memory_id"] for m in store.list_visible(tenant_id=tenant, user_id="alice")] == [later.memory_id]


# -- 9c. cached recalls of a forgotten subject's own queries ---------------------------------------


def _cache_keys(store, tenant: str, asked: list[tuple[str, str | None, str]], k: int = 5) -> list[bytes]:
    with store.transaction() as conn:
        subkey = store.keys.tenant_subkey(conn, tenant, "recall-cache", create=False)
    return [crypto.mac(subkey, json.dumps([user, team, "hybrid", k, query]).encode()) for user, team, query in asked]


def _cached(store, tenant: str, keys: list[bytes]) -> int:
    with store.transaction() as conn:
        row = conn.execute(
            "SELECT count(*) FROM derived.recall_cache WHERE tenant_id = %s AND cache_key = ANY(%s)", (tenant, keys)
        ).fetchone()
    return int(row[0])


def test_09c_a_subject_forget_removes_the_cached_recalls_of_their_own_queries(store, derived, tenant):
    store.create_tenant(tenant_id=tenant, sharing_mode="shared_pool")
    for user in ("alice", "bob"):
        store.add_team_member(tenant_id=tenant, team_id="core", user_id=user)
    store.write(tenant_id=tenant, user_id="bob", team_id="core", text="The core team's launch is on March 3")
    store.write(tenant_id=tenant, user_id="bob", text="Bob waters the ferns on Sundays")
    derived.sync_all(tenant_id=tenant)
    recaller = derived.recaller
    alice_asked = [
        ("alice", "core", "is the launch date moved because of my surgery?"),  # answered with bob's team memory
        ("alice", None, "did my HIV test come back?"),  # alice has no memory: an empty answer, cached
    ]
    bob_asked = [("bob", None, "when do I water the ferns?")]
    for user, team, query in alice_asked + bob_asked:
        recaller.recall(tenant_id=tenant, user_id=user, team_id=team, query=query)
    alice_keys, bob_keys = _cache_keys(store, tenant, alice_asked), _cache_keys(store, tenant, bob_asked)
    assert (_cached(store, tenant, alice_keys), _cached(store, tenant, bob_keys)) == (2, 1)

    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    # While the forget runs, alice's new recalls are answered but not cached (no new row to outlive it).
    pending = [("alice", "core", "who else knows about my surgery?")]
    assert recaller.recall(tenant_id=tenant, user_id="alice", team_id="core", query=pending[0][2])
    assert _cached(store, tenant, _cache_keys(store, tenant, pending)) == 0
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    done = service.status(job_id=job["job_id"])
    assert done["state"] == "COMPLETE"
    assert _cached(store, tenant, alice_keys) == 0, "cached recalls keyed by alice's own queries survived"
    assert _cached(store, tenant, bob_keys) == 1  # bob's own are not alice's
    assert int(done["targets"]["recall_cache"].removeprefix("DONE:")) >= 2
    proof = service.proof(job_id=job["job_id"])
    assert proof["verification"]["exact_id_queries"]["recall_cache"] == 0
