"""Restoring from the UI: `tenant_backups` lists the tenant's backups as a table, and the `restore`
job's launchpad config fails early, naming `backup_id` and listing the ids that would work."""

from __future__ import annotations

import dagster as dg
import pytest

from memory_pipelines.defs.backups.jobs import RestoreConfig, restore_job
from memory_pipelines.lib.backups.catalog import catalog
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.resources import BackupResource, MemoryStoreResource

pytestmark = pytest.mark.slow

COLUMNS = [
    "backup_id",
    "created_at",
    "expires_at",
    "bytes",
    "memories",
    "status",
    "restorable",
    "subject_keys_shredded",
]


@pytest.fixture
def instance(session_settings):
    instance = dg.DagsterInstance.from_config(str(session_settings.dagster_home))
    yield instance
    instance.dispose()


def _resources(session_settings) -> dict:
    home = str(session_settings.home)
    return {"memory_store": MemoryStoreResource(home=home), "backups": BackupResource(home=home)}


def _restore(instance, session_settings, tenant: str, backup_id: str) -> dg.ExecuteInProcessResult:
    return restore_job.execute_in_process(
        run_config={"ops": {"restore_tenant": {"config": {"backup_id": backup_id}}}},
        instance=instance,
        partition_key=tenant,
        resources=_resources(session_settings),
        raise_on_error=False,
    )


def test_tenant_backups_metadata_lists_the_backups_as_a_table(store, derived, session_settings, tenant, instance):
    from memory_pipelines.definitions import defs

    store.write(tenant_id=tenant, user_id="alice", text="Alice likes oolong")
    store.write(tenant_id=tenant, user_id="bob", text="Bob likes espresso")
    instance.add_dynamic_partitions("tenants", [tenant])
    job = defs().resolve_job_def("backup")
    runs = [
        job.execute_in_process(instance=instance, partition_key=tenant, resources=_resources(session_settings))
        for _ in range(2)
    ]
    assert all(run.success for run in runs)
    ids = [run.asset_materializations_for_node("tenant_backups")[0].metadata["backup_id"].value for run in runs]
    [latest] = runs[1].asset_materializations_for_node("tenant_backups")
    table = latest.metadata["backups"]
    assert isinstance(table, dg.TableMetadataValue)
    assert [column.name for column in table.schema.columns] == COLUMNS
    rows = [record.data for record in table.records]
    assert [row["backup_id"] for row in rows] == ids[::-1]  # newest first
    assert [(row["status"], row["restorable"], row["memories"]) for row in rows] == [("AVAILABLE", True, 2)] * 2
    assert all(row["bytes"] > 0 and row["subject_keys_shredded"] == 0 for row in rows)
    assert latest.metadata["restorable_backups"].value == 2
    assert "oolong" not in str(table.records)

    # Forgetting bob shreds his key: the backups stay restorable (the replay drops his rows); shredding
    # the tenant key makes every backup unreadable, and the table says so.
    service = BackupResource(home=str(session_settings.home)).service(store=store)
    deletions = DeletionService(derived)
    deletions.shred_keys(tenant_id=tenant, subject="bob")
    listed = catalog(service, tenant_id=tenant)
    assert [(r["restorable"], r["subject_keys_shredded"]) for r in listed] == [(True, 1)] * 2
    deletions.shred_keys(tenant_id=tenant, confirm=tenant)
    assert {(r["status"], r["restorable"]) for r in catalog(service, tenant_id=tenant)} == {("SHREDDED", False)}


def test_restore_config_names_backup_id_and_lists_the_tenants_backups(store, session_settings, tenant, instance):
    # The launchpad's default: empty, with a description saying where the ids are.
    field = RestoreConfig.model_fields["backup_id"]
    assert RestoreConfig().backup_id == "" and "tenant_backups" in str(field.description)

    store.write(tenant_id=tenant, user_id="alice", text="Alice likes oolong")
    service = BackupResource(home=str(session_settings.home)).service(store=store)
    older = service.backup(tenant_id=tenant)["backup_id"]
    newer = service.backup(tenant_id=tenant)["backup_id"]
    other = f"{tenant}-other"
    store.write(tenant_id=other, user_id="carol", text="Carol likes mate")
    foreign = service.backup(tenant_id=other)["backup_id"]
    instance.add_dynamic_partitions("tenants", [tenant])

    unknown = "b_20260101T000000_deadbeef"
    cases = {
        unknown: f"backup_id: unknown backup id {unknown!r} for tenant {tenant!r}",
        foreign: f"backup_id: unknown backup id {foreign!r} for tenant {tenant!r}",
        "../../etc/passwd": "backup_id: malformed backup id '../../etc/passwd'",
        "": "backup_id: is required",
    }
    for backup_id, expected in cases.items():
        result = _restore(instance, session_settings, tenant, backup_id)
        assert not result.success
        failure = result.failure_data_for_node("restore_tenant")
        assert failure is not None and failure.user_failure_data is not None
        description = str(failure.user_failure_data.description)
        assert description.startswith(expected), description
        assert f"(newest first): {newer}, {older}." in description and foreign not in description.split(":", 2)[2]
        assert failure.user_failure_data.metadata["available_backup_ids"].value == [newer, older]
    # Nothing was touched: reads stay open, the memory is there.
    assert [m["text"] for m in store.list_visible(tenant_id=tenant, user_id="alice")] == ["Alice likes oolong"]

    # A good id restores.
    assert _restore(instance, session_settings, tenant, older).success
