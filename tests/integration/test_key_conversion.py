"""Issue 32: texts an older release sealed under their author's subject key are converted to version
keys (lib/memories/key_conversion.py): in batches, resumable, readable throughout; the subject key
that sealed them is replaced and retired, then destroyed once the backups that need it expire."""

from __future__ import annotations

import json
import threading
from typing import Any

import dagster as dg
import psycopg
import pytest

from memory_pipelines.lib.backups.service import BackupService
from memory_pipelines.lib.backups.storage import LocalBackupStorage
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.erasure import ErasureService
from memory_pipelines.lib.forget.ledger import DeletionLedger
from memory_pipelines.lib.memories import key_conversion
from memory_pipelines.lib.memories.key_conversion import KeyConversion
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.stores.derived import DerivedStores, convert_keys
from memory_pipelines.lib.stores.keyword.index import KeywordIndex
from memory_pipelines.resources import MemoryStoreResource
from tests.conftest import run_cli
from tests.support.legacy import seal_as_before_version_keys

pytestmark = pytest.mark.slow


def _legacy_tenant(store: MemoryStore, derived: DerivedStores, tenant: str, n: int = 12) -> dict[str, Any]:
    """alice's and bob's memories, every version sealed as before version keys; indexed."""
    written = {
        "alice": [
            store.write(tenant_id=tenant, user_id="alice", text=f"alice owns kayak number {i}") for i in range(n)
        ],
        "bob": [store.write(tenant_id=tenant, user_id="bob", text=f"bob grows tomatoes bed {i}") for i in range(3)],
    }
    edited = store.write(
        tenant_id=tenant,
        user_id="alice",
        text="alice owns kayak number 0, now red",
        memory_id=written["alice"][0].memory_id,
    )
    for memories in written.values():
        for m in memories:
            seal_as_before_version_keys(store, tenant, m.memory_id)
    derived.sync_all(tenant_id=tenant)
    return {**written, "edited": edited}


def _texts(store: MemoryStore, tenant: str) -> dict[str, list[str]]:
    return {
        user: sorted(m["text"] for m in store.list_visible(tenant_id=tenant, user_id=user)) for user in ("alice", "bob")
    }


def _legacy_rows(store: MemoryStore, tenant: str) -> int:
    with store.transaction() as conn:
        row = conn.execute(
            "SELECT count(*) FROM memory.memory_versions WHERE tenant_id = %s AND key_id NOT LIKE 'vk\\_%%'", (tenant,)
        ).fetchone()
    return int(row[0]) if row else -1


def _conversion(store: MemoryStore) -> KeyConversion:
    return KeyConversion(store.transaction, store.keys, backup_days=30)


def test_a_stopped_conversion_resumes_and_every_read_works_throughout(
    store: MemoryStore, derived: DerivedStores, tenant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = _legacy_tenant(store, derived, tenant)
    before = _texts(store, tenant)
    assert _legacy_rows(store, tenant) == 16 and _conversion(store).pending(tenant_id=tenant) == {tenant: 2}
    with store.transaction() as conn:
        old_alice = conn.execute(
            "SELECT key_id FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = 'alice'", (tenant,)
        ).fetchone()[0]  # type: ignore[index]

    # A reader in another thread, all along: every text, every time.
    stop, seen, failures = threading.Event(), [], []

    def read() -> None:
        while not stop.is_set():
            try:
                seen.append(_texts(store, tenant) == before)
            except Exception as exc:  # a read that fails is what this test is about
                failures.append(repr(exc))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        # Batches of 5; the run stops (a crash) after alice's second batch, before her key's retirement.
        monkeypatch.setattr(key_conversion, "BATCH", 5)
        calls = {"n": 0}
        real = KeyConversion._reseal_batch

        def crash_after_two(self: KeyConversion, conn: psycopg.Connection, tenant_id: str, user_id: str) -> int:
            calls["n"] += 1
            if calls["n"] > 2:
                raise RuntimeError("killed")
            return real(self, conn, tenant_id, user_id)

        monkeypatch.setattr(KeyConversion, "_reseal_batch", crash_after_two)
        with pytest.raises(RuntimeError, match="killed"):
            convert_keys(store, tenant_id=tenant, backup_days=30)
        assert _legacy_rows(store, tenant) == 6  # 10 of 16 converted, committed batch by batch
        monkeypatch.setattr(KeyConversion, "_reseal_batch", real)
        counts = convert_keys(store, tenant_id=tenant, backup_days=30)
    finally:
        stop.set()
        reader.join(30)
    assert failures == [] and seen and all(seen), failures[:3]
    assert counts == {
        "tenant_id": tenant,
        "subjects": 2,
        "resealed": 6,
        "macs": 16,
        "retired": 2,
        "retired_destroyed": 0,
        "postings_rekeyed": 15,
    }, counts
    assert _legacy_rows(store, tenant) == 0 and _conversion(store).pending(tenant_id=tenant) == {}
    assert _texts(store, tenant) == before
    with store.transaction() as conn:
        retired = conn.execute(
            "SELECT key_id, destroy_after > now() + interval '29 days' FROM keystore.retired_keys"
            " WHERE tenant_id = %s AND user_id = 'alice'",
            (tenant,),
        ).fetchall()
        new_alice = conn.execute(
            "SELECT key_id, seals_text FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = 'alice'", (tenant,)
        ).fetchone()
    assert retired == [(old_alice, True)] and new_alice is not None and new_alice[0] != old_alice
    assert new_alice[1] is False
    # The no-op rule compares MACs under the new key: an identical write is the same memory.
    again = store.write(tenant_id=tenant, user_id="alice", text="alice owns kayak number 3")
    assert (again.memory_id, again.changed) == (written["alice"][3].memory_id, False)
    # The author-only postings were rewritten under her new keyword key: her keyword search finds them.
    hits = KeywordIndex(store).search_visible(tenant_id=tenant, user_id="alice", team_id=None, query="kayak", limit=20)
    assert len(hits) == 12
    # The rollback reads an earlier version re-sealed under its own key.
    rolled = store.rollback(tenant_id=tenant, memory_id=written["alice"][0].memory_id, user_id="alice")
    assert rolled["text"] == "alice owns kayak number 0"


def test_until_the_retired_key_goes_a_forget_says_what_it_leaves_then_the_key_is_destroyed(
    store: MemoryStore, derived: DerivedStores, tenant: str, tmp_path
) -> None:
    written = _legacy_tenant(store, derived, tenant, n=3)
    backups = BackupService(
        store, LocalBackupStorage(tmp_path / "b"), staging=tmp_path / "s", job_records=DeletionLedger(store)
    )
    manifest = backups.backup(tenant_id=tenant)  # holds texts sealed under alice's old key
    convert_keys(store, tenant_id=tenant, backup_days=30)
    service = DeletionService(derived)
    # Converted, but copies made before (that backup, and any WAL archive) open with her retired key.
    first = service.request(tenant_id=tenant, memory_id=written["alice"][1].memory_id)
    service.run_batch(tenant_id=tenant, job_ids=[first["job_id"]])
    proof = service.proof(job_id=first["job_id"])
    assert proof["guarantees"]["primary"]["cryptographic"] == "NONE"
    assert proof["guarantees"]["primary"]["legacySealed"] == 1
    assert proof["targets"]["backups"].startswith("PENDING_EXPIRY:")
    # A restore of the backup brings alice's texts back under the retired key: readable, and
    # converted again (her current key never sealed a text: nothing more to retire).
    restored = backups.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    assert restored["state"] == "COMPLETE"
    assert _legacy_rows(store, tenant) > 0
    assert "alice owns kayak number 2" in _texts(store, tenant)["alice"]
    again = convert_keys(store, tenant_id=tenant, backup_days=30)
    assert again["retired"] == 0 and again["resealed"] > 0 and _legacy_rows(store, tenant) == 0

    # Every backup that needed it has expired: the next rotation destroys the retired keys.
    with store.transaction() as conn:
        conn.execute("UPDATE keystore.retired_keys SET destroy_after = now() WHERE tenant_id = %s", (tenant,))
    assert _conversion(store).pending(tenant_id=tenant) == {tenant: 2}
    assert convert_keys(store, tenant_id=tenant, backup_days=30)["retired_destroyed"] == 2
    with store.transaction() as conn:
        left = conn.execute("SELECT count(*) FROM keystore.retired_keys WHERE tenant_id = %s", (tenant,)).fetchone()
    assert left == (0,)
    # From now on a forget of those versions destroys every key of theirs.
    second = service.request(tenant_id=tenant, memory_id=written["alice"][2].memory_id)
    service.run_batch(tenant_id=tenant, job_ids=[second["job_id"]])
    ErasureService(derived).erase_tenant(tenant_id=tenant)
    proof = service.proof(job_id=second["job_id"])
    assert proof["guarantees"]["primary"]["cryptographic"].startswith("KEY_DESTROYED:")


def test_the_cli_and_the_dagster_asset_convert(
    store: MemoryStore, derived: DerivedStores, session_settings: Any, cli_env: dict[str, Any], tenant: str
) -> None:
    _legacy_tenant(store, derived, tenant, n=2)
    other = tenant + "-b"
    _legacy_tenant(store, derived, other, n=2)
    done = run_cli("keys", "convert", "--tenant", tenant, home=cli_env["home"], env=cli_env["env"])
    assert done.returncode == 0, done.stderr
    # alice's 2 memories (one of them edited once) and bob's 3: 6 versions.
    [converted] = json.loads(done.stdout)["converted"]
    assert (converted["tenant_id"], converted["resealed"]) == (tenant, 6)
    assert _legacy_rows(store, tenant) == 0 and _legacy_rows(store, other) == 6
    bad = run_cli("keys", "convert", "--tenant", "no such tenant!", home=cli_env["home"], env=cli_env["env"])
    assert bad.returncode == 2 and "tenant" in bad.stderr

    from memory_pipelines.definitions import defs
    from memory_pipelines.defs.erasure.sensors import key_conversion_sensor

    instance = dg.DagsterInstance.from_config(str(session_settings.dagster_home))
    instance.add_dynamic_partitions("tenants", [tenant, other])
    resource = MemoryStoreResource(home=str(session_settings.home))
    # The sensor asks for a run of the tenant left to convert, not of the one converted.
    asked = key_conversion_sensor(dg.build_sensor_context(instance=instance, resources={"memory_store": resource}))
    assert isinstance(asked, dg.SensorResult)
    assert {r.partition_key for r in asked.run_requests or []} & {tenant, other} == {other}
    job = defs().resolve_job_def("convert_keys")
    result = job.execute_in_process(instance=instance, partition_key=other, resources={"memory_store": resource})
    assert result.success
    [materialization] = result.asset_materializations_for_node("key_conversion")
    assert materialization.metadata["resealed"].value == 6 and materialization.metadata["retired"].value == 2
    assert _legacy_rows(store, other) == 0
    instance.dispose()
