"""Retention sweeps on real engines, with the data's clock under the test's control."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest

from memory_pipelines.lib.backups.service import BackupService
from memory_pipelines.lib.backups.storage import LocalBackupStorage
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.ledger import DeletionLedger
from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.lib.retention import rules as retention

pytestmark = pytest.mark.slow
DAY = date(2026, 6, 15)


def written_days_ago(store, tenant, memory_id, days, day=DAY):
    """Move a memory's first write back in time (the clock the retention rules read)."""
    when = datetime(day.year, day.month, day.day, 12, tzinfo=UTC) - timedelta(days=days)
    with store.transaction() as conn:
        conn.execute(
            "UPDATE memory.memories SET created_at = %s WHERE tenant_id = %s AND memory_id = %s",
            (when, tenant, memory_id),
        )


def write(store, tenant, category, text, user="ann"):
    return store.write(tenant_id=tenant, user_id=user, text=text, category=category).memory_id


def test_sweep_removes_by_category_through_the_cascade_once(store, derived, tenant):
    ids = {
        "medical": write(store, tenant, "medical", "Ann had knee surgery"),
        "general": write(store, tenant, "general", "Ann likes window seats"),
        "financial_later": write(store, tenant, "financial", "Ann's salary band"),
        "food_forever": write(store, tenant, "food", "Ann is vegetarian"),
        "general_new": write(store, tenant, "general", "Ann moved to Lyon"),
    }
    written_days_ago(store, tenant, ids["medical"], 2555)
    written_days_ago(store, tenant, ids["general"], 730)
    written_days_ago(store, tenant, ids["financial_later"], 1824)  # ends tomorrow
    written_days_ago(store, tenant, ids["food_forever"], 5000)  # no policy: kept
    derived.sync_all(tenant_id=tenant)
    assert retention.preview(store, day=DAY)["tenants"][tenant] == {"general": 1, "medical": 1}

    service = DeletionService(derived)
    result = retention.sweep(service, day=DAY, tenant_id=tenant)
    job = result["jobs"][tenant]
    assert job["state"] == "COMPLETE" and job["categories"] == {"general": 1, "medical": 1}
    proof = service.proof(job_id=job["job_id"])
    assert proof["scope"]["type"] == "RETENTION" and proof["sweepDate"] == DAY.isoformat()
    assert proof["categories"] == {"general": 1, "medical": 1}
    stores = {k: v for k, v in proof["targets"].items() if k not in ("backups", "physical")}
    assert stores and all(str(v).startswith("DONE:") for v in stores.values())
    assert proof["targets"]["physical"].startswith("PENDING:")  # the tenant's erasure run rewrites later
    left = {m["memory_id"] for m in store.list_visible(tenant_id=tenant, user_id="ann")}
    assert left == {ids["financial_later"], ids["food_forever"], ids["general_new"]}
    assert {r.split(":")[0] for r in derived.vectors.ids(tenant)} == left
    assert set(derived.analytics.read_partition(tenant)["memory_id"].to_pylist()) == left

    again = retention.sweep(service, day=DAY, tenant_id=tenant)
    assert again["removed"] == 0 and again["jobs"] == {}
    tomorrow = retention.sweep(service, day=DAY + timedelta(days=1), tenant_id=tenant)
    assert tomorrow["jobs"][tenant]["categories"] == {"financial": 1}


def test_backfill_across_missed_days_and_a_tightened_policy(store, derived, tenant):
    days = [DAY + timedelta(days=i) for i in range(3)]
    for i, day in enumerate(days):
        written_days_ago(store, tenant, write(store, tenant, "general", f"note {i}"), 730, day=day)
    service = DeletionService(derived)
    removed = {d: retention.sweep(service, day=d, tenant_id=tenant)["removed"] for d in days}
    assert removed == {d: 1 for d in days}  # a backfill, oldest day first: each day its own
    assert all(retention.sweep(service, day=d, tenant_id=tenant)["removed"] == 0 for d in days)
    # Missed days swept late, newest first: the first sweep takes everything overdue, the rest none.
    for i, day in enumerate(days):
        written_days_ago(store, tenant, write(store, tenant, "general", f"late {i}"), 730, day=day)
    assert [retention.sweep(service, day=d, tenant_id=tenant)["removed"] for d in reversed(days)] == [3, 0, 0]
    # A tightened policy: a memory whose (new) period ended long ago goes at the next sweep.
    old = write(store, tenant, "medical", "note under a policy that got shorter")
    written_days_ago(store, tenant, old, 4000)
    assert retention.sweep(service, day=DAY, tenant_id=tenant)["jobs"][tenant]["categories"] == {"medical": 1}
    assert store.list_visible(tenant_id=tenant, user_id="ann") == []


def test_immediate_categories_go_through_forget(store, derived, tenant):
    gone = write(store, tenant, "eu_user", "Ann's EU-only preference")
    kept = write(store, tenant, "general", "Ann reads at night")
    service = DeletionService(derived)
    result = retention.sweep(service, day=DAY, tenant_id=tenant)
    assert result["immediate_forget_jobs"] == {tenant: 1}
    forget_jobs = [j for j in service.list_jobs(tenant_id=tenant) if j["scope"]["type"] == "MEMORY"]
    assert [j["state"] for j in forget_jobs] == ["COMPLETE"] and forget_jobs[0]["scope"]["memory_id"] == gone
    assert [m["memory_id"] for m in store.list_visible(tenant_id=tenant, user_id="ann")] == [kept]


def test_restore_does_not_bring_back_what_retention_removed(store, derived, tenant, tmp_path):
    old = write(store, tenant, "medical", "Ann's old prescription")
    written_days_ago(store, tenant, old, 2555)
    kept = write(store, tenant, "general", "Ann's bike is blue")
    backups = BackupService(
        store, LocalBackupStorage(tmp_path / "b"), staging=tmp_path / "s", job_records=DeletionLedger(store)
    )
    manifest = backups.backup(tenant_id=tenant)
    result = retention.sweep(DeletionService(derived), day=DAY, tenant_id=tenant)
    assert result["removed"] == 1
    report = backups.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    assert report["replayed"]["rows_removed"]["tombstones"] == 1
    assert [m["memory_id"] for m in store.list_visible(tenant_id=tenant, user_id="ann")] == [kept]
    # The backup's copy is sealed under the version's own key, destroyed: shredded once the erasure
    # has rotated the KEK (issue 32; before version keys it waited for the backup's expiry).
    proof = DeletionService(derived).proof(job_id=result["jobs"][tenant]["job_id"])
    assert proof["targets"]["backups"] == "PENDING_SHRED:1"


@pytest.mark.parametrize(
    ("body", "field", "line"),
    [
        ("version: x\npolicies:\n  medical:\n    keep_days: 10\n  medicla:\n    keep_days: 5\n", "category", 5),
        ("version: x\npolicies:\n  general:\n    keep_days: -3\n", "keep_days", 4),
        ("version: x\npolicies:\n  general:\n    keep_days: soon\n", "keep_days", 4),
        ("version: x\npolicies:\n  general:\n    immediate: false\n", "immediate", 3),
        ("version: x\npolicies:\n  general:\n    keep_days: 3\n    immediate: true\n", "policy", 3),
    ],
)
def test_bad_policy_files_are_refused_with_the_line(tmp_path: Path, body, field, line):
    path = tmp_path / "retention_policies.yaml"
    path.write_text(body)
    with pytest.raises(ValidationError) as err:
        retention.load_policies(path)
    assert err.value.field == field and f"line {line}" in err.value.message


def test_shipped_policies_load():
    policies = retention.load_policies()
    assert policies.keep_days == {"medical": 2555, "financial": 1825, "general": 730}
    assert policies.immediate == {"eu_user"}


def test_bad_sweep_day(store, derived):
    with pytest.raises(ValidationError, match="YYYY-MM-DD"):
        retention.preview(store, day="yesterday")


def test_dagster_retention_runs_per_tenant_and_day_and_touch_only_their_tenant(
    store, derived, tenant, session_settings
):
    import os

    import dagster as dg

    from memory_pipelines.definitions import defs
    from memory_pipelines.defs.retention.jobs import DAY_TAG, RETENTION_JOB, retention_run_config

    other = tenant + "-b"
    days = [date(2025, 3, d) for d in (1, 2, 3)]
    for i, day in enumerate(days):
        written_days_ago(store, tenant, write(store, tenant, "financial", f"invoice {i}"), 1825, day=day)
    theirs = write(store, other, "financial", "the other tenant's invoice")
    written_days_ago(store, other, theirs, 1825, day=days[0])
    os.environ["MEMORY_PIPELINES_HOME"] = str(session_settings.home)
    job = defs().resolve_job_def(RETENTION_JOB)
    assert job.partitions_def.name == "tenants"
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [tenant, other])
        removed = {}
        for day in days:  # what the CLI (or a backfill over missed days) launches: one run per tenant and day
            result = job.execute_in_process(
                instance=instance,
                partition_key=tenant,
                run_config=retention_run_config(day=day.isoformat()),
                tags={DAY_TAG: day.isoformat()},
            )
            assert result.success
            [report] = [
                e.step_materialization_data.materialization
                for e in result.get_asset_materialization_events()
                if e.asset_key.to_user_string() == "memory_deletions"
            ]
            metadata = {k: v.value for k, v in report.metadata.items()}
            assert report.partition == tenant and metadata["retention_day"] == day.isoformat()
            assert metadata["policy_version"] and metadata["basis"] == "retention"
            assert metadata["removed"] == 1 and metadata["category_financial"] == 1
            [job_id] = metadata["deletion_job_ids"]
            assert metadata["deletion_states"] == {job_id: "COMPLETE"}
            removed[day] = {k: v for k, v in metadata.items() if k.startswith("category_")}
    assert removed == {day: {"category_financial": 1} for day in days}
    assert store.list_visible(tenant_id=tenant, user_id="ann") == []
    # The other tenant's expired memory is still there: its own run has not come.
    assert [m["memory_id"] for m in store.list_visible(tenant_id=other, user_id="ann")] == [theirs]


def test_retention_schedule_fans_out_over_tenants_for_the_day_that_ended(tenant):
    from datetime import datetime

    import dagster as dg

    from memory_pipelines.defs.retention.jobs import DAY_TAG, retention_run_config
    from memory_pipelines.defs.retention.schedules import retention_schedule

    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [tenant, tenant + "-b"])
        with dg.build_schedule_context(
            instance=instance, scheduled_execution_time=datetime(2026, 6, 16, 2, tzinfo=UTC)
        ) as context:
            requests = retention_schedule(context)
    assert [(r.partition_key, r.run_key, r.tags[DAY_TAG]) for r in requests] == [
        (tenant, f"retention:2026-06-15:{tenant}", "2026-06-15"),
        (tenant + "-b", f"retention:2026-06-15:{tenant}-b", "2026-06-15"),
    ]
    assert all(r.run_config == retention_run_config(day="2026-06-15") for r in requests)
