"""Adding a store is one package: a toy store registered from tests/ (its own table, adapter and sync)
is synced, shown as an asset with its check, forgotten by the cascade and the forget graph,
verified, proven, certified, counted in the data map, erased and dropped by a restore, with no edit
outside its package."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

import pytest

from memory_pipelines.defs.forget.ops import job_key
from memory_pipelines.lib.backups.service import BackupService
from memory_pipelines.lib.backups.storage import LocalBackupStorage
from memory_pipelines.lib.forget import certificate
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.erasure import ErasureService
from memory_pipelines.lib.forget.ledger import DeletionLedger
from memory_pipelines.lib.infra.errors import ConflictError, ServiceError
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.stores import lineage, registry
from memory_pipelines.platform import MemoryPlatform
from tests.support.toy_store import store as toy
from tests.support.toy_store.spec import SPECS

pytestmark = pytest.mark.slow


@pytest.fixture
def toy_registered(store) -> Iterator[None]:
    from memory_pipelines.definitions import defs

    # The code location's module-level objects are built before the toy registers (as at a real
    # start), so no other test in this process sees a toy asset; this test builds its own.
    defs()
    toy.install(store)
    with registry.register(*SPECS):
        yield
    assert not registry.is_registered(toy.NAME)


def _cleanup(store, tenant: str) -> None:
    # The shared database outlives the registration: no edge of an unknown store is left behind.
    with store.transaction() as conn:
        conn.execute("DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s", (tenant, toy.NAME))
        conn.execute("DELETE FROM derived.toy_notes WHERE tenant_id = %s", (tenant,))


def test_the_toy_store_is_in_every_list_that_names_the_stores(toy_registered):
    from memory_pipelines.defs.stores.assets import store_assets

    names = registry.names()
    assert names.index("analytics") < names.index(toy.NAME) < names.index("primary")  # a copy: before the source
    assert toy.NAME in registry.derived_names()
    assert "toy_notes" in {a.key.to_user_string() for a in store_assets()}
    checks = {spec.name for a in store_assets() for spec in a.check_specs}
    assert "toy_notes_lineage" in checks
    assert registry.adapter(toy.NAME).name == toy.NAME


def test_a_forget_reaches_the_toy_store_and_proves_it(toy_registered, store, derived, tenant):
    try:
        alice = store.write(tenant_id=tenant, user_id="alice", text="Alice keeps a toy boat in the bath")
        bob = store.write(tenant_id=tenant, user_id="bob", text="Bob folds paper cranes")
        synced = derived.sync_all(tenant_id=tenant)
        assert synced["toy_notes"] == {"records": 2, "written": 2, "removed": 0}
        assert toy.notes(store, tenant) == {f"{alice.memory_id}:1", f"{bob.memory_id}:1"}
        before = certificate.data_map(store, tenant)
        assert before["toy_notes"] == 2

        service = DeletionService(derived)
        job = service.request(tenant_id=tenant, subject="alice", basis="gdpr-art17")
        service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])

        assert toy.notes(store, tenant) == {f"{bob.memory_id}:1"}
        status = service.status(job_id=job["job_id"])
        assert status["state"] == "COMPLETE" and status["targets"]["toy_notes"] == "DONE:1"
        proof = service.proof(job_id=job["job_id"])
        assert proof["targets"]["toy_notes"] == "DONE:1"
        assert proof["verification"]["exact_id_queries"]["toy_notes"] == 0
        assert proof["adapterVersions"]["toy_notes"] == "toy-v1"
        assert certificate.data_map(store, tenant)["toy_notes"] == 1

        erased = ErasureService(derived).erase_tenant(tenant_id=tenant)
        assert "toy_notes" in str(erased)
        md = certificate.render_markdown(service.proof(job_id=job["job_id"]), service.status(job_id=job["job_id"]))
        row = next(line for line in md.splitlines() if line.startswith("| `toy_notes`"))
        assert "`DONE:1`" in row and "| `1` |" in row and "passed: 0 left by exact id" in row
        stores = md[md.index("## Stores") : md.index("## Verification")]
        rows = [line.split("|")[1].strip(" `") for line in stores.splitlines() if line.startswith("| `")]
        assert rows == registry.names()
    finally:
        _cleanup(store, tenant)


def test_a_restore_drops_the_toy_notes_of_versions_it_drops(toy_registered, store, derived, tenant, tmp_path):
    try:
        first = store.write(tenant_id=tenant, user_id="bob", text="Bob folds paper cranes")
        derived.sync_all(tenant_id=tenant)
        backups = BackupService(
            store,
            LocalBackupStorage(tmp_path / "backups"),
            staging=tmp_path / "staging",
            job_records=DeletionLedger(store),
        )
        taken = backups.backup(tenant_id=tenant)
        late = store.write(tenant_id=tenant, user_id="bob", text="Bob folds paper boats", memory_id=first.memory_id)
        derived.sync_all(tenant_id=tenant)
        assert toy.notes(store, tenant) == {f"{first.memory_id}:{late.version}"}
        report = backups.restore(tenant_id=tenant, backup_id=taken["backup_id"])
        assert report["state"] == "COMPLETE"
        assert report["replayed"]["rows_removed"]["dropped_toy_notes"] == 1
        assert toy.notes(store, tenant) == set()  # version 2's note went with it; the rebuild makes version 1's
        assert derived.sync_all(tenant_id=tenant)["toy_notes"]["written"] == 1
        assert toy.notes(store, tenant) == {f"{first.memory_id}:1"}
    finally:
        _cleanup(store, tenant)


def test_the_forget_graph_has_and_runs_a_step_for_the_toy_store(
    toy_registered, store, derived, tenant, session_settings
):
    import dagster as dg

    from memory_pipelines.defs.forget.deletions import build_memory_deletions
    from memory_pipelines.defs.forget.jobs import forget_run_config
    from memory_pipelines.defs.forget.ops import forget_batch
    from memory_pipelines.resources import AnalyticsResource, ChromaResource, MemoryStoreResource, SummarizerResource

    try:
        store.write(tenant_id=tenant, user_id="alice", text="Alice keeps a toy boat in the bath")
        store.write(tenant_id=tenant, user_id="bob", text="Bob folds paper cranes")
        derived.sync_all(tenant_id=tenant)
        job = DeletionService(derived).request(tenant_id=tenant, subject="alice")
        graph = build_memory_deletions()
        steps = [node.name for node in graph.node_def.nodes_in_topological_order]
        stores = [f"delete_{name}" for name in registry.names()]
        assert steps == ["freeze", *stores, "verify", "prove"]
        assert steps.index("delete_analytics") < steps.index("delete_toy_notes") < steps.index("delete_primary")
        home = str(session_settings.home)
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("tenants", [tenant])
            result = dg.materialize(
                [graph],
                instance=instance,
                partition_key=tenant,
                run_config=forget_run_config(job_ids=[job["job_id"]]),
                resources={
                    "memory_store": MemoryStoreResource(home=home),
                    "chroma": ChromaResource(home=home),
                    "summarizer": SummarizerResource(),
                    "analytics": AnalyticsResource(home=home),
                    "forget_batch": forget_batch,
                },
            )
        assert result.success
        ran = {e.step_key for e in result.all_events if e.event_type_value == "STEP_SUCCESS"}
        assert "memory_deletions.delete_toy_notes" in ran
        [done] = [
            e.step_materialization_data.materialization
            for e in result.get_asset_materialization_events()
            if e.asset_key == dg.AssetKey("memory_deletions")
        ]
        assert done.metadata["store_toy_notes"].value == 1
        assert done.metadata["data_map_before"].value["toy_notes"] == 2
        assert done.metadata["data_map_after"].value["toy_notes"] == 1
        assert "| `toy_notes`" in done.metadata[job_key("certificate", job["job_id"])].value
        assert len(toy.notes(store, tenant)) == 1
    finally:
        _cleanup(store, tenant)


# -- a store deletion could not reach is refused; an onboarding store gets test tenants only ------


class _AdapterWithoutErase:
    name = toy.NAME

    def find(self, conn, ctx): ...
    def delete(self, ctx): ...
    def count(self, ctx): ...
    def verify(self, ctx, probes): ...
    def fingerprints(self, conn, ctx): ...


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"adapter": None}, "no deletion adapter"),
        ({"adapter": _AdapterWithoutErase}, "its deletion adapter lacks erase"),
        ({"adapter": "tests.support.toy_store.adapter:Missing"}, "cannot be loaded"),
        ({"verification": " "}, "no verification"),
        ({"sync": None, "asset": None, "restore_drop": None}, "no restore drop, and no sync"),
        ({"stage": "someday"}, "stage 'someday'"),
    ],
)
def test_a_store_deletion_could_not_reach_is_refused_at_registration(change, named):
    broken = dataclasses.replace(SPECS[0], **change)
    with pytest.raises(ServiceError) as err, registry.register(broken):
        pass
    assert err.value.field == "store" and named in err.value.message and toy.NAME in err.value.message
    assert not registry.is_registered(toy.NAME)


def test_an_onboarding_store_receives_only_test_tenants_memories(store, derived):
    toy.install(store)
    trial, customer = "toy-trial-" + uuid.uuid4().hex[:8], "toy-customer-" + uuid.uuid4().hex[:8]
    assert store.set_test_tenant(tenant_id=trial) == {"tenant_id": trial, "test": True}
    onboarding = dataclasses.replace(SPECS[0], stage=registry.ONBOARDING)
    try:
        with registry.register(onboarding):
            for tenant in (trial, customer):
                store.write(tenant_id=tenant, user_id="alice", text="Alice keeps a toy boat in the bath")
            assert registry.run_sync(onboarding, derived, tenant_id=trial).counts["records"] == 1
            skipped = registry.run_sync(onboarding, derived, tenant_id=customer)
            assert skipped.counts == {"records": 0} and "onboarding" in skipped.text["skipped"]
            assert len(toy.notes(store, trial)) == 1 and toy.notes(store, customer) == set()
            # Any other way in is refused too: lineage is the gate every derived write passes.
            with store.transaction() as conn, pytest.raises(ServiceError) as err:
                lineage.insert_edges(conn, tenant_id=customer, store=toy.NAME, records=[("n", ("m", 1))])
            assert "onboarding" in err.value.message and customer in err.value.message
            # Marked a test tenant, it receives them. Unmarking it while the store holds its records is
            # refused (they would go stale); done underneath anyway, its next sync says so, never skips.
            store.set_test_tenant(tenant_id=customer)
            assert registry.run_sync(onboarding, derived, tenant_id=customer).counts["records"] == 1
            platform = MemoryPlatform(settings=Settings.from_env(), store=store, derived=derived)
            with pytest.raises(ConflictError) as refused:
                platform.set_test_tenant(tenant_id=customer, test=False)
            assert toy.NAME in refused.value.message and refused.value.field == "tenant"
            assert store.set_test_tenant(tenant_id=customer, test=False)["test"] is False
            with pytest.raises(ServiceError) as stale:
                registry.run_sync(onboarding, derived, tenant_id=customer)
            assert "still holds 1 record" in stale.value.message
            # A deletion's rebuild that leaves nothing to write passes the gate (it writes no edge).
            with store.transaction() as conn:
                assert lineage.insert_edges(conn, tenant_id=customer, store=toy.NAME, records=[]) == 0
        # Enforced, every tenant's.
        store.write(tenant_id=customer, user_id="bob", text="Bob folds paper cranes")
        with registry.register(SPECS[0]):
            assert registry.run_sync(SPECS[0], derived, tenant_id=customer).counts["records"] == 2
    finally:
        for tenant in (trial, customer):
            _cleanup(store, tenant)
