"""Issue 11's reproductions of resurrection and races, one deterministic test each.

Each places a write, a build or a second request inside the window a deletion opens (with the
project's own hooks, a blocking summarizer or store, or a short delay inside a write's
transaction) and checks what is left after the job is COMPLETE. Stores in other threads use
their own connections and key caches, as other processes would.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from memory_pipelines.lib.backups.service import BackupService
from memory_pipelines.lib.backups.storage import LocalBackupStorage
from memory_pipelines.lib.forget import targets
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.erasure import ErasureService
from memory_pipelines.lib.forget.gate import FenceClosed, Gate
from memory_pipelines.lib.forget.ledger import DeletionLedger
from memory_pipelines.lib.infra.errors import ConflictError, NotFoundError, PermissionDeniedError
from memory_pipelines.lib.memories.keys import KeyDestroyedError, KeyStore
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import DeletionJob, DeletionRequest, RollBack
from memory_pipelines.lib.stores import bytescan
from memory_pipelines.lib.stores.analytics.store import AnalyticsStore
from memory_pipelines.lib.stores.chroma.index import VectorStore
from memory_pipelines.lib.stores.derived import DerivedStores
from memory_pipelines.lib.stores.keyword.index import KeywordIndex
from memory_pipelines.lib.stores.summaries.store import ExtractiveSummarizer, SummaryStore
from tests.integration.test_forget import _files_with_vector, everything_of
from tests.support.attacker import find_exact, home_files

pytestmark = pytest.mark.slow


@pytest.fixture
def world(store, derived, tenant):
    """alice and bob in team core, personal and team memories, every derived store materialized."""
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="alice")
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="bob")
    canary = f"cnry{uuid.uuid4().hex[:12]}"
    first = f"Alice's {canary} is a weakness for licorice"
    mem = {
        "alice_personal": store.write(tenant_id=tenant, user_id="alice", text=first),
        "alice_team": store.write(
            tenant_id=tenant, user_id="alice", text=f"Core freeze {canary} Friday", team_id="core"
        ),
        "bob_personal": store.write(tenant_id=tenant, user_id="bob", text="Bob keeps sourdough starter alive"),
        "bob_team": store.write(tenant_id=tenant, user_id="bob", text="Core pager rotation is weekly", team_id="core"),
    }
    store.write(
        tenant_id=tenant,
        user_id="alice",
        text=f"Alice's {canary} is salty licorice",
        memory_id=mem["alice_personal"].memory_id,
    )
    derived.sync_all(tenant_id=tenant)
    return {"tenant": tenant, "canary": canary, "first_text": first, **mem}


def another_store(store: MemoryStore, keys: KeyStore | None = None) -> MemoryStore:
    """The same database through a connection and key cache of its own (what another process has)."""
    return MemoryStore(store.conninfo, keys or KeyStore(store.keys.master))


class BlockingStore(MemoryStore):
    """Reads texts, then waits until released: the seconds a slow build spends between read and write."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store.conninfo, KeyStore(store.keys.master))
        self.reached = threading.Event()
        self.release = threading.Event()

    def open_texts(self, **kwargs: Any) -> dict[tuple[str, int], str]:
        texts = super().open_texts(**kwargs)
        self.reached.set()
        assert self.release.wait(60)
        return texts


class SlowKeys(KeyStore):
    """Sleeps inside the writer's transaction (after its locks): a write in flight for `delay` seconds."""

    def __init__(self, master: Any, delay: float) -> None:
        super().__init__(master)
        self.delay = delay
        self.inside = threading.Event()

    def for_writes(self, conn: Any, tenant_id: str, wanted: dict[str, int]) -> Any:
        self.inside.set()
        time.sleep(self.delay)
        return super().for_writes(conn, tenant_id, wanted)


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def forget_now(derived: DerivedStores, tenant: str, **scope: Any) -> DeletionJob:
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, **scope)
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    done = service.status(job_id=job["job_id"])
    assert done["state"] == "COMPLETE"
    return done


def alice_sources(store: MemoryStore, tenant: str) -> list[str]:
    with store.transaction() as conn:
        return [r[0] for r in conn.execute("SELECT memory_id FROM memory.memories WHERE tenant_id = %s", (tenant,))]


# -- 6. a build that read before the deletion and writes after its COMPLETE ------------------------


def test_06_summary_build_racing_a_forget_writes_nothing_back_and_mints_no_key(store, derived, world):
    tenant = world["tenant"]
    store.write(tenant_id=tenant, user_id="alice", text=f"Alice's {world['canary']} second fact")  # summary now stale
    reached, release = threading.Event(), threading.Event()

    class Slow(ExtractiveSummarizer):
        def summarize(self, texts: list[str]) -> str:
            reached.set()
            assert release.wait(60)
            return super().summarize(texts)

    racing = SummaryStore(another_store(store), Slow())
    thread, out = in_thread(lambda: racing.sync(tenant_id=tenant, scope="subject"))
    assert reached.wait(30)
    forget_now(derived, tenant, subject="alice")
    release.set()
    thread.join(60)
    assert "error" not in out, out
    with store.transaction() as conn:
        summaries = conn.execute(
            "SELECT count(*) FROM derived.summaries WHERE tenant_id = %s AND scope = 'subject' AND scope_id = 'alice'",
            (tenant,),
        ).fetchone()[0]
        keys = conn.execute(
            "SELECT count(*) FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = 'alice'", (tenant,)
        ).fetchone()[0]
    assert summaries == 0, "a summary of the forgotten subject came back after COMPLETE"
    assert keys == 0, "a derived build minted a new key for the forgotten subject"
    assert out["result"]["discarded"] >= 1


@pytest.mark.parametrize("build", ["keyword_index", "analytics"])
def test_06_index_builds_racing_a_forget_discard_what_was_forgotten(store, derived, world, build, tmp_path):
    tenant = world["tenant"]
    late = store.write(tenant_id=tenant, user_id="alice", text=f"Alice's {world['canary']} late fact")
    blocking = BlockingStore(store)
    if build == "keyword_index":
        thread, out = in_thread(lambda: KeywordIndex(blocking).sync(tenant_id=tenant))
    else:
        racing = AnalyticsStore(store=store)
        thread, out = in_thread(lambda: racing.rebuild(store=blocking, tenant_id=tenant))
    assert blocking.reached.wait(30)
    forget_now(derived, tenant, subject="alice")
    blocking.release.set()
    thread.join(60)
    assert "error" not in out, out
    assert everything_of(store, tenant, late.memory_id) == {"versions": 0, "lineage": 0, "postings": 0}
    table = derived.analytics.read_partition(tenant)
    assert table is None or late.memory_id not in table["memory_id"].to_pylist()


def test_06_chroma_sync_racing_a_forget_leaves_no_vector(store, derived, world, tmp_path):
    from tests.support.servers import chroma_server

    tenant = world["tenant"]
    with chroma_server(tmp_path / "chroma") as (url, _):
        vectors = VectorStore(embedder=derived.vectors.embedder, url=url)
        on_server = dataclasses.replace(derived, vectors=vectors)
        vectors.sync(store=store, tenant_id=tenant)
        late = store.write(tenant_id=tenant, user_id="alice", text=f"Alice's {world['canary']} late fact")
        blocking = BlockingStore(store)
        racing = VectorStore(embedder=derived.vectors.embedder, url=url)
        thread, out = in_thread(lambda: racing.sync(store=blocking, tenant_id=tenant))
        assert blocking.reached.wait(30)
        forget_now(on_server, tenant, subject="alice")
        blocking.release.set()
        thread.join(60)
        assert "error" not in out, out
        assert f"{late.memory_id}:1" not in vectors.ids(tenant)
        assert everything_of(store, tenant, late.memory_id)["lineage"] == 0


# -- 7. an eager refresh between acceptance and cascade -------------------------------------------


def test_07_refresh_between_acceptance_and_cascade_does_not_defeat_physical_erasure(store, derived, world):
    tenant = world["tenant"]
    memory_id = world["alice_personal"].memory_id
    gone = f"{memory_id}:2"
    stored = derived.vectors.vectors_of(tenant, [gone])
    assert _files_with_vector(derived.vectors.path, stored[gone])
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, memory_id=memory_id)
    derived.sync_all(tenant_id=tenant)  # what eager automation runs when the tenant's memories change
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    done = service.status(job_id=job["job_id"])
    assert done["state"] == "COMPLETE"
    assert done["targets"]["chroma"] == "DONE:1"
    ErasureService(derived).erase_tenant(tenant_id=tenant)  # the physical erasure, out of the cascade
    assert _files_with_vector(derived.vectors.path, stored[gone]) == []


# -- 8, 9, 10: writes that copy, race or land inside a deletion ------------------------------------


def test_08_rollback_never_copies_a_version_being_forgotten(store, derived, world):
    tenant, memory_id = world["tenant"], world["alice_personal"].memory_id
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, memory_id=memory_id, version=1)
    with pytest.raises(ConflictError) as err:
        store.rollback(tenant_id=tenant, memory_id=memory_id, user_id="alice")
    assert err.value.field == "memory_id" and "being forgotten" in err.value.message
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    texts = [v["text"] for v in store.history(tenant_id=tenant, memory_id=memory_id)]
    assert world["first_text"] not in texts and len(texts) == 1


def test_09_forget_of_a_memory_covers_a_new_version_written_in_flight(store, derived, world):
    tenant, memory_id = world["tenant"], world["bob_personal"].memory_id
    slow = SlowKeys(store.keys.master, delay=1.0)
    writer = another_store(store, slow)
    thread, out = in_thread(
        lambda: writer.write(tenant_id=tenant, user_id="bob", text="Bob keeps two starters", memory_id=memory_id)
    )
    assert slow.inside.wait(30)
    time.sleep(0.2)
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, memory_id=memory_id)
    thread.join(30)
    assert out["result"].version == 2
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["target_versions"] == 2
    assert everything_of(store, tenant, memory_id) == {"versions": 0, "lineage": 0, "postings": 0}


def test_10_bulk_write_mid_cascade_is_refused_and_the_tenant_stays_healthy(store, derived, world):
    tenant = world["tenant"]
    refused: list[BaseException] = []

    def bulk(step: str, jobs: list[str]) -> None:
        try:
            another_store(store).write_many(tenant_id=tenant, items=[{"user_id": "alice", "text": "Alice bulk fact"}])
        except ConflictError as exc:
            refused.append(exc)

    service = DeletionService(derived, hooks={"frozen": bulk})
    job = service.request(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
    assert len(refused) == 1 and refused[0].field == "user"
    assert store.list_visible(tenant_id=tenant, user_id="alice") == []
    assert list(store.iter_export(tenant_id=tenant, subject="alice")) == []
    assert derived.sync_all(tenant_id=tenant)["memory_embeddings"]["records"] == 2  # bob's two


# -- 11, 12: keys and summaries at the moment of use ------------------------------------------------


def test_11_a_key_destroyed_elsewhere_stops_decrypting_in_a_long_lived_process(store, derived, world):
    tenant = world["tenant"]
    source = (world["alice_personal"].memory_id, 2)
    long_lived = another_store(store)
    assert long_lived.open_texts(tenant_id=tenant, sources=[source])  # its key cache is warm
    with long_lived.transaction() as conn:
        key_id, text_ct = conn.execute(
            "SELECT key_id, text_ct FROM memory.memory_versions WHERE tenant_id = %s AND memory_id = %s"
            " AND version = 2",
            (tenant, source[0]),
        ).fetchone()
    service = DeletionService(derived)
    shredded = service.shred_keys(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[shredded["forget_job"]["job_id"]])
    with long_lived.transaction() as conn, pytest.raises(KeyDestroyedError):
        long_lived.keys.key_by_id(conn, tenant, key_id)
    assert long_lived.open_texts(tenant_id=tenant, sources=[source], skip_unreadable=True) == {}
    assert bytes(text_ct)  # the ciphertext we kept stays just that


def test_12_summaries_are_hidden_the_moment_a_forget_is_accepted(store, derived, world):
    tenant = world["tenant"]
    assert world["canary"] in derived.summaries.read(tenant_id=tenant, scope="subject", scope_id="alice")["summary"]
    assert world["canary"] in derived.summaries.read(tenant_id=tenant, scope="team", scope_id="core")["summary"]
    DeletionService(derived).request(tenant_id=tenant, subject="alice")  # accepted, not run
    for scope, scope_id in (("subject", "alice"), ("team", "core")):
        with pytest.raises(NotFoundError) as err:
            derived.summaries.read(tenant_id=tenant, scope=scope, scope_id=scope_id)
        assert "being rebuilt" in err.value.message
    assert derived.summaries.read(tenant_id=tenant, scope="subject", scope_id="bob")["summary"]


# -- 13: the restore gate and a write that began before it closed ---------------------------------


def test_13_restore_waits_for_a_write_in_flight_and_completes(store, derived, world, tmp_path):
    tenant = world["tenant"]
    backups = BackupService(
        store, LocalBackupStorage(tmp_path / "backups"), staging=tmp_path / "staging", job_records=DeletionLedger(store)
    )
    taken = backups.backup(tenant_id=tenant)
    slow = SlowKeys(store.keys.master, delay=1.0)
    writer = another_store(store, slow)
    memory_id = world["bob_personal"].memory_id
    thread, out = in_thread(
        lambda: writer.write(tenant_id=tenant, user_id="bob", text="Bob keeps a rye starter", memory_id=memory_id)
    )
    assert slow.inside.wait(30)
    time.sleep(0.2)
    report = backups.restore(tenant_id=tenant, backup_id=taken["backup_id"])
    thread.join(30)
    assert "error" not in out, out
    assert report["state"] == "COMPLETE"
    assert {m["text"] for m in store.list_visible(tenant_id=tenant, user_id="bob")} == {
        "Bob keeps sourdough starter alive"
    }


# -- 14, 15: concurrent requests and rollbacks; permits on a closed tenant ------------------------


def test_14_identical_concurrent_forget_requests_get_the_one_open_job(store, derived, world):
    tenant = world["tenant"]
    barrier = threading.Barrier(6)

    def request() -> DeletionRequest:
        service = DeletionService(dataclasses.replace(derived, store=another_store(store)))
        barrier.wait(10)
        return service.request(tenant_id=tenant, subject="bob")

    runs = [in_thread(request) for _ in range(6)]
    for thread, _ in runs:
        thread.join(30)
    results = [out.get("result") or out.get("error") for _, out in runs]
    assert all(isinstance(r, dict) for r in results), results
    assert len({r["job_id"] for r in results}) == 1
    assert sorted(r["duplicate"] for r in results) == [False] + [True] * 5


def test_14_concurrent_rollbacks_each_append_a_version(store, world):
    tenant, memory_id = world["tenant"], world["bob_personal"].memory_id
    store.write(tenant_id=tenant, user_id="bob", text="Bob keeps a rye starter", memory_id=memory_id)
    barrier = threading.Barrier(4)

    def rollback() -> RollBack:
        other = another_store(store)
        barrier.wait(10)
        return other.rollback(tenant_id=tenant, memory_id=memory_id, user_id="bob")

    runs = [in_thread(rollback) for _ in range(4)]
    for thread, _ in runs:
        thread.join(30)
    assert [out.get("error") for _, out in runs] == [None] * 4
    assert sorted(out["result"]["version"] for _, out in runs) == [3, 4, 5, 6]


def test_15_no_permit_for_a_lease_on_a_deleted_tenant_even_if_it_read_nothing(store, derived, world):
    tenant = world["tenant"]
    gate = Gate(store)
    lease = gate.open_lease(tenant_id=tenant, subject_id="alice", run_id="run-quiet")
    idle = gate.open_lease(tenant_id=tenant, subject_id="bob", run_id="run-bob")
    DeletionService(derived).request(tenant_id=tenant, subject="bob")
    with pytest.raises(FenceClosed):
        gate.acquire(lease_id=idle, sink="model_output")  # bob is being forgotten: his run stops
    with gate.permit(lease_id=lease, sink="model_output"):
        pass  # alice's run is untouched
    DeletionService(derived).request(tenant_id=tenant, all_tenant=True, confirm=tenant)
    with pytest.raises(FenceClosed):
        gate.acquire(lease_id=lease, sink="model_output")


# -- 16: a summary rebuilt by another process while the cascade freezes ---------------------------


@pytest.mark.parametrize("scope", ["memory_id", "version"])
def test_16_a_summary_rebuilt_without_the_forgotten_memory_mid_freeze_does_not_stop_its_erasure(
    store, derived, world, monkeypatch, session_settings, scope
):
    """Found by the soak (erasure_incomplete, both windows of one blob in the tenant's
    derived.summaries): a sync that rebuilt a summary without the memory being forgotten, between the
    cascade's read of the lineage and its fingerprints, had the new summary fingerprinted. Its
    sources did not change again, so the cascade's own sync left it as it was, live, and every
    erasure of the job found it and refused."""
    tenant = world["tenant"]
    memory_id = world["alice_personal"].memory_id
    store.write(tenant_id=tenant, user_id="alice", text="Alice waters the ferns on Mondays")  # alice keeps a summary
    derived.sync_all(tenant_id=tenant)
    with store.transaction() as conn:
        (stating,) = conn.execute(
            "SELECT summary_ct FROM derived.summaries WHERE tenant_id = %s AND scope = %s AND scope_id = %s",
            (tenant, "subject", "alice"),
        ).fetchone()
    stating = bytes(stating)  # the summary that states the text forgotten below
    ends = dict(zip(("first", "last"), bytescan.windows(stating), strict=True))  # what the cascade fingerprints
    assert find_exact(home_files(session_settings.home), ends), "the control: its bytes are in PostgreSQL's files"
    fingerprint = targets.fingerprint

    def rebuilt_meanwhile(conn: Any, records: Any, jobs: Any, probes: Any) -> None:
        thread, out = in_thread(lambda: derived.summaries.sync(tenant_id=tenant, scope="subject"))  # its own connection
        thread.join(60)
        assert out.get("result", {}).get("rebuilt") == 1, out
        fingerprint(conn, records, jobs, probes)

    monkeypatch.setattr(targets, "fingerprint", rebuilt_meanwhile)
    if scope == "memory_id":
        forget_now(derived, tenant, memory_id=memory_id)
    else:
        forget_now(derived, tenant, memory_id=memory_id, version=2)
    summary = derived.summaries.read(tenant_id=tenant, scope="subject", scope_id="alice")["summary"]
    assert "ferns" in summary and "salty" not in summary  # the text of version 2 is gone from it
    report = ErasureService(derived).erase_tenant(tenant_id=tenant)
    assert report["erased"] == 1 and report["byteScan"]["hits"] == 0, report["byteScan"]
    # The summary that stated it, replaced by the build meanwhile, is in no file of HOME either.
    assert find_exact(home_files(session_settings.home), ends) == {}


# -- 4, 5: unknown subjects and the acting user ---------------------------------------------------


def test_04_unknown_subjects_never_get_a_job_or_a_proof(store, derived, world):
    tenant = world["tenant"]
    service = DeletionService(derived)
    for call in (
        lambda: service.request(tenant_id=tenant, subject="Alice"),
        lambda: service.shred_keys(tenant_id=tenant, subject="nobody"),
    ):
        with pytest.raises(NotFoundError) as err:
            call()
        assert err.value.field == "subject"
    assert service.list_jobs(tenant_id=tenant) == []


def test_05_only_the_author_rolls_back_or_flags_a_memory(store, world):
    tenant, memory_id = world["tenant"], world["alice_personal"].memory_id
    with pytest.raises(PermissionDeniedError):
        store.rollback(tenant_id=tenant, memory_id=memory_id, user_id="bob")
    with pytest.raises(PermissionDeniedError):
        store.set_do_not_sell(tenant_id=tenant, user_id="bob", memory_id=memory_id)
    with pytest.raises(PermissionDeniedError):
        store.set_do_not_sell(tenant_id=tenant, user_id="bob", subject="alice")
    assert len(store.history(tenant_id=tenant, memory_id=memory_id)) == 2
    assert not any(m["do_not_sell"] for m in store.list_visible(tenant_id=tenant, user_id="alice"))


# -- found by the soak ------------------------------------------------------------------------------


def test_a_forgotten_version_number_is_never_reused(store, derived, world):
    tenant, memory_id = world["tenant"], world["bob_personal"].memory_id
    store.write(tenant_id=tenant, user_id="bob", text="Bob keeps a rye starter", memory_id=memory_id)
    forget_now(derived, tenant, memory_id=memory_id, version=2)
    again = store.write(tenant_id=tenant, user_id="bob", text="Bob keeps a spelt starter", memory_id=memory_id)
    assert again.version == 3, "a new version under a forgotten number is hidden by its tombstone"
    history = store.history(tenant_id=tenant, memory_id=memory_id)
    assert [(v["version"], v["text"]) for v in history] == [
        (1, "Bob keeps sourdough starter alive"),
        (3, "Bob keeps a spelt starter"),
    ]


def test_forget_after_a_restore_removes_copies_of_versions_the_restore_dropped(store, derived, world, tmp_path):
    tenant = world["tenant"]
    backups = BackupService(
        store, LocalBackupStorage(tmp_path / "backups"), staging=tmp_path / "staging", job_records=DeletionLedger(store)
    )
    taken = backups.backup(tenant_id=tenant)
    late = store.write(tenant_id=tenant, user_id="alice", text=f"Core late fact {world['canary']}x", team_id="core")
    derived.sync_all(tenant_id=tenant)  # indexed, embedded, in the team summary
    assert f"{world['canary']}x" in derived.summaries.read(tenant_id=tenant, scope="team", scope_id="core")["summary"]
    assert backups.restore(tenant_id=tenant, backup_id=taken["backup_id"])["state"] == "COMPLETE"
    done = forget_now(derived, tenant, subject="alice")  # before any rebuild of the derived stores
    assert done["target_versions"] == 3  # alice's restored versions; the dropped one's copies go too
    assert everything_of(store, tenant, late.memory_id) == {"versions": 0, "lineage": 0, "postings": 0}
    assert f"{late.memory_id}:1" not in derived.vectors.ids(tenant)
    with pytest.raises(NotFoundError):  # the restore dropped the summary stating it; the rebuild makes it again
        derived.summaries.read(tenant_id=tenant, scope="team", scope_id="core")


def test_a_version_number_a_restore_dropped_is_not_reused(store, derived, world, tmp_path):
    tenant, memory_id = world["tenant"], world["bob_personal"].memory_id
    backups = BackupService(
        store, LocalBackupStorage(tmp_path / "backups"), staging=tmp_path / "staging", job_records=DeletionLedger(store)
    )
    taken = backups.backup(tenant_id=tenant)
    store.write(tenant_id=tenant, user_id="bob", text="Bob keeps a rye starter", memory_id=memory_id)
    derived.sync_all(tenant_id=tenant)  # copies of version 2 exist
    backups.restore(tenant_id=tenant, backup_id=taken["backup_id"])  # version 2 is dropped, its copies stay
    again = store.write(tenant_id=tenant, user_id="bob", text="Bob bakes spelt loaves", memory_id=memory_id)
    assert again.version == 3, "version 2's leftover copies would pass for the new text's"
    counts = derived.sync_all(tenant_id=tenant)
    # The restore dropped version 2's postings itself; its vector is the rebuild's to remove.
    assert counts["keyword_index"]["removed"] == 0 and counts["memory_embeddings"]["removed"] == 1
    hits = derived.recaller.recall(tenant_id=tenant, user_id="bob", query="spelt loaves", mode="keyword")
    assert [(h["memory_id"], h["version"]) for h in hits] == [(memory_id, 3)]


def test_a_forgotten_memory_stays_gone_when_a_backup_holds_versions_it_no_longer_had(store, derived, world, tmp_path):
    tenant, memory_id = world["tenant"], world["bob_personal"].memory_id
    backups = BackupService(
        store, LocalBackupStorage(tmp_path / "backups"), staging=tmp_path / "staging", job_records=DeletionLedger(store)
    )
    older = backups.backup(tenant_id=tenant)
    store.write(tenant_id=tenant, user_id="bob", text="Bob keeps a rye starter", memory_id=memory_id)
    newer = backups.backup(tenant_id=tenant)  # holds versions 1 and 2
    backups.restore(tenant_id=tenant, backup_id=older["backup_id"])  # version 2 is gone again
    forget_now(derived, tenant, memory_id=memory_id)  # tombstones the only version it has now: 1
    report = backups.restore(tenant_id=tenant, backup_id=newer["backup_id"])
    assert report["state"] == "COMPLETE" and report["replayed"]["rows_removed"]["forgotten_memories"] >= 1
    with pytest.raises(NotFoundError):
        store.history(tenant_id=tenant, memory_id=memory_id)


def test_a_restore_drops_snapshots_summaries_caches_and_postings_of_versions_it_drops(store, derived, world, tmp_path):
    from memory_pipelines.lib.agent_runs.runs import AgentRuns

    tenant = world["tenant"]
    backups = BackupService(
        store, LocalBackupStorage(tmp_path / "backups"), staging=tmp_path / "staging", job_records=DeletionLedger(store)
    )
    taken = backups.backup(tenant_id=tenant)
    late = store.write(tenant_id=tenant, user_id="bob", text="Core late decision zebrafish", team_id="core")
    derived.sync_all(tenant_id=tenant)
    runs = AgentRuns(derived)
    lease = runs.open(tenant_id=tenant, subject_id="bob", run_id="run-late")
    assert runs.recall(lease_id=lease, query="zebrafish", team_id="core", mode="keyword")
    snapshot = runs.snapshot_prompt(lease_id=lease, prompt="Answer with: Core late decision zebrafish")
    report = backups.restore(tenant_id=tenant, backup_id=taken["backup_id"])
    removed = report["replayed"]["rows_removed"]
    assert removed["dropped_prompt_snapshots"] == 1 and removed["dropped_team_summaries"] == 1
    with store.transaction() as conn:
        left = conn.execute(
            "SELECT (SELECT count(*) FROM derived.prompt_snapshots WHERE snapshot_id = %s),"
            " (SELECT count(*) FROM derived.keyword_postings WHERE tenant_id = %s AND memory_id = %s),"
            " (SELECT count(*) FROM derived.summaries WHERE tenant_id = %s AND scope = 'team')",
            (snapshot["snapshot_id"], tenant, late.memory_id, tenant),
        ).fetchone()
    assert left == (0, 0, 0)
