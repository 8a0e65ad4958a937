"""Backups and restores on real engines: the restore drill, crypto-shredding, tampering, S3 via moto."""

from __future__ import annotations

import os

import pytest

from memory_pipelines.lib.backups.service import BackupService
from memory_pipelines.lib.backups.storage import LocalBackupStorage, S3BackupStorage
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.ledger import DeletionLedger
from memory_pipelines.lib.infra.errors import ConflictError, NotFoundError, ValidationError
from tests.conftest import row_counts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3_server():
    from moto.server import ThreadedMotoServer

    from tests.support.servers import free_port

    port = free_port()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


def s3_storage(url: str, bucket: str) -> S3BackupStorage:
    import boto3

    client = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    return S3BackupStorage(bucket=bucket, prefix="backups/", endpoint_url=url, client=client)


@pytest.fixture(params=["local", "s3"])
def backups(request, store, tmp_path, s3_server):
    if request.param == "local":
        storage = LocalBackupStorage(tmp_path / "backups")
    else:
        storage = s3_storage(s3_server, "mp-" + tmp_path.name.lower().replace("_", "-")[:40])
    return BackupService(store, storage, staging=tmp_path / "staging", job_records=DeletionLedger(store))


def seed(store, derived, tenant):
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="alice")
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="bob")
    written = {
        "alice_personal": store.write(tenant_id=tenant, user_id="alice", text="Alice hides licorice in the desk"),
        "alice_team": store.write(tenant_id=tenant, user_id="alice", text="Core freeze starts Friday", team_id="core"),
        "bob_keep": store.write(tenant_id=tenant, user_id="bob", text="Bob keeps a sourdough starter"),
        "bob_gone": store.write(tenant_id=tenant, user_id="bob", text="Bob's locker code is 4417"),
        "carol": store.write(tenant_id=tenant, user_id="carol", text="Carol runs marathons in April"),
    }
    derived.sync_all(tenant_id=tenant)
    return written


def visible_ids(store, tenant, user, team=None):
    return {m["memory_id"] for m in store.list_visible(tenant_id=tenant, user_id=user, team_id=team)}


def test_restore_drill_forgotten_data_stays_forgotten(store, derived, tenant, backups):
    w = seed(store, derived, tenant)
    manifest = backups.backup(tenant_id=tenant)
    assert manifest["rows"]["memories"] == 5 and manifest["rows"]["memory_versions"] == 5
    assert "wrapped_object_key" not in manifest and backups.storage.exists(manifest["object"])
    service = DeletionService(derived)
    for job in (
        service.request(tenant_id=tenant, subject="alice"),
        service.request(tenant_id=tenant, memory_id=w["bob_gone"].memory_id),
    ):
        service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    after_forget = {u: visible_ids(store, tenant, u) for u in ("alice", "bob", "carol")}

    report = backups.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    assert report["state"] == "COMPLETE"
    assert report["loaded"]["memory_versions"] == 5
    removed = report["replayed"]["rows_removed"]
    # alice's two versions go by her epoch (and by her destroyed key); bob's one version by its tombstone.
    assert removed["subject_epochs"] == 2 and removed["tombstones"] == 1
    assert report["verification"] == {
        "subject_epochs": 0,
        "tombstones": 0,
        "forgotten_memories": 0,
        "destroyed_keys": 0,
    }
    assert {u: visible_ids(store, tenant, u) for u in ("alice", "bob", "carol")} == after_forget
    assert visible_ids(store, tenant, "bob") == {w["bob_keep"].memory_id}
    assert visible_ids(store, tenant, "bob", "core") == set()
    assert [m["memory_id"] for m in store.iter_export(tenant_id=tenant, subject="alice")] == []
    with pytest.raises(NotFoundError):
        store.history(tenant_id=tenant, memory_id=w["bob_gone"].memory_id)
    assert store.history(tenant_id=tenant, memory_id=w["carol"].memory_id)[0]["version"] == 1

    # The backfill: every derived store rebuilt from the restored primary holds nothing forgotten.
    derived.sync_all(tenant_id=tenant)
    gone = {w["alice_personal"].memory_id, w["alice_team"].memory_id, w["bob_gone"].memory_id}
    kept = {w["bob_keep"].memory_id, w["carol"].memory_id}
    assert {r.split(":")[0] for r in derived.vectors.ids(tenant)} == kept
    table = derived.analytics.read_partition(tenant)
    assert set(table["memory_id"].to_pylist()) == kept
    for memory_id in gone:
        with pytest.raises(NotFoundError):
            derived.lineage_of_memory(tenant_id=tenant, memory_id=memory_id)
    with store.transaction() as conn:
        edges = conn.execute(
            "SELECT count(*) FROM derived.lineage WHERE tenant_id = %s AND source_memory_id = ANY(%s)",
            (tenant, sorted(gone)),
        ).fetchone()[0]
    assert edges == 0
    assert derived.lineage_of_memory(tenant_id=tenant, memory_id=w["carol"].memory_id)
    hits = derived.recaller.recall(tenant_id=tenant, user_id="bob", query="locker code")
    assert w["bob_gone"].memory_id not in {h["memory_id"] for h in hits}


def test_subject_shredding_leaves_others_restorable(store, derived, tenant, backups):
    w = seed(store, derived, tenant)
    manifest = backups.backup(tenant_id=tenant)
    with store.transaction() as conn:
        store.keys.destroy_subject_key(conn, tenant, "carol")
    report = backups.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    assert report["state"] == "COMPLETE"
    assert report["replayed"]["rows_removed"]["destroyed_keys"] == 1
    assert visible_ids(store, tenant, "carol") == set()
    assert visible_ids(store, tenant, "alice") == {w["alice_personal"].memory_id}
    assert store.open_texts(tenant_id=tenant, sources=[(w["bob_keep"].memory_id, 1)]) == {
        (w["bob_keep"].memory_id, 1): "Bob keeps a sourdough starter"
    }


def test_tenant_shredding_makes_every_backup_unreadable(store, derived, tenant, backups):
    seed(store, derived, tenant)
    manifest = backups.backup(tenant_id=tenant)
    with store.transaction() as conn:
        store.keys.destroy_tenant_keys(conn, tenant)
    before = row_counts(store.conninfo)
    with pytest.raises(NotFoundError, match="crypto-shredded"):
        backups.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    assert row_counts(store.conninfo) == before


def test_tampered_or_truncated_backup_loads_nothing(store, derived, tenant, backups, tmp_path):
    w = seed(store, derived, tenant)
    manifest = backups.backup(tenant_id=tenant)
    store.write(tenant_id=tenant, user_id="bob", text="written after the backup")
    original = tmp_path / "original.bin"
    backups.storage.get_file(manifest["object"], original)
    data = original.read_bytes()
    before = row_counts(store.conninfo)
    for damaged in (data[: len(data) // 2], data[:100] + bytes([data[100] ^ 1]) + data[101:]):
        broken = tmp_path / "broken.bin"
        broken.write_bytes(damaged)
        backups.storage.put_file(manifest["object"], broken)
        with pytest.raises(ValidationError, match="failed authentication"):
            backups.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
        assert row_counts(store.conninfo) == before
        assert w["carol"].memory_id in visible_ids(store, tenant, "carol")  # reads stay open


def test_bad_backup_ids(store, derived, tenant, backups):
    seed(store, derived, tenant)
    manifest = backups.backup(tenant_id=tenant)
    with pytest.raises(NotFoundError, match="no backup"):
        backups.restore(tenant_id=tenant, backup_id="b_19990101T000000_deadbeef")
    with pytest.raises(ValidationError, match="malformed"):
        backups.restore(tenant_id=tenant, backup_id="../../etc/passwd")
    other = "t-other-" + tenant[2:]
    store.write(tenant_id=other, user_id="zed", text="another tenant")
    with pytest.raises(ValidationError, match="another tenant"):
        backups.restore(tenant_id=other, backup_id=manifest["backup_id"])


def test_restore_waits_for_a_running_forget_and_closes_reads_while_loading(store, derived, tenant, tmp_path):
    import psycopg

    w = seed(store, derived, tenant)
    seen: list[str] = []

    def during_load(step: str) -> None:
        with pytest.raises(ConflictError, match="being restored"):
            store.list_visible(tenant_id=tenant, user_id="bob")
        seen.append(step)

    service = BackupService(
        store,
        LocalBackupStorage(tmp_path / "b"),
        staging=tmp_path / "s",
        hooks={"loaded": during_load},
        job_records=DeletionLedger(store),
    )
    manifest = service.backup(tenant_id=tenant)
    # A forget run holds the tenant's lock: the restore refuses after its wait instead of interleaving.
    holder = psycopg.connect(store.conninfo, autocommit=True)
    holder.execute("SELECT pg_advisory_lock(hashtextextended(%s, 2))", (f"forget\x1f{tenant}",))
    with pytest.raises(ConflictError, match="forget run"):
        service.restore(tenant_id=tenant, backup_id=manifest["backup_id"], lock_timeout=0.5)
    holder.close()
    report = service.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    assert seen == ["loaded"] and report["state"] == "COMPLETE"
    assert w["carol"].memory_id in visible_ids(store, tenant, "carol")


def test_s3_backups_get_a_lifecycle_rule_and_list(store, derived, tenant, s3_server, tmp_path):
    storage = s3_storage(s3_server, "mp-lifecycle")
    service = BackupService(store, storage, staging=tmp_path / "staging", days=35, job_records=DeletionLedger(store))
    seed(store, derived, tenant)
    first = service.backup(tenant_id=tenant)
    assert storage.lifecycle_days() == 35
    listed = service.list_backups(tenant_id=tenant)
    assert [b["backup_id"] for b in listed] == [first["backup_id"]]
    assert listed[0]["location"].startswith("s3://mp-lifecycle/backups/")


def test_keys_shred_compacts_the_key_store_and_requests_the_forget(store, derived, tenant, session_settings):
    import psycopg

    from memory_pipelines.lib.forget.canary import files_containing

    seed(store, derived, tenant)
    with store.transaction() as conn:
        wrapped = bytes(
            conn.execute(
                "SELECT wrapped FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = 'carol'", (tenant,)
            ).fetchone()[0]
        )
    heap = session_settings.pgdata / "base"

    def checkpoint() -> None:
        with psycopg.connect(store.conninfo, autocommit=True) as conn:
            conn.execute("CHECKPOINT")

    checkpoint()
    assert files_containing(heap, [wrapped])[wrapped], "the control: the wrapped key is in the heap files"
    service = DeletionService(derived)
    result = service.shred_keys(tenant_id=tenant, subject="carol")
    assert len(result["destroyed_keys"]) == 1 and result["forget_job"]["state"] == "REQUESTED"
    checkpoint()
    assert files_containing(heap, [wrapped])[wrapped] == []
    with store.transaction() as conn:
        kinds = [
            r[0]
            for r in conn.execute(
                "SELECT kind FROM control.journal WHERE job_id = %s ORDER BY seq", (result["forget_job"]["job_id"],)
            )
        ]
    assert kinds == ["SUBJECT_EPOCH", "KEY_DESTROYED"]
    assert visible_ids(store, tenant, "carol") == set()  # hidden at once
    service.run_batch(tenant_id=tenant, job_ids=[result["forget_job"]["job_id"]])
    assert service.status(job_id=result["forget_job"]["job_id"])["state"] == "COMPLETE"


def test_restore_failing_verification_stays_closed_and_blocked(store, derived, tenant, tmp_path):
    w = seed(store, derived, tenant)
    storage = LocalBackupStorage(tmp_path / "b")
    manifest = BackupService(store, storage, staging=tmp_path / "s", job_records=DeletionLedger(store)).backup(
        tenant_id=tenant
    )
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, memory_id=w["bob_gone"].memory_id)
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])

    def plant_a_forgotten_row(step: str) -> None:
        # As if the replay had missed a tombstone: put the forgotten version back inside the load.
        with store.transaction() as conn:
            conn.execute(
                "INSERT INTO control.tombstones (tenant_id, memory_id, version, job_id) VALUES (%s, %s, 1, 'planted')"
                " ON CONFLICT DO NOTHING",
                (tenant, w["carol"].memory_id),
            )

    before = {u: visible_ids(store, tenant, u) for u in ("alice", "bob", "carol")}
    broken = BackupService(
        store,
        storage,
        staging=tmp_path / "s",
        hooks={"replayed": plant_a_forgotten_row},
        job_records=DeletionLedger(store),
    )
    report = broken.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    assert report["state"] == "BLOCKED" and report["verification"]["tombstones"] == 1
    with pytest.raises(ConflictError, match="being restored"):
        store.list_visible(tenant_id=tenant, user_id="bob")
    assert tenant not in store.tenant_watermarks()  # the partitions sensor skips it, does not fail
    with store.transaction() as conn:
        state = conn.execute(
            "SELECT state FROM control.restores WHERE restore_id = %s", (report["restore_id"],)
        ).fetchone()[0]
    assert state == "BLOCKED"
    # The load rolled back: reopening shows the rows exactly as before the failed restore.
    assert broken.reopen(tenant_id=tenant) == {"tenant_id": tenant, "reopened": True}
    assert {u: visible_ids(store, tenant, u) for u in ("alice", "bob", "carol")} == before
    # And a restore may run again on a gate a BLOCKED restore left closed.
    again = broken.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    assert again["state"] == "BLOCKED"
    fixed = BackupService(store, storage, staging=tmp_path / "s", job_records=DeletionLedger(store)).restore(
        tenant_id=tenant, backup_id=manifest["backup_id"]
    )
    assert fixed["state"] == "COMPLETE" and visible_ids(store, tenant, "carol") == before["carol"]


def test_restore_sensors_launch_the_restore_and_then_the_rebuild(store, derived, tenant, tmp_path, session_settings):
    import dagster as dg

    from memory_pipelines.defs.backups.sensors import restore_requests_sensor
    from memory_pipelines.resources import MemoryStoreResource

    seed(store, derived, tenant)
    service = BackupService(
        store, LocalBackupStorage(tmp_path / "b"), staging=tmp_path / "s", job_records=DeletionLedger(store)
    )
    manifest = service.backup(tenant_id=tenant)
    requested = service.request_restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    resource = MemoryStoreResource(home=str(session_settings.home))
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(instance=instance, resources={"memory_store": resource})
        runs = restore_requests_sensor(context).run_requests
        mine = [r for r in runs if r.run_key == f"restore:{requested['restore_id']}"]
        assert len(mine) == 1 and mine[0].partition_key == tenant
        config = mine[0].run_config["ops"]["restore_tenant"]["config"]
        assert config == {"backup_id": manifest["backup_id"], "restore_id": requested["restore_id"]}


def test_restores_completing_out_of_start_order_are_each_backfilled_once(store, derived, tmp_path, session_settings):
    """Restore A starts first and commits last; the sensor ticks in between. The cursor is the commit
    sequence, so A is still seen (a completed_at cursor, the transaction's start time, missed it)."""
    import time
    import uuid

    import dagster as dg
    from dagster._core.execution.backfill import PartitionBackfill
    from dagster._core.utils import make_new_backfill_id

    from memory_pipelines.definitions import defs
    from memory_pipelines.defs.backups.sensors import REBUILT_ASSETS, restored_tenants_backfill_sensor
    from memory_pipelines.resources import MemoryStoreResource

    first, second = ("t-" + uuid.uuid4().hex[:12] for _ in range(2))
    storage = LocalBackupStorage(tmp_path / "b")
    manifests = {}
    for t in (first, second):
        seed(store, derived, t)
        manifests[t] = BackupService(store, storage, staging=tmp_path / "s", job_records=DeletionLedger(store)).backup(
            tenant_id=t
        )
    resource = MemoryStoreResource(home=str(session_settings.home))
    definitions = defs()
    requests: list[dg.RunRequest] = []
    cursor: list[str | None] = ["2026-11-01T00:00:00+00:00"]  # the old completed_at cursor, after an upgrade

    def tick() -> None:
        context = dg.build_sensor_context(
            instance=instance, resources={"memory_store": resource}, cursor=cursor[0], definitions=definitions
        )
        result = restored_tenants_backfill_sensor(context)
        assert isinstance(result, dg.SensorResult)
        requests.extend(result.run_requests or [])
        cursor[0] = result.cursor

    def second_restore_meanwhile(step: str) -> None:
        BackupService(store, storage, staging=tmp_path / "s2", job_records=DeletionLedger(store)).restore(
            tenant_id=second, backup_id=manifests[second]["backup_id"]
        )
        tick()  # sees the second restore only: the first has not committed

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [first, second])
        tick()  # whatever other tests restored: from here on, only new completions
        requests.clear()
        slow = BackupService(
            store,
            storage,
            staging=tmp_path / "s1",
            hooks={"replayed": second_restore_meanwhile},
            job_records=DeletionLedger(store),
        )
        assert slow.restore(tenant_id=first, backup_id=manifests[first]["backup_id"])["state"] == "COMPLETE"
        tick()
        tick()  # nothing new: each restore once
        by_tenant = {r.tags["memory_pipelines/tenant"]: r for r in requests}
        assert [r.tags["memory_pipelines/tenant"] for r in requests] == [second, first]
        for t, request in by_tenant.items():
            assert request.requires_backfill_daemon()
            subset = request.asset_graph_subset
            assert subset is not None
            assert {key.to_user_string() for key in subset.asset_keys} == set(REBUILT_ASSETS)
            assert {p.partition_key for p in subset.iterate_asset_partitions()} == {t}
            # What the sensor daemon does with such a request: a backfill, under Backfills.
            instance.add_backfill(
                PartitionBackfill.from_asset_graph_subset(
                    backfill_id=make_new_backfill_id(),
                    dynamic_partitions_store=instance,
                    backfill_timestamp=time.time(),
                    asset_graph_subset=subset,
                    tags=request.tags,
                    title=None,
                    description=None,
                    run_config=None,
                )
            )
        backfills = instance.get_backfills()
        assert sorted(b.tags["memory_pipelines/tenant"] for b in backfills) == sorted([first, second])
        assert all(b.is_asset_backfill for b in backfills)


def test_a_forget_after_a_restore_removes_copies_of_versions_the_restore_dropped(store, derived, tenant, tmp_path):
    """A version written after the backup is indexed, then the restore drops its primary row: its
    vector, postings and lineage are orphans, and the author's forget must take them too."""
    backups = BackupService(
        store, LocalBackupStorage(tmp_path / "backups"), staging=tmp_path / "staging", job_records=DeletionLedger(store)
    )
    seed(store, derived, tenant)
    manifest = backups.backup(tenant_id=tenant)
    late = store.write(tenant_id=tenant, user_id="alice", text="Alice moved the licorice to the attic")
    derived.sync_all(tenant_id=tenant)
    assert f"{late.memory_id}:1" in derived.vectors.ids(tenant)
    assert backups.restore(tenant_id=tenant, backup_id=manifest["backup_id"])["state"] == "COMPLETE"
    with store.transaction() as conn:
        orphans = DeletionService._orphans(conn, tenant)
    assert (late.memory_id, 1, None) in orphans  # no primary row, no memory row: author unknown
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
    assert not {r for r in derived.vectors.ids(tenant) if r.startswith(late.memory_id)}
    with store.transaction() as conn:
        left = conn.execute(
            "SELECT count(*) FROM derived.lineage WHERE tenant_id = %s AND source_memory_id = %s",
            (tenant, late.memory_id),
        ).fetchone()[0]
    assert left == 0


def test_a_tenant_never_restored_skips_the_orphan_scan(store, derived, tenant):
    seed(store, derived, tenant)
    with store.transaction() as conn:
        # Lineage of a version with no primary row, planted: without a restore it is not looked for.
        conn.execute(
            "INSERT INTO derived.lineage (tenant_id, store, record_id, source_memory_id, source_version)"
            " VALUES (%s, 'chroma', 'm_planted:1', 'm_planted', 1)",
            (tenant,),
        )
        assert DeletionService._orphans(conn, tenant) == []
