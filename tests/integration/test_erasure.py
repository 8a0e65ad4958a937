"""Physical erasure out of the cascade: PENDING after COMPLETE, then a rewrite proven by a byte scan."""

from __future__ import annotations

import os
import sqlite3
import struct
import threading
import time
from datetime import UTC, datetime, timedelta

import numpy as np
import psycopg
import pytest

from memory_pipelines.defs.forget.ops import job_key
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.erasure import ErasureIncomplete, ErasureLedger, ErasureService
from memory_pipelines.lib.forget.ledger import DeletionLedger
from memory_pipelines.lib.stores import bytescan, registry
from memory_pipelines.lib.stores.adapter import REQUIRED, postgres_files
from memory_pipelines.lib.stores.chroma.hnsw_files import unused_capacity_holds_data
from memory_pipelines.lib.stores.chroma.locks import collection_name


def seed(store, derived, tenant):
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="alice")
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="bob")
    written = {
        # Texts unique to the tenant: their vectors then exist nowhere else on the shared Chroma server.
        "alice_personal": store.write(tenant_id=tenant, user_id="alice", text=f"Alice hides licorice in {tenant}"),
        "alice_team": store.write(
            tenant_id=tenant, user_id="alice", text=f"Core freeze of {tenant} starts Friday", team_id="core"
        ),
        "bob_keep": store.write(tenant_id=tenant, user_id="bob", text=f"Bob keeps a sourdough starter in {tenant}"),
    }
    derived.sync_all(tenant_id=tenant)
    return written


def tenant_files(derived, tenant):
    with derived.store.transaction() as conn:
        files = set(postgres_files(conn, tenant))
    return files | set(derived.vectors.files(tenant))


def test_every_registered_store_has_a_complete_adapter():
    for spec in registry.stores():
        adapter = registry.adapter(spec.name)
        assert adapter.name == spec.name
        missing = [m for m in REQUIRED if not callable(getattr(adapter, m, None))]
        assert missing == [], f"{spec.name} adapter lacks {missing}"


def test_a_store_whose_adapter_lacks_a_method_is_caught(monkeypatch):
    class Partial:
        name = "chroma"

        def find(self, conn, ctx):
            return set()

    assert [m for m in REQUIRED if not callable(getattr(Partial(), m, None))] == [
        "delete",
        "count",
        "verify",
        "fingerprints",
        "erase",
    ]


def test_forget_completes_with_erasure_pending_then_the_erasure_run_proves_it(store, derived, tenant):
    written = seed(store, derived, tenant)
    # The Chroma control is taken while the vectors are live: Chroma may purge its log or reuse
    # freed SQLite pages as soon as a delete lands, so after the cascade the dead vector bytes
    # may or may not still be on disk; while live, they are there for certain.
    with store.transaction() as conn:
        base = bytescan.base_from_key(store.keys.control_key(conn))
    vectors = derived.vectors.vectors_of(tenant, sorted(derived.vectors.ids(tenant)))
    live_fps = [bytescan.fingerprint(w, base) for v in vectors.values() for w in bytescan.vector_windows(v)]
    # Scanned again when a first scan finds nothing: Chroma's SQLite may checkpoint its WAL into the
    # main file between the scan reading one and the other (CI on 020b74b read neither with the bytes).
    for _ in range(30):  # up to 15 s: a loaded machine's Chroma server writes its log late (CI on 38aae25)
        live_scan = bytescan.scan(derived.vectors.files(tenant), live_fps, base)
        if live_scan.hits:
            break
        time.sleep(0.5)
    assert any("/chroma/" in path for path in live_scan.hits), live_scan.hits
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    done = service.status(job_id=job["job_id"])
    assert done["state"] == "COMPLETE"
    physical = done["targets"]["physical"]
    assert physical.startswith("PENDING:")
    deadline = datetime.fromisoformat(physical.partition(":")[2])
    assert timedelta(hours=23, minutes=59) < deadline - datetime.now(UTC) <= timedelta(hours=24)
    assert service.proof(job_id=job["job_id"])["targets"]["physical"] == physical
    ledger = ErasureLedger(store)
    assert [j["job_id"] for j in ledger.pending(tenant_id=tenant)] == [job["job_id"]]

    erasure = ErasureService(derived)
    # The control: before the rewrite, the dead bytes of what was deleted are still in the files,
    # and the scan finds them (so a clean scan afterwards means something).
    fingerprints, before = erasure.scan(job_ids=[job["job_id"]], files=tenant_files(derived, tenant))
    assert len(fingerprints) >= 4  # two ciphertexts, their vectors, the wrapped key: two windows each
    # The control: the deleted records' bytes are still in the files (PostgreSQL's dead tuples, unless
    # autovacuum pruned their pages first, which a parallel suite's timing allows; Chroma's).
    assert before.hits, before.hits

    report = erasure.erase_tenant(tenant_id=tenant)
    assert report["erased"] == 1 and report["byteScan"]["hits"] == 0
    assert report["byteScan"]["files"] > 0 and report["byteScan"]["fingerprints"] == len(fingerprints)
    assert sum(report["bytesRewritten"].values()) > 0
    erased = service.status(job_id=job["job_id"])
    assert erased["targets"]["physical"].startswith("ERASED:")
    assert service.proof(job_id=job["job_id"])["erasure"]["byteScan"]["hits"] == 0
    assert ledger.pending(tenant_id=tenant) == []
    with store.transaction() as conn:
        left = conn.execute(
            "SELECT count(*) FROM control.erasure_fingerprints WHERE job_id = %s", (job["job_id"],)
        ).fetchone()[0]
    assert left == 0  # the fingerprints go once proven
    # Bob's memories were rewritten along, not lost.
    hits = derived.recaller.recall(tenant_id=tenant, user_id="bob", query="sourdough starter", k=3)
    assert [h["memory_id"] for h in hits][:1] == [written["bob_keep"].memory_id]
    # A second run has nothing to do.
    assert erasure.erase_tenant(tenant_id=tenant)["erased"] == 0


def _logged_and_returned(derived, tenant):
    """Each of the tenant's vectors as Chroma's log holds it (the bytes it was sent) and as it returns it."""
    returned = derived.vectors.vectors_of(tenant, sorted(derived.vectors.ids(tenant)))
    database = next(f for f in derived.vectors.files(tenant) if f.name == "chroma.sqlite3")
    with sqlite3.connect(database) as db:
        logged = {
            record: bytes(blob)
            for record, blob in db.execute("SELECT id, vector FROM embeddings_queue WHERE vector IS NOT NULL")
            if record in returned
        }
    return logged, {record: np.asarray(v, dtype="<f4").tobytes() for record, v in returned.items()}


def test_chroma_keeps_the_bytes_it_was_sent_so_fingerprints_of_a_returned_vector_find_its_log_copy(
    store, derived, tenant
):
    """Under "cosine" about one vector in four was re-normalised into other bytes, so the log's copy
    and the one a forget fingerprints differed in both windows (and this erasure test's control,
    which finds the live vectors in the files from those fingerprints, failed now and then)."""
    for n in range(16):
        store.write(tenant_id=tenant, user_id="alice", text=f"note {n} of {tenant}: the hives face south {n * 7}")
    derived.sync_all(tenant_id=tenant)
    logged, returned = _logged_and_returned(derived, tenant)
    assert len(returned) == 16 and logged.keys() == returned.keys()
    assert [r for r in returned if logged[r] != returned[r]] == []


def test_a_cosine_collection_is_rebuilt_as_one_that_keeps_the_bytes_it_was_sent(store, derived, tenant):
    client = derived.vectors.collections.client()
    made = client.create_collection(
        name=collection_name(tenant),
        metadata={"tenant_id": tenant, "hnsw:space": "cosine", "embedding_model": derived.vectors.embedder.name},
        embedding_function=None,
    )
    assert made.configuration_json["hnsw"]["space"] == "cosine"  # the control: as before this version
    for n in range(8):
        store.write(tenant_id=tenant, user_id="alice", text=f"note {n} of {tenant}: the hives face south {n * 7}")
    derived.sync_all(tenant_id=tenant)
    before = derived.vectors.vectors_of(tenant, sorted(derived.vectors.ids(tenant)))
    derived.vectors.erase_physically(tenant)
    rebuilt = client.get_collection(collection_name(tenant))
    assert rebuilt.configuration_json["hnsw"]["space"] == "ip"
    logged, returned = _logged_and_returned(derived, tenant)
    assert returned.keys() == before.keys() and len(returned) == 8
    assert [r for r in returned if logged.get(r) != returned[r]] == []
    assert all(np.array_equal(np.asarray(before[r], dtype="<f4"), np.frombuffer(returned[r], "<f4")) for r in returned)


def test_a_file_still_holding_forgotten_bytes_fails_the_erasure_and_marks_nothing(
    store, derived, tenant, session_settings
):
    seed(store, derived, tenant)
    with store.transaction() as conn:
        [blob] = conn.execute(
            "SELECT v.text_ct FROM memory.memory_versions v JOIN memory.memories m USING (tenant_id, memory_id)"
            " WHERE v.tenant_id = %s AND m.user_id = 'alice' AND m.team_id IS NULL",
            (tenant,),
        ).fetchone()
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    # A stray copy in a file the erasure scans (anywhere under HOME), as a store that forgot a copy
    # would leave it. HOME is the one the stores were opened on, not the environment's (this worker
    # names none, so that would be ./.memory_pipelines).
    assert ErasureService(derived).settings.home == session_settings.home
    stray = session_settings.home / "stray" / tenant / "stray.bin"
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"header" + bytes(blob) + b"trailer")
    try:
        with pytest.raises(ErasureIncomplete) as err:
            ErasureService(derived).erase_tenant(tenant_id=tenant)
        assert any("stray.bin" in path for path in err.value.hits)
        assert service.status(job_id=job["job_id"])["targets"]["physical"].startswith("PENDING:")
    finally:
        stray.unlink()
    assert ErasureService(derived).erase_tenant(tenant_id=tenant)["erased"] == 1


def _forget_alice_under_an_older_snapshot(store, derived, tenant, reader):
    """Alice forgotten (COMPLETE) while `reader` holds a snapshot taken before: it still sees her rows."""
    seed(store, derived, tenant)
    reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    assert reader.execute("SELECT count(*) FROM memory.memories WHERE tenant_id = %s", (tenant,)).fetchone()[0] == 3
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
    return service, job


def test_the_erasure_waits_for_a_snapshot_older_than_the_deletion_then_erases_everything(store, derived, tenant):
    """VACUUM FULL keeps every deleted row an open snapshot may still see, in the new file and its WAL:
    rewritten under such a snapshot, the scan finds them. The erasure waits for it to end first."""
    with psycopg.connect(store.conninfo) as reader:
        service, job = _forget_alice_under_an_older_snapshot(store, derived, tenant, reader)
        ended = threading.Timer(1.5, reader.rollback)
        ended.start()
        try:
            report = ErasureService(derived).erase_tenant(tenant_id=tenant)
        finally:
            ended.join()
    assert report["horizon"]["olderSnapshots"] == 1 and report["horizon"]["waitedSeconds"] >= 1.0
    assert report["erased"] == 1 and report["byteScan"]["hits"] == 0, report["byteScan"]
    assert service.status(job_id=job["job_id"])["targets"]["physical"].startswith("ERASED:")


def test_a_snapshot_outliving_the_wait_refuses_the_erasure_before_any_rewrite(store, derived, tenant):
    with psycopg.connect(store.conninfo) as reader:
        service, job = _forget_alice_under_an_older_snapshot(store, derived, tenant, reader)
        pid = reader.info.backend_pid
        files = tenant_files(derived, tenant)
        started = time.monotonic()
        with pytest.raises(ErasureIncomplete) as err:
            ErasureService(derived, horizon_seconds=0.5).erase_tenant(tenant_id=tenant)
        assert 0.5 <= time.monotonic() - started < 10
        [label] = err.value.hits
        assert label.startswith(f"session {pid} (") and "older snapshot" in str(err.value), label
        assert service.status(job_id=job["job_id"])["targets"]["physical"].startswith("PENDING:")
        assert tenant_files(derived, tenant) == files  # nothing rewritten: a rewrite gives new file names
        with store.transaction() as conn:
            [detail] = conn.execute(
                "SELECT detail FROM control.audit WHERE job_id = %s AND event = 'erasure_failed'", (job["job_id"],)
            ).fetchone()
        assert detail["horizon"]["olderSnapshots"] == 1 and "byteScan" not in detail
        reader.rollback()
    assert ErasureService(derived).erase_tenant(tenant_id=tenant)["erased"] == 1


def test_an_overdue_erasure_fails_the_check_until_it_runs(store, derived, tenant):
    from memory_pipelines.defs.erasure.checks import erasure_evaluation

    seed(store, derived, tenant)
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="bob")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    ledger = ErasureLedger(store)
    assert erasure_evaluation(ledger, tenant).passed
    later = datetime.now(UTC) + timedelta(hours=25)
    evaluation = erasure_evaluation(ledger, tenant, now=later)
    assert not evaluation.passed
    assert evaluation.metadata["overdue_erasures"].value == 1
    assert evaluation.metadata["overdue_job_ids"].value == [job["job_id"]]
    assert [j["job_id"] for j in ledger.overdue(now=later) if j["tenant_id"] == tenant] == [job["job_id"]]
    ErasureService(derived).erase_tenant(tenant_id=tenant)
    assert erasure_evaluation(ledger, tenant, now=later).passed


def test_the_sensor_batches_a_tenants_deletions_until_the_window_or_the_deadline(store, derived, tenant):
    seed(store, derived, tenant)
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    ledger = ErasureLedger(store)
    now = datetime.now(UTC)
    assert tenant not in ledger.due_tenants(now=now)
    assert tenant in ledger.due_tenants(now=now + timedelta(minutes=61))
    ErasureService(derived).erase_tenant(tenant_id=tenant)
    assert tenant not in ledger.due_tenants(now=now + timedelta(hours=30))


def test_shredded_backups_are_claimed_only_after_the_erasure(store, derived, tenant, tmp_path):
    from memory_pipelines.lib.backups.service import BackupService
    from memory_pipelines.lib.backups.storage import LocalBackupStorage

    seed(store, derived, tenant)
    BackupService(
        store, LocalBackupStorage(tmp_path / "b"), staging=tmp_path / "s", days=35, job_records=DeletionLedger(store)
    ).backup(tenant_id=tenant)
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["targets"]["backups"] == "PENDING_SHRED:1"
    ErasureService(derived).erase_tenant(tenant_id=tenant)
    status = service.status(job_id=job["job_id"])
    assert status["targets"]["backups"] == "SHREDDED:1"
    assert service.proof(job_id=job["job_id"])["targets"]["backups"] == "SHREDDED:1"


def test_the_physical_erasure_asset_materializes_the_proof_and_its_check_passes(
    store, derived, tenant, session_settings, monkeypatch
):
    import dagster as dg

    from memory_pipelines.definitions import defs

    monkeypatch.setenv("MEMORY_PIPELINES_HOME", str(session_settings.home))
    seed(store, derived, tenant)
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [tenant])
        result = defs().resolve_job_def("erase").execute_in_process(instance=instance, partition_key=tenant)
        assert result.success
        [materialization] = result.asset_materializations_for_node("physical_erasure")
        metadata = {k: v.value for k, v in materialization.metadata.items()}
        assert metadata["erased_jobs"] == 1 and metadata["job_ids"] == [job["job_id"]]
        assert metadata["scan_hits"] == 0 and metadata["scanned_files"] > 0 and metadata["fingerprints"] > 0
        assert metadata["bytes_rewritten"] > 0
        [check] = result.get_asset_check_evaluations()
        assert check.check_name == "erasures_on_time" and check.passed
        # memory_deletions shows the certificate as it stands now, not the one rendered at COMPLETE.
        [observed] = [e.asset_observation_data.asset_observation for e in result.all_events if e.is_asset_observation]
        assert observed.asset_key == dg.AssetKey("memory_deletions") and observed.partition == tenant
        md = observed.metadata[job_key("certificate", job["job_id"])].value
        assert "- **Physically erased:** `" in md and "PENDING: to be erased by" not in md
        assert "What this deployment proves" in md and "alice" not in md
    assert service.status(job_id=job["job_id"])["targets"]["physical"].startswith("ERASED:")


def test_an_offboarded_tenants_erasure_drops_its_partitions(store, derived, tenant):
    from memory_pipelines.lib.memories import table_partitions

    seed(store, derived, tenant)
    with store.transaction() as conn:
        assert len(table_partitions.tenant_partitions(conn, tenant)) == len(table_partitions.PARTITIONED_TABLES)
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, all_tenant=True, confirm=tenant, basis="offboarding")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["targets"]["backups"] == "PENDING_SHRED:0"
    report = ErasureService(derived).erase_tenant(tenant_id=tenant)
    assert report["erased"] == 1 and report["byteScan"]["hits"] == 0
    with store.transaction() as conn:
        assert table_partitions.tenant_partitions(conn, tenant) == {}  # its files are unlinked, not rewritten
    status = service.status(job_id=job["job_id"])
    assert status["targets"]["physical"].startswith("ERASED:") and status["targets"]["backups"] == "SHREDDED:0"
    assert [f.name for f in derived.vectors.files(tenant)] == ["chroma.sqlite3"]  # no segment of its own left


def test_deletes_larger_than_one_request_remove_every_id_and_only_those(tmp_path):
    """A forget run's deletes go in requests of _DELETE_REQUEST ids (one big request held other
    tenants' queries for seconds): every id of every request goes, the others stay, and absent
    ids are no error."""
    import numpy as np

    from memory_pipelines.lib.stores.chroma import erasure
    from memory_pipelines.lib.stores.chroma.index import VectorStore
    from memory_pipelines.lib.stores.embedding import HashingEmbedder

    vectors = VectorStore(embedder=HashingEmbedder(dimension=8), path=tmp_path / "chroma")
    col = vectors.collection("t-del")
    total = 3 * erasure._DELETE_REQUEST + 300
    ids = [f"m_{i:05d}:1" for i in range(total)]
    col.add(
        ids=ids,
        embeddings=np.random.default_rng(3).random((total, 8), dtype=np.float32),
        metadatas=[{"n": 1}] * total,
    )
    first = ids[: erasure._DELETE_REQUEST + 1]  # one id past a request
    assert vectors.delete("t-del", [*first, "absent:1"]) == len(first)
    second = ids[len(first) : len(first) + 2 * erasure._DELETE_REQUEST + 7]
    vectors.discard("t-del", [*second, "absent:2"])
    assert vectors.ids("t-del") == set(ids[len(first) + len(second) :])
    assert vectors.vectors_of("t-del", [*first, *second]) == {}


def test_probes_find_every_target_left_whether_asked_at_once_or_paced(derived):
    """One subject's probes go in two requests at once, a batch's one paced request after another
    (two at once held the server's cores from other tenants): either way every probe is asked and
    each hit on a target counts, as one query of all of them would count it."""
    from memory_pipelines.lib.stores.adapter import Context
    from memory_pipelines.lib.stores.chroma import adapter

    vectors = derived.vectors
    tenant = "t-probes-" + os.urandom(4).hex()
    rng = np.random.default_rng(11)
    stored = rng.random((1_000, vectors.embedder.dimension), dtype=np.float32)
    ids = [f"m_{i:04d}:1" for i in range(len(stored))]
    col = vectors.collection(tenant)
    col.add(ids=ids, embeddings=stored, metadatas=[{"n": 1}] * len(ids))
    targets = {(f"m_{i:04d}", 1) for i in range(0, 1_000, 7)}
    try:
        for n in (100, adapter._PARALLEL_UP_TO + 45):
            probes = list(stored[:n] + rng.normal(0, 0.01, (n, stored.shape[1])).astype(np.float32))
            requests = adapter._probe_requests(probes)
            assert sum(len(r) for r in requests) == n
            assert len(requests) == (2 if n <= adapter._PARALLEL_UP_TO else -(-n // adapter._PACED_REQUEST))
            whole = col.query(query_embeddings=probes, n_results=10, include=[])["ids"]
            expected = sum(1 for hits in whole for rid in hits if (rid.rsplit(":", 1)[0], 1) in targets)
            assert expected >= len([i for i in range(n) if i % 7 == 0])  # each target's own probe at least
            ctx = Context(derived=derived, tenant_id=tenant, jobs=[], everything=set(targets))
            assert adapter._probe(vectors, ctx, probes) == expected
    finally:
        vectors.drop(tenant)


@pytest.mark.slow
def test_a_rebuild_pages_through_a_collection_larger_than_one_get_can_read(tmp_path):
    """One get() of a tenant past ~32,000 vectors fails in Chroma ("too many SQL variables");
    the erasure's rebuild pages, so a large tenant can still be erased."""
    import numpy as np

    from memory_pipelines.lib.stores.chroma.index import VectorStore
    from memory_pipelines.lib.stores.embedding import HashingEmbedder

    vectors = VectorStore(embedder=HashingEmbedder(dimension=8), path=tmp_path / "chroma")
    col = vectors.collection("t-big")
    total = 33_000
    rng = np.random.default_rng(7)
    ids = [f"m_{i:06d}:1" for i in range(total)]
    step = int(vectors.client().get_max_batch_size())
    for start in range(0, total, step):
        part = ids[start : start + step]
        col.add(ids=part, embeddings=rng.random((len(part), 8), dtype=np.float32), metadatas=[{"n": 1}] * len(part))
    assert vectors.delete("t-big", ids[:10]) == 10
    assert vectors.rebuild("t-big") == total - 10
    assert vectors.ids("t-big") == set(ids[10:])
    # Every whole-collection read pages too: the erasure's live windows, a lookup by all the ids.
    assert len(vectors.vectors_of("t-big", ids)) == total - 10
    live, orphans = vectors.live_windows("t-big")
    assert orphans == 0 and len(live) > total
    assert vectors.existing("t-big").metadata["erasures"] == 1
    # The staging collection took the tenant's name: no other collection is left behind.
    assert [c.name for c in vectors.client().list_collections()] == [col.name]


def _hnsw_header(segment):
    """(element count persisted, bytes per element, offset of the vector in an element) of an index."""
    _, _, _, count, element, _, data_offset = struct.unpack_from("<i6Q", (segment / "header.bin").read_bytes())
    return count, element, data_offset


def _all_windows(stored):
    """Every 16-byte window, at every offset, of each vector's raw float32 bytes."""
    windows = []
    for vector in stored:
        data = np.asarray(vector, dtype="<f4").tobytes()
        windows += [data[i : i + bytescan.WINDOW] for i in range(len(data) - bytescan.WINDOW + 1)]
    return windows


def _raw_hits(files, stored):
    base = int.from_bytes(os.urandom(8), "little") | 1
    return bytescan.scan(files, bytescan.fingerprints(_all_windows(stored), base), base).hits


def test_bytes_left_in_a_rebuilt_indexs_unused_capacity_are_cleared_before_the_scan(
    store, derived, tenant, monkeypatch
):
    """The rebuilt collection's files are written by the server from malloc'd memory: their unused
    capacity held whatever that memory last held, now and then the forgotten vectors themselves
    (a spurious hit that failed erasures by chance). Here the forgotten vectors' raw float32 bytes
    are planted in that capacity as the server's memory would leave them: the erasure must clear
    them (and pass), and no window of them may be left in any of the tenant's Chroma files."""
    written = seed(store, derived, tenant)
    alice = [cv.record_id for cv in store.current_versions(tenant_id=tenant, user_ids=["alice"])]
    forgotten = derived.vectors.vectors_of(tenant, alice)
    assert len(forgotten) == 2
    blobs = [np.asarray(v, dtype="<f4").tobytes() for v in forgotten.values()]
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])

    vectors = derived.vectors
    rebuild = vectors.erasure.rebuild_under_lock
    planted = []

    def rebuild_then_plant(tenant_id):
        copied = rebuild(tenant_id)
        for segment in vectors.segments(tenant_id):
            if not (segment / "header.bin").exists():
                continue
            count, element, data_offset = _hnsw_header(segment)
            data = segment / "data_level0.bin"
            # Unused capacity is there: the one vector left sits in an index sized for 100.
            assert data.stat().st_size >= (count + 1 + len(blobs)) * element
            with data.open("r+b") as fh:
                for n, blob in enumerate(blobs):
                    fh.seek((count + 1 + n) * element + data_offset)  # where a vector sits in a slot
                    fh.write(blob)
            with (segment / "length.bin").open("r+b") as fh:
                fh.seek(count * 4 + 16)
                fh.write(blobs[0][:32])
            planted.append(segment)
        # The control: the planted bytes are in the files the erasure is about to scan.
        assert _raw_hits(vectors.files(tenant_id), forgotten.values())
        return copied

    monkeypatch.setattr(vectors.erasure, "rebuild_under_lock", rebuild_then_plant)
    report = ErasureService(derived).erase_tenant(tenant_id=tenant)
    assert report["erased"] == 1 and report["byteScan"]["hits"] == 0
    assert planted
    assert _raw_hits(vectors.files(tenant), forgotten.values()) == {}
    for segment in planted:
        count, element, _ = _hnsw_header(segment)
        data = (segment / "data_level0.bin").read_bytes()
        assert len(data) > count * element and data[count * element :].count(0) == len(data) - count * element
        assert not unused_capacity_holds_data(segment)
    # Bob's vector is intact and still found.
    hits = derived.recaller.recall(tenant_id=tenant, user_id="bob", query="sourdough starter", k=3)
    assert [h["memory_id"] for h in hits][:1] == [written["bob_keep"].memory_id]


@pytest.mark.slow
def test_clearing_unused_capacity_keeps_the_index_whole_across_server_restarts(tmp_path):
    """Zeroing what no element owns, with the server running, never loses a vector: every vector
    kept is its own nearest neighbour and reads back exactly, before and after restarts, in a
    rebuilt index never persisted (all its capacity unused), in one persisted with slots to spare,
    and after either grows past the capacity it was created with."""
    from memory_pipelines.lib.infra.services import ensure_chroma, stop_chroma
    from memory_pipelines.lib.stores.chroma.client import SPACE
    from memory_pipelines.lib.stores.chroma.hnsw_files import clear_unused_capacity
    from memory_pipelines.lib.stores.chroma.index import VectorStore
    from memory_pipelines.lib.stores.embedding import HashingEmbedder
    from tests.conftest import settings_for

    settings = settings_for(tmp_path / "home")
    rng = np.random.default_rng(11)
    kept: dict[str, dict[str, np.ndarray]] = {"t-small": {}, "t-slots": {}}
    made = [0]

    def open_vectors():
        url = ensure_chroma(settings)
        return VectorStore(embedder=HashingEmbedder(dimension=16), url=url, path=settings.chroma_path)

    def add(vectors, tenant_id, n):
        col = vectors.collection(tenant_id)
        new = rng.standard_normal((n, 16))
        # Unit rows, as every Embedder gives: collections rank by inner product (chroma/client.py SPACE).
        new = (new / np.linalg.norm(new, axis=1, keepdims=True)).astype(np.float32)
        ids = [f"m{made[0] + i}:1" for i in range(n)]
        made[0] += n
        for start in range(0, n, 50):
            col.add(ids=ids[start : start + 50], embeddings=new[start : start + 50])
        kept[tenant_id].update(zip(ids, new, strict=True))

    def assert_whole(vectors, *, clean=True):
        for tenant_id, vectors_kept in kept.items():
            ids = sorted(vectors_kept)
            assert vectors.ids(tenant_id) == set(ids)
            found = vectors.query_vectors(tenant_id=tenant_id, vectors=[vectors_kept[i] for i in ids], limit=1)
            assert [f"{hit[0][0]}:{hit[0][1]}" for hit in found] == ids
            stored = vectors.vectors_of(tenant_id, ids)
            assert all(np.allclose(np.asarray(stored[i], dtype=np.float32), vectors_kept[i], atol=1e-6) for i in ids)
            if clean:
                assert not any(unused_capacity_holds_data(segment) for segment in vectors.segments(tenant_id))

    def restart():
        assert stop_chroma(settings)["stopped"]
        vectors = open_vectors()
        # A restarted server re-creates the files of an index it never persisted at its first
        # read, from its own memory again: the next scrub (after a write, or an erasure's sweep)
        # clears them, and clearing them breaks nothing either.
        assert_whole(vectors, clean=False)
        for tenant_id in kept:
            vectors.scrub(tenant_id)
        return vectors

    try:
        vectors = open_vectors()
        add(vectors, "t-small", 300)
        gone = sorted(kept["t-small"])[:100]
        vectors.delete("t-small", gone)
        for record in gone:
            del kept["t-small"][record]
        vectors.erase_physically("t-small")
        [small] = vectors.segments("t-small")
        assert _hnsw_header(small)[0] == 0  # 200 vectors, under the server's sync threshold: never persisted

        # Persisted with slots to spare: 60 vectors, then metadata updates until the server persists.
        add(vectors, "t-slots", 60)
        col = vectors.collection("t-slots")
        ids = sorted(kept["t-slots"])
        for n in range(17):
            col.update(ids=ids, metadatas=[{"n": n}] * len(ids))
        [slots] = vectors.segments("t-slots")
        count, element, _ = _hnsw_header(slots)
        assert count == 60 and (slots / "data_level0.bin").stat().st_size == 100 * element
        # length.bin keeps no lengths in our space (a float per element only for "cosine"): the 60
        # floats persisted are the server's memory too, where a forgotten vector may sit.
        assert SPACE == "ip"
        with (slots / "length.bin").open("r+b") as fh:
            fh.write(next(iter(kept["t-small"].values())).astype("<f4").tobytes())
        clear_unused_capacity(slots)  # 40 slots the server wrote from its memory, and length.bin whole
        assert (slots / "length.bin").read_bytes() == bytes(100 * 4)
        assert_whole(vectors)
        vectors = restart()
        assert_whole(vectors)

        add(vectors, "t-slots", 1000)  # persisted again, the capacity grown
        add(vectors, "t-small", 900)
        for segment in (slots, small):
            count, element, _ = _hnsw_header(segment)
            assert count >= 1000
            data = (segment / "data_level0.bin").read_bytes()  # a persist writes whole, zeroed slots there
            assert data[count * element :].count(0) == len(data) - count * element
        for tenant_id in kept:  # its added lengths come from memory: the scrub after every write of ours clears them
            vectors.scrub(tenant_id)
        assert_whole(vectors)
        vectors = restart()
        assert_whole(vectors)
    finally:
        stop_chroma(settings)
