"""`MemoryPlatform`, the Python entry point: the README's first example runs as written, and the
platform's handle, lifecycle and errors behave as documented (real PostgreSQL and Chroma)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import psycopg
import pytest

from memory_pipelines import DeletionHandle, MemoryPlatform
from memory_pipelines import platform as platform_module
from memory_pipelines.lib.forget.deletion import DeletionBlocked, DeletionService
from memory_pipelines.lib.infra import settings as settings_module
from memory_pipelines.lib.infra.errors import ConflictError, NotFoundError, ValidationError
from memory_pipelines.platform import DeletionTimeout

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- readme-python-example -->"


def readme_example() -> str:
    """The fenced Python block right after the marker comment in README.md, exactly as written."""
    text = README.read_text(encoding="utf-8")
    assert text.count(MARKER) == 1, "README.md must mark exactly one Python example"
    found = re.match(r"\s*```python\n(.*?)\n```", text[text.index(MARKER) + len(MARKER) :], re.DOTALL)
    assert found, "the marker must be followed by a ```python block"
    return found.group(1)


def test_readme_first_python_example_runs(session_settings, endpoints, monkeypatch, capsys):
    code = readme_example()
    assert "from memory_pipelines import MemoryPlatform" in code
    # The session's HOME: its embedded PostgreSQL and Chroma are running, and from_env reuses them.
    monkeypatch.setenv(settings_module.ENV_HOME, str(session_settings.home))
    for name in (settings_module.ENV_PG_URL, settings_module.ENV_CHROMA_URL, settings_module.ENV_KMS_KEY_ID):
        monkeypatch.delenv(name, raising=False)
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), namespace)

    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "Allergic to penicillin"
    assert namespace["hits"][0]["text"] == "Allergic to penicillin"
    assert namespace["state"] == "COMPLETE"
    job = namespace["job"]
    proof = namespace["proof"]
    assert isinstance(job, DeletionHandle)
    assert isinstance(proof, dict)
    assert proof["jobId"] == job.job_id and proof["basis"] == "gdpr-art17"
    assert proof["scope"] == {"type": "SUBJECT", "tenant": "acme"}
    assert all(str(proof["targets"][name]).startswith("DONE:") for name in ("primary", "chroma", "keyword_index"))
    assert printed[1].startswith("COMPLETE {")
    assert "mortgage" not in json.dumps(proof) and "mortgage" not in printed[1]
    assert namespace["mp"].closed


@pytest.fixture
def parts(session_settings, endpoints, store, derived):
    """The constructor's parts: the session's engines."""
    return {"settings": session_settings, "store": store, "endpoints": endpoints, "derived": derived}


def test_package_exports_the_platform():
    assert MemoryPlatform is platform_module.MemoryPlatform
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        import memory_pipelines

        _ = memory_pipelines.Nope


def test_write_recall_versions_export_lineage_forget(parts, tenant):
    with MemoryPlatform(**parts) as mp:
        first = mp.write(tenant_id=tenant, user_id="alice", text="Prefers Python", category="general")
        assert (first["version"], first["changed"]) == (1, True)
        again = mp.write(tenant_id=tenant, user_id="alice", text="Prefers Python", category="general")
        assert (again["memory_id"], again["changed"]) == (first["memory_id"], False)
        second = mp.write(tenant_id=tenant, user_id="alice", text="Prefers Rust", memory_id=first["memory_id"])
        assert second["version"] == 2
        bulk = mp.write_many(
            tenant_id=tenant,
            items=[{"user_id": "bob", "text": "Bob's cat is called Miso"}, {"user_id": "bob", "text": "Bob runs"}],
        )
        assert [b["version"] for b in bulk] == [1, 1]

        # Written, never materialized: the next recall syncs the indexes and finds it.
        hits = mp.recall(tenant_id=tenant, user_id="alice", query="which programming language?", k=1)
        assert [(h["memory_id"], h["version"], h["text"]) for h in hits] == [(first["memory_id"], 2, "Prefers Rust")]
        assert [h["text"] for h in mp.recall(tenant_id=tenant, user_id="bob", query="Miso", k=1, mode="keyword")] == [
            "Bob's cat is called Miso"
        ]

        rolled = mp.rollback(tenant_id=tenant, memory_id=first["memory_id"], user_id="alice")
        assert rolled["version"] == 3
        assert [h["text"] for h in mp.history(tenant_id=tenant, memory_id=first["memory_id"])] == [
            "Prefers Python",
            "Prefers Rust",
            "Prefers Python",
        ]
        assert [m["text"] for m in mp.list(tenant_id=tenant, user_id="alice")] == ["Prefers Python"]
        # The rollback changed the tenant: recall sees version 3, not the indexed version 2.
        hits = mp.recall(tenant_id=tenant, user_id="alice", query="which programming language?", k=1)
        assert [(h["version"], h["text"]) for h in hits] == [(3, "Prefers Python")]
        exported = mp.export(tenant_id=tenant, subject="alice")
        assert [(e["version"], e["current"]) for e in exported] == [(1, False), (2, False), (3, True)]
        chunks = "".join(mp.export_json(tenant_id=tenant, subject="alice"))
        assert json.loads(chunks)["subject"] == "alice"

        lineage = mp.lineage(tenant_id=tenant, memory_id=first["memory_id"])
        assert {(r["store"], r["version"]) for r in lineage} >= {("chroma", 3), ("keyword_index", 3)}
        sources = mp.lineage(tenant_id=tenant, record=f"chroma:{first['memory_id']}:3")
        assert sources["sources"] == [{"memory_id": first["memory_id"], "version": 3}]

        job = mp.forget(tenant_id=tenant, subject="bob", basis="gdpr-art17")
        assert isinstance(job, DeletionHandle) and job.tenant_id == tenant and not job.duplicate
        assert job.status()["state"] == "REQUESTED"
        with pytest.raises(NotFoundError) as before:
            job.proof()
        assert before.value.field == "job_id" and "COMPLETE" in before.value.message
        # Hidden at once, before any cascade ran.
        assert mp.list(tenant_id=tenant, user_id="bob") == []
        assert mp.forget(tenant_id=tenant, subject="bob", basis="gdpr-art17").job_id == job.job_id

        done = job.wait(timeout=60)
        assert done["state"] == "COMPLETE" and done["job_id"] == job.job_id
        assert done["targets"]["chroma"] == "DONE:2" and done["targets"]["keyword_index"] == "DONE:2"
        proof = job.proof()
        assert proof["jobId"] == job.job_id and proof["targetVersions"] == 2
        assert "Miso" not in json.dumps(proof)
        assert job.wait(timeout=1)["state"] == "COMPLETE"  # already done: returns at once
        assert mp.deletion(job_id=job.job_id).proof() == proof
        assert mp.recall(tenant_id=tenant, user_id="bob", query="Miso", k=1) == []


def test_wait_times_out_while_another_process_runs_the_cascade(parts, tenant):
    with MemoryPlatform(**parts) as mp:
        mp.write(tenant_id=tenant, user_id="carol", text="Carol's locker code is 4711")
        job = mp.forget(tenant_id=tenant, subject="carol")
        # Another runner (a Dagster forget run) holds the tenant's forget run lock.
        with psycopg.connect(parts["store"].conninfo, autocommit=True) as other:
            other.execute("SELECT pg_advisory_lock(hashtextextended(%s, 2))", (f"forget\x1f{tenant}",))
            with pytest.raises(DeletionTimeout) as waited:
                job.wait(timeout=0.5)
            assert isinstance(waited.value, TimeoutError)
            assert waited.value.field == "timeout" and job.job_id in waited.value.message
            assert job.status()["state"] == "REQUESTED"
        assert job.wait(timeout=60)["state"] == "COMPLETE"  # the lock went with its session


def test_wait_reports_a_blocked_job_then_retries_it(parts, tenant):
    def chroma_lost(step, job_ids):
        raise TimeoutError("the Chroma delete's answer never came back")

    blocking = DeletionService(parts["derived"], hooks={"deleted:chroma": chroma_lost})
    with MemoryPlatform(**parts, deletions=blocking) as mp:
        mp.write(tenant_id=tenant, user_id="dave", text="Dave's badge number is 99")
        mp.recall(tenant_id=tenant, user_id="dave", query="badge")  # indexes synced: chroma has a record
        job = mp.forget(tenant_id=tenant, subject="dave")
        with pytest.raises(DeletionBlocked) as blocked:
            job.wait(timeout=30)
        assert blocked.value.field == "chroma" and blocked.value.code == "CHROMA_TIMEOUTERROR"
        assert job.job_id in blocked.value.message and "wait() retries it" in blocked.value.message
        assert job.status()["state"] == "BLOCKED"
    with MemoryPlatform(**parts) as mp:
        retried = mp.deletion(job_id=job.job_id).wait(timeout=60)
        assert retried["state"] == "COMPLETE" and retried["attempts"] == 2


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda mp: mp.write(tenant_id="acme corp", user_id="alice", text="x"), "tenant"),
        (lambda mp: mp.write(tenant_id="acme", user_id="alice", text="  "), "text"),
        (lambda mp: mp.recall(tenant_id="acme corp", user_id="alice", query="x"), "tenant"),
        (lambda mp: mp.recall(tenant_id="acme", user_id="al ice", query="x"), "user"),
        (lambda mp: mp.recall(tenant_id="no-such-tenant-zz", user_id="alice", query="x"), "tenant"),
        (lambda mp: mp.recall(tenant_id="no-such-tenant-zz", user_id="alice", query="x", k=0, sync=False), "k"),
        (lambda mp: mp.forget(tenant_id="acme corp", subject="bob"), "tenant"),
        (lambda mp: mp.forget(tenant_id="acme", subject="bob", memory_id="m_" + "0" * 32), "scope"),
        (lambda mp: mp.lineage(tenant_id="acme"), "memory_id"),
        (lambda mp: mp.history(tenant_id="acme", memory_id="not-an-id"), "memory_id"),
        (lambda mp: mp.deletion(job_id="del zz"), "job_id"),
    ],
)
def test_bad_input_names_the_field(parts, call, field):
    with MemoryPlatform(**parts) as mp:
        with pytest.raises((ValidationError, NotFoundError)) as err:
            call(mp)
    assert err.value.field == field, err.value


def test_wait_refuses_a_bad_timeout(parts, tenant):
    with MemoryPlatform(**parts) as mp:
        mp.write(tenant_id=tenant, user_id="erin", text="Erin's note")
        job = mp.forget(tenant_id=tenant, subject="erin")
        for bad in (0, -1, "10", True):
            with pytest.raises(ValidationError) as err:
                job.wait(timeout=bad)
            assert err.value.field == "timeout"
        assert job.status()["state"] == "REQUESTED"  # nothing ran


def test_close_is_idempotent_and_the_context_manager_closes(parts, tenant):
    mp = MemoryPlatform(**parts)
    with mp as entered:
        assert entered is mp and not mp.closed
        mp.write(tenant_id=tenant, user_id="frank", text="Frank's note")
    assert mp.closed
    mp.close()  # again: nothing happens
    assert mp.closed and "closed" in repr(mp)
    with pytest.raises(ConflictError) as err:
        mp.list(tenant_id=tenant, user_id="frank")
    assert err.value.field == "platform" and "closed" in err.value.message
    with pytest.raises(ConflictError):
        with mp:
            pass
    # An exception inside the block still closes it, and propagates.
    other = MemoryPlatform(**parts)
    with pytest.raises(RuntimeError, match="boom"):
        with other:
            raise RuntimeError("boom")
    assert other.closed
    # The parts are usable after: closing drops idle connections, not the store.
    assert [m["text"] for m in parts["store"].list_visible(tenant_id=tenant, user_id="frank")] == ["Frank's note"]


def test_backup_then_restore_and_recall_follows(parts, tenant):
    with MemoryPlatform(**parts) as mp:
        kept = mp.write(tenant_id=tenant, user_id="gina", text="Gina speaks Portuguese")
        manifest = mp.backup(tenant_id=tenant)
        assert manifest["tenant_id"] == tenant and manifest["rows"]["memory_versions"] == 1
        assert "Portuguese" not in json.dumps(manifest)
        later = mp.write(tenant_id=tenant, user_id="gina", text="Gina moved to Lisbon")
        hits = mp.recall(tenant_id=tenant, user_id="gina", query="Lisbon", k=2)
        assert hits[0]["memory_id"] == later["memory_id"]
        report = mp.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
        assert report["state"] == "COMPLETE" and report["backup_id"] == manifest["backup_id"]
        assert [m["memory_id"] for m in mp.list(tenant_id=tenant, user_id="gina")] == [kept["memory_id"]]
        # The restore changed the tenant: recall drops the write the backup predates.
        assert [h["memory_id"] for h in mp.recall(tenant_id=tenant, user_id="gina", query="Lisbon", k=2)] == [
            kept["memory_id"]
        ]
        with pytest.raises(ValidationError) as err:
            mp.restore(tenant_id=tenant, backup_id="not-a-backup")
        assert err.value.field == "backup"
