"""Forgetting on real engines: hide at once, cascade per scope, proofs without content, bad input,
and fault injection (each fault ends BLOCKED, then COMPLETE once cleared, with nothing left)."""

from __future__ import annotations

import json
import multiprocessing
import os
import uuid

import psycopg
import pytest

from memory_pipelines.defs.forget.ops import job_key
from memory_pipelines.lib.forget.deletion import DeletionBlocked, DeletionService
from memory_pipelines.lib.forget.erasure import ErasureService
from memory_pipelines.lib.infra.errors import NotFoundError, ServiceError, ValidationError
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores import lineage, registry
from memory_pipelines.lib.stores.analytics.rows import write_rows
from memory_pipelines.lib.stores.derived import open_derived

pytestmark = pytest.mark.slow


@pytest.fixture
def world(store, derived, tenant):
    """alice and bob in team core; personal and team memories; every derived store materialized."""
    store.set_sharing_mode = store.set_sharing_mode  # keep linters quiet about fixture use
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="alice")
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="bob")
    canary = f"canary-{uuid.uuid4().hex[:12]}"
    mem = {
        "alice_personal": store.write(
            tenant_id=tenant, user_id="alice", text=f"Alice's {canary} is a weakness for licorice"
        ),
        "alice_team": store.write(
            tenant_id=tenant, user_id="alice", text=f"Core deploy freeze starts {canary} Friday", team_id="core"
        ),
        "bob_personal": store.write(tenant_id=tenant, user_id="bob", text="Bob keeps sourdough starter alive"),
        "bob_team": store.write(tenant_id=tenant, user_id="bob", text="Core pager rotation is weekly", team_id="core"),
    }
    store.write(
        tenant_id=tenant,
        user_id="alice",
        text=f"Alice's {canary} is a weakness for salty licorice",
        memory_id=mem["alice_personal"].memory_id,
    )
    derived.sync_all(tenant_id=tenant)
    derived.recaller.recall(tenant_id=tenant, user_id="alice", query="licorice")
    return {"tenant": tenant, "canary": canary, **mem}


def everything_of(store, tenant, memory_id):
    with store.transaction() as conn:
        return {
            "versions": conn.execute(
                "SELECT count(*) FROM memory.memory_versions WHERE tenant_id = %s AND memory_id = %s",
                (tenant, memory_id),
            ).fetchone()[0],
            "lineage": conn.execute(
                "SELECT count(*) FROM derived.lineage WHERE tenant_id = %s AND source_memory_id = %s",
                (tenant, memory_id),
            ).fetchone()[0],
            "postings": conn.execute(
                "SELECT count(*) FROM derived.keyword_postings WHERE tenant_id = %s AND memory_id = %s",
                (tenant, memory_id),
            ).fetchone()[0],
        }


def test_hide_at_once_before_the_run_starts(store, derived, world):
    tenant = world["tenant"]
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice", basis="gdpr-art17")
    assert job["state"] == "REQUESTED" and job["duplicate"] is False
    # Nothing has been deleted yet, and nothing of alice is readable any more.
    assert everything_of(store, tenant, world["alice_personal"].memory_id)["versions"] == 2
    assert store.list_visible(tenant_id=tenant, user_id="alice") == []
    assert {m["user_id"] for m in store.list_visible(tenant_id=tenant, user_id="bob", team_id="core")} <= {"bob"}
    assert list(store.iter_export(tenant_id=tenant, subject="alice")) == []
    assert derived.recaller.recall(tenant_id=tenant, user_id="alice", query="licorice") == []
    with pytest.raises(NotFoundError):
        store.history(tenant_id=tenant, memory_id=world["alice_personal"].memory_id)
    with pytest.raises(Exception, match="being forgotten"):
        store.write(tenant_id=tenant, user_id="alice", text="sneaking in during deletion")
    # A second request for the same scope returns the open job.
    again = service.request(tenant_id=tenant, subject="alice", basis="gdpr-art17")
    assert (again["job_id"], again["duplicate"]) == (job["job_id"], True)


def test_subject_scope_removes_personal_and_team_contributions_and_rebuilds_team_summaries(store, derived, world):
    tenant = world["tenant"]
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    status = service.status(job_id=job["job_id"])
    assert status["state"] == "COMPLETE"
    assert set(status["targets"]) == {spec.name for spec in registry.stores()} | {"backups", "physical"}
    assert all(status["targets"][spec.name].startswith("DONE:") for spec in registry.stores())
    assert status["targets"]["physical"].startswith("PENDING:")  # the erasure run's, within 24 h
    # Her subject key, her group key and the keys of her 3 versions.
    assert status["targets"]["primary"] == "DONE:3" and status["targets"]["key_store"] == "DONE:5"
    for key in ("alice_personal", "alice_team"):
        assert everything_of(store, tenant, world[key].memory_id) == {"versions": 0, "lineage": 0, "postings": 0}
    for key in ("bob_personal", "bob_team"):
        assert everything_of(store, tenant, world[key].memory_id)["versions"] == 1
    team = derived.summaries.read(tenant_id=tenant, scope="team", scope_id="core")
    assert team["summary"] == "- Core pager rotation is weekly"
    assert team["sources"] == [{"memory_id": world["bob_team"].memory_id, "version": 1}]
    with pytest.raises(NotFoundError):
        derived.summaries.read(tenant_id=tenant, scope="subject", scope_id="alice")
    assert derived.vectors.ids(tenant) == {f"{world['bob_personal'].memory_id}:1", f"{world['bob_team'].memory_id}:1"}
    table = derived.analytics.read_partition(tenant)
    assert set(table["memory_id"].to_pylist()) == {world["bob_personal"].memory_id, world["bob_team"].memory_id}
    with store.transaction() as conn:
        assert (
            conn.execute(
                "SELECT count(*) FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = 'alice'", (tenant,)
            ).fetchone()[0]
            == 0
        )
        journal = conn.execute(
            "SELECT kind FROM control.journal WHERE job_id = %s ORDER BY seq", (job["job_id"],)
        ).fetchall()
        outbox = conn.execute("SELECT payload FROM control.outbox WHERE job_id = %s", (job["job_id"],)).fetchall()
    assert [k for (k,) in journal] == ["SUBJECT_EPOCH", "KEY_DESTROYED"]
    assert len(outbox) == 1
    proof = service.proof(job_id=job["job_id"])
    assert proof["jobId"] == job["job_id"] and proof["scopeHash"] == job["scope_hash"]
    assert proof["subjectEpoch"] == 1 and proof["verification"]["paraphrase_probes"]["probes"] == 3
    # alice may come back: a new write gets a new key and is visible again.
    again = store.write(tenant_id=tenant, user_id="alice", text="Alice is back")
    assert [m["memory_id"] for m in store.list_visible(tenant_id=tenant, user_id="alice")] == [again.memory_id]


def test_memory_scope_removes_exactly_that_version(store, derived, world):
    tenant = world["tenant"]
    target = world["alice_personal"].memory_id
    before_bob = everything_of(store, tenant, world["bob_personal"].memory_id)
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, memory_id=target, version=2)
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
    with store.transaction() as conn:
        left = conn.execute(
            "SELECT version FROM memory.memory_versions WHERE tenant_id = %s AND memory_id = %s", (tenant, target)
        ).fetchall()
        edges_v2 = conn.execute(
            "SELECT count(*) FROM derived.lineage WHERE tenant_id = %s AND source_memory_id = %s"
            " AND source_version = 2",
            (tenant, target),
        ).fetchone()[0]
    assert left == [(1,)] and edges_v2 == 0
    assert f"{target}:2" not in derived.vectors.ids(tenant)
    assert everything_of(store, tenant, world["bob_personal"].memory_id) == before_bob
    # The earlier version is current again; everything else of alice is untouched.
    history = store.history(tenant_id=tenant, memory_id=target)
    assert [(h["version"], h["current"]) for h in history] == [(1, True)]
    assert everything_of(store, tenant, world["alice_team"].memory_id)["versions"] == 1
    assert service.proof(job_id=job["job_id"])["targetVersions"] == 1


def test_tenant_scope_removes_everything_of_the_tenant(store, derived, world, endpoints):
    tenant = world["tenant"]
    service = DeletionService(derived)
    with pytest.raises(ValidationError, match="confirm"):
        service.request(tenant_id=tenant, all_tenant=True, confirm="someone-else")
    job = service.request(tenant_id=tenant, all_tenant=True, confirm=tenant, basis="offboarding")
    with pytest.raises(NotFoundError, match="deleted"):
        store.list_visible(tenant_id=tenant, user_id="bob")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
    with psycopg.connect(endpoints.store_conninfo) as conn:
        for table in (
            "memory.memories",
            "memory.memory_versions",
            "memory.team_members",
            "derived.lineage",
            "derived.keyword_postings",
            "derived.summaries",
            "derived.recall_cache",
            "keystore.subject_keys",
            "keystore.tenant_keys",
            "keystore.team_keys",
        ):
            count = conn.execute(f"SELECT count(*) FROM {table} WHERE tenant_id = %s", (tenant,)).fetchone()[0]
            assert count == 0, table
    assert derived.analytics.read_partition(tenant) is None
    assert not derived.vectors.drop(tenant)  # the collection is already gone
    with pytest.raises(NotFoundError):
        store.write(tenant_id=tenant, user_id="bob", text="the tenant is gone")


def test_proofs_audit_rows_outbox_and_dagster_metadata_hold_no_memory_text(
    store, derived, world, session_settings, endpoints
):
    import dagster as dg

    from memory_pipelines.definitions import defs
    from memory_pipelines.defs.forget.jobs import forget_run_config

    tenant, canary = world["tenant"], world["canary"]
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [tenant])
        os.environ["MEMORY_PIPELINES_HOME"] = str(session_settings.home)
        result = (
            defs()
            .resolve_job_def("forget")
            .execute_in_process(
                instance=instance,
                partition_key=tenant,
                run_config=forget_run_config(job_ids=[job["job_id"]]),
            )
        )
        assert result.success
        events = instance.all_logs(result.run_id)
        assert canary not in json.dumps([str(e) for e in events])
        materialized = {
            e.asset_materialization.asset_key.to_user_string()
            for e in events
            if e.dagster_event and e.dagster_event.event_type_value == "ASSET_MATERIALIZATION"
            for _ in [0]
            if e.asset_materialization
        }
        assert {"memory_deletions", "memory_embeddings", "team_summaries", "analytics_memories"} <= materialized
        [deletions] = [
            e.step_materialization_data.materialization
            for e in result.get_asset_materialization_events()
            if e.asset_key.to_user_string() == "memory_deletions"
        ]
        assert deletions.metadata["deletion_states"].value == {job["job_id"]: "COMPLETE"}
        assert deletions.metadata[job_key("proof", job["job_id"])].value["scopeHash"] == job["scope_hash"]
    with psycopg.connect(endpoints.store_conninfo) as conn:
        for table in (
            "control.deletion_jobs",
            "control.audit",
            "control.outbox",
            "control.journal",
            "control.deletion_targets",
        ):
            dump = json.dumps([list(map(str, r)) for r in conn.execute(f"SELECT * FROM {table}").fetchall()])
            assert canary not in dump, table
    assert canary not in json.dumps(service.proof(job_id=job["job_id"]))


def test_bad_requests(store, derived, world):
    tenant = world["tenant"]
    service = DeletionService(derived)
    cases = [
        # An unknown subject is a typo or a stranger: never a job, never a proof of nothing.
        (dict(tenant_id=tenant, subject="never-wrote-anything"), NotFoundError, "subject"),
        (dict(tenant_id="no-such-tenant-f", subject="x"), NotFoundError, "tenant"),
        (dict(tenant_id=tenant, memory_id="m_123"), ValidationError, "memory_id"),
        (dict(tenant_id=tenant, memory_id="m_" + "a" * 32), NotFoundError, "memory_id"),
        (dict(tenant_id=tenant, memory_id=world["bob_personal"].memory_id, version=9), NotFoundError, "version"),
        (dict(tenant_id=tenant, subject="x'; --"), ValidationError, "subject"),
        (dict(tenant_id=tenant, all_tenant=True), ValidationError, "confirm"),
        (dict(tenant_id=tenant, subject="x", basis="because"), ValidationError, "basis"),
        (dict(tenant_id=tenant), ValidationError, "scope"),
    ]
    for kwargs, error, field in cases:
        with pytest.raises(error) as err:
            service.request(**kwargs)
        assert err.value.field == field
    other = store.write(tenant_id=tenant + "-x", user_id="eve", text="other tenant")
    with pytest.raises(NotFoundError, match="memory_id"):
        service.request(tenant_id=tenant, memory_id=other.memory_id)


def test_writing_to_an_unregistered_store_is_refused(store, tenant):
    with store.transaction() as conn, pytest.raises(ServiceError, match="no registered delete adapter"):
        lineage.insert_edges(conn, tenant_id=tenant, store="shadow_copy", records=[("r1", ("m_" + "0" * 32, 1))])


# -- fault injection -----------------------------------------------------------------------------


def leftovers(store, tenant, memory_ids):
    return sum(sum(everything_of(store, tenant, m).values()) for m in memory_ids)


def test_lost_adapter_answer_blocks_then_retry_completes(store, derived, world):
    tenant = world["tenant"]
    calls = []

    def lose_answer(step, job_ids):
        calls.append(step)
        if len(calls) == 1:
            raise TimeoutError("the Chroma delete succeeded but its answer never came back")

    service = DeletionService(derived, hooks={"deleted:chroma": lose_answer})
    job = service.request(tenant_id=tenant, subject="alice")
    with pytest.raises(DeletionBlocked):
        service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    blocked = service.status(job_id=job["job_id"])
    assert blocked["state"] == "BLOCKED" and blocked["targets"]["chroma"].startswith("FAILED:")
    assert store.list_visible(tenant_id=tenant, user_id="alice") == []  # still hidden while blocked
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    done = service.status(job_id=job["job_id"])
    assert done["state"] == "COMPLETE" and done["attempts"] == 2 and done["targets"]["chroma"] == "DONE:2"
    assert leftovers(store, tenant, [world["alice_personal"].memory_id, world["alice_team"].memory_id]) == 0


def test_postgres_connection_dropped_mid_run(store, derived, world, endpoints):
    tenant = world["tenant"]

    def drop_connections(step, job_ids):
        with psycopg.connect(endpoints.store_conninfo, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )

    service = DeletionService(derived, hooks={"deleted:keyword_index": drop_connections})
    job = service.request(tenant_id=tenant, subject="alice")
    with pytest.raises(DeletionBlocked):
        service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "BLOCKED"
    DeletionService(derived).run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
    assert leftovers(store, tenant, [world["alice_personal"].memory_id, world["alice_team"].memory_id]) == 0


def test_verification_finds_a_stale_analytics_row(store, derived, world):
    """The analytics check counts the subject's rows by exact id: one put back after the delete (as a
    writer that missed the ordering would) must block the job."""
    tenant = world["tenant"]
    saved: list[tuple[object, ...]] = []

    def put_back(step: str, job_ids: list[str]) -> None:
        left = set(derived.analytics.read_partition(tenant)["memory_id"].to_pylist())
        with store.transaction() as conn:
            write_rows(conn, [row for row in saved if row[0] not in left])

    hooks = {
        "frozen": lambda step, job_ids: saved.extend(
            tuple(r.values()) for r in derived.analytics.read_partition(tenant).to_pylist()
        ),
        "deleted:analytics": put_back,
    }
    service = DeletionService(derived, hooks=hooks)
    job = service.request(tenant_id=tenant, subject="alice")
    with pytest.raises(DeletionBlocked) as err:
        service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert err.value.code == "VERIFICATION_ANALYTICS"
    DeletionService(derived).run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"


def test_a_cached_recall_naming_a_target_goes_even_without_a_lineage_edge(store, derived, world):
    tenant = world["tenant"]
    target = world["alice_personal"].memory_id
    with store.transaction() as conn:
        conn.execute(
            "INSERT INTO derived.recall_cache (tenant_id, cache_key, change_seq, results) VALUES (%s, %s, 0, %s)",
            (tenant, b"\x01planted", json.dumps([[target, 1, 0.9]])),
        )
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
    with store.transaction() as conn:
        left = conn.execute(
            "SELECT count(*) FROM derived.recall_cache WHERE tenant_id = %s AND results @> %s::jsonb",
            (tenant, json.dumps([[target]])),
        ).fetchone()[0]
    assert left == 0


def test_verification_finds_a_planted_leftover(store, derived, world):
    tenant = world["tenant"]
    planted = f"{world['alice_personal'].memory_id}:2"

    def plant(step, job_ids):
        derived.vectors.collection(tenant).add(
            ids=[planted],
            embeddings=[[0.05] * 384],
            metadatas=[
                {
                    "memory_id": world["alice_personal"].memory_id,
                    "version": 2,
                    "user_id": "alice",
                    "team_id": "",
                    "shareable": False,
                    "category": "general",
                    "epoch": 0,
                }
            ],
        )

    service = DeletionService(derived, hooks={"deleted:key_store": plant})
    job = service.request(tenant_id=tenant, subject="alice")
    with pytest.raises(DeletionBlocked) as err:
        service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert err.value.code == "VERIFICATION_CHROMA"
    status = service.status(job_id=job["job_id"])
    assert status["state"] == "BLOCKED" and status["targets"]["verify"] == "FAILED:VERIFICATION_CHROMA"
    derived.vectors.collection(tenant).delete(ids=[planted])
    DeletionService(derived).run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"


def _run_and_die(home: str, tenant: str, job_id: str) -> None:
    from memory_pipelines.lib.infra.settings import Settings

    settings = Settings.from_env({"MEMORY_PIPELINES_HOME": home})
    store = open_store(settings)
    derived = open_derived(settings, store)

    def die(step, job_ids):
        os._exit(17)  # the process is killed between two steps, no cleanup of any kind

    DeletionService(derived, hooks={"deleted:keyword_index": die}).run_batch(tenant_id=tenant, job_ids=[job_id])


def test_process_killed_between_steps_resumes_from_the_control_plane(store, derived, world, session_settings):
    tenant = world["tenant"]
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    child = multiprocessing.get_context("spawn").Process(
        target=_run_and_die, args=(str(session_settings.home), tenant, job["job_id"])
    )
    child.start()
    child.join(120)
    assert child.exitcode == 17
    mid = service.status(job_id=job["job_id"])
    assert mid["state"] == "DELETING" and mid["targets"]["keyword_index"].startswith("DONE")
    assert "primary" not in mid["targets"]
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
    assert leftovers(store, tenant, [world["alice_personal"].memory_id, world["alice_team"].memory_id]) == 0


def test_chroma_server_down_blocks_then_completes_when_it_is_back(store, derived, tenant, tmp_path):
    import dataclasses

    from memory_pipelines.lib.stores.chroma.index import VectorStore
    from tests.support.servers import chroma_server

    memory = store.write(tenant_id=tenant, user_id="alice", text="Alice's vectors live on a Chroma server")
    data = tmp_path / "chroma-data"
    with chroma_server(data) as (url, _):
        remote = dataclasses.replace(derived, vectors=VectorStore(embedder=derived.vectors.embedder, url=url))
        remote.sync_all(tenant_id=tenant)
        assert remote.vectors.ids(tenant) == {f"{memory.memory_id}:1"}
    # The server is down when the forget run reaches Chroma.
    service = DeletionService(remote)
    job = service.request(tenant_id=tenant, subject="alice")
    with pytest.raises(DeletionBlocked) as err:
        service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert err.value.code == "CHROMA_UNAVAILABLE"
    blocked = service.status(job_id=job["job_id"])
    assert blocked["state"] == "BLOCKED" and blocked["targets"]["chroma"] == "FAILED:CHROMA_UNAVAILABLE"
    assert "primary" not in blocked["targets"]  # nothing after the failed store ran
    with chroma_server(data) as (url, _):
        back = dataclasses.replace(derived, vectors=VectorStore(embedder=derived.vectors.embedder, url=url))
        DeletionService(back).run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
        assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
        assert back.vectors.ids(tenant) == set()


def test_canary_drill_passes_through_dagster_and_reports_figures(session_settings):
    import dagster as dg

    from memory_pipelines.definitions import defs

    os.environ["MEMORY_PIPELINES_HOME"] = str(session_settings.home)
    with dg.instance_for_test() as instance:
        result = defs().resolve_job_def("canary_drill").execute_in_process(instance=instance)
        assert result.success
        [materialization] = result.asset_materializations_for_node("deletion_canary")
        metadata = materialization.metadata
        assert metadata["passed"].value is True
        assert metadata["restore_from_backup"].value == "COMPLETE"  # backed up, forgotten, restored: still zero
        assert {k: v.value for k, v in metadata.items() if k.startswith("leftover_")} == {
            "leftover_recall": 0,
            "leftover_lineage": 0,
            "leftover_primary": 0,
            "leftover_vectors": 0,
            "leftover_files_under_home": 0,
            "leftover_erasure_scan_hits": 0,
        }
        [check] = result.get_asset_check_evaluations()
        assert check.passed


def _windows_holding(floats, unit) -> list[int]:
    """Starts of the windows of `floats` with a dot product above 0.999 with `unit` and a norm within
    1e-3 of 1. Such a window has no value beyond 1.001 either way, so only windows without one are
    correlated (one FFT: the product of every window, and a check of each, took tens of seconds once a
    session's Chroma server had logged some 20 MB), and each candidate is then checked directly."""
    import numpy as np

    size = len(unit)
    big = np.abs(floats) > 1.001
    counts = np.concatenate(([0], np.cumsum(big)))
    small = counts[size:] - counts[:-size] == 0
    if not small.any():
        return []
    tame = np.where(big, 0.0, floats)  # only windows left out change; the transform's rounding stays tiny
    length = 1 << (len(tame) + size - 2).bit_length()
    spectrum = np.fft.rfft(tame, length) * np.conj(np.fft.rfft(unit, length))
    dots = np.fft.irfft(spectrum, length)[: len(tame) - size + 1]
    starts = np.nonzero(small & (dots > 0.999 - 1e-6))[0]
    return [
        int(i)
        for i in starts
        if floats[i : i + size] @ unit > 0.999 and abs(np.linalg.norm(floats[i : i + size]) - 1.0) < 1e-3
    ]


def _files_with_vector(root, vector) -> list[str]:
    """Files holding `vector` as float32 at any offset, allowing for the rounding of Chroma's normalisation."""
    import numpy as np

    unit = np.asarray(vector, dtype=np.float64)
    unit /= np.linalg.norm(unit)
    out = []
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        data = path.read_bytes()
        for align in range(4):
            usable = (len(data) - align) // 4
            if usable < len(unit):
                continue
            floats = np.nan_to_num(np.frombuffer(data, dtype="<f4", count=usable, offset=align).astype(np.float64))
            if _windows_holding(np.clip(floats, -1e3, 1e3), unit):
                out.append(str(path.relative_to(root)))
                break
    return sorted(out)


def test_erased_vectors_leave_the_chroma_files_while_kept_vectors_stay(store, derived, world):
    """Chroma's delete only flags a vector; the erasure must remove its bytes from every file."""
    tenant = world["tenant"]
    gone = f"{world['alice_personal'].memory_id}:2"
    kept = f"{world['bob_personal'].memory_id}:1"
    stored = derived.vectors.vectors_of(tenant, [gone, kept])
    root = derived.vectors.path
    assert _files_with_vector(root, stored[gone]), "the control: a vector to erase is in the files beforehand"
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, memory_id=world["alice_personal"].memory_id)
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
    assert gone not in derived.vectors.ids(tenant)  # deleted through Chroma's API: unreadable at once
    ErasureService(derived).erase_tenant(tenant_id=tenant)  # the rewrite, out of the cascade
    assert service.status(job_id=job["job_id"])["targets"]["physical"].startswith("ERASED:")
    assert _files_with_vector(root, stored[gone]) == []
    assert _files_with_vector(root, stored[kept]) != []
    assert gone not in derived.vectors.ids(tenant) and kept in derived.vectors.ids(tenant)
