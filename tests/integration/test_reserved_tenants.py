"""Issue 21, item 1: the platform's own tenants (evaluation, canary drills) are closed to customers, and
no customer tenant is skipped by any sensor or schedule.

On 970c91a a customer could create and write tenant `eval` (the monthly evaluation then made it
`shared_pool`, so bob read alice's team memory), and `eval-*`/`canary-*` tenants were accepted but
skipped by the forget, erasure and backup automation.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import dagster as dg
import pytest

from memory_pipelines import cli
from memory_pipelines.defs.backups.schedules import nightly_backups
from memory_pipelines.defs.erasure.sensors import physical_erasure_sensor
from memory_pipelines.defs.forget.sensors import forget_requests_sensor
from memory_pipelines.defs.memories.sensors import tenant_partitions_sensor
from memory_pipelines.defs.retention.schedules import retention_schedule
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.platform import MemoryPlatform
from memory_pipelines.resources import MemoryStoreResource


def reserved_ids(h: str) -> list[str]:
    """Reserved ids no other test makes (the evaluation tests of this session make `eval` itself)."""
    return [f"eval-{h}", f"canary-{h}", f"canary-x-{h}"]


def look_alikes(h: str) -> list[str]:
    """Customer ids that look internal but are not reserved: every one must be served like any other."""
    return [
        f"eval{h}",
        f"eval_{h}",
        f"evaluation-{h}",
        f"Eval-{h}",
        f"canary{h}",
        f"canary_{h}",
        f"CANARY-{h}",
        f"x-canary-{h}",
    ]


def _tenant_rows(store, ids: list[str]) -> list[str]:
    with store.transaction() as conn:
        return [r[0] for r in conn.execute("SELECT tenant_id FROM memory.tenants WHERE tenant_id = ANY(%s)", (ids,))]


def test_reserved_ids_are_exactly_the_platforms():
    h = uuid.uuid4().hex[:8]
    for tenant in ["eval", "eval-", "canary-", *reserved_ids(h)]:
        assert validation.is_reserved_tenant(tenant), tenant
        with pytest.raises(ValidationError) as refused:
            validation.check_customer_tenant("tenant", tenant)
        assert refused.value.field == "tenant" and "reserved" in refused.value.message
    for tenant in look_alikes(h):
        assert not validation.is_reserved_tenant(tenant), tenant
        assert validation.check_customer_tenant("tenant", tenant) == tenant


def test_no_door_creates_or_touches_a_reserved_tenant(store, derived, session_settings, cli_env, capsys, monkeypatch):
    h = uuid.uuid4().hex[:8]
    refused = reserved_ids(h)
    platform = MemoryPlatform(settings=session_settings, store=store, derived=derived)
    calls = {
        "store.write": lambda t: store.write(tenant_id=t, user_id="mallory", text="I was here first"),
        "store.write_many": lambda t: store.write_many(tenant_id=t, items=[{"user_id": "mallory", "text": "first"}]),
        "store.create_tenant": lambda t: store.create_tenant(tenant_id=t, sharing_mode="strict"),
        "store.add_team_member": lambda t: store.add_team_member(tenant_id=t, team_id="x", user_id="mallory"),
        "platform.write": lambda t: platform.write(tenant_id=t, user_id="mallory", text="I was here first"),
        "platform.list": lambda t: platform.list(tenant_id=t, user_id="mallory"),
        "platform.forget": lambda t: platform.forget(tenant_id=t, subject="mallory"),
        "platform.backup": lambda t: platform.backup(tenant_id=t),
    }
    for tenant in refused:
        for name, call in calls.items():
            with pytest.raises(ValidationError) as exc:
                call(tenant)
            assert exc.value.field == "tenant", (name, tenant, exc.value)
    # `eval` itself may exist (the evaluation makes it): no customer door reaches it either way.
    for name, call in calls.items():
        if name.startswith("platform."):
            with pytest.raises(ValidationError) as exc:
                call("eval")
            assert exc.value.field == "tenant", (name, exc.value)
    for name, value in cli_env["env"].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MEMORY_PIPELINES_HOME", str(cli_env["home"]))
    for tenant in ["eval", *refused]:
        for argv in (
            ["write", "--tenant", tenant, "--user", "mallory", "first"],
            ["tenant", "create", "--tenant", tenant, "--sharing-mode", "shared_pool"],
            ["forget", "--tenant", tenant, "--subject", "mallory"],
            ["list", "--tenant", tenant, "--user", "mallory"],
        ):
            capsys.readouterr()
            code = cli.main(argv)
            out, err = capsys.readouterr()
            assert code == 2 and out == "", (argv, code, out, err)
            assert err.startswith("memory-pipelines: error: tenant: ") and "reserved" in err, err
    assert _tenant_rows(store, refused) == []
    # The platform's own code still makes them (the evaluation and the canary drill do so).
    with validation.platform_owned():
        store.create_tenant(tenant_id=f"eval-{h}", sharing_mode="shared_pool")
    assert _tenant_rows(store, refused) == [f"eval-{h}"]
    # Once made, a customer still cannot write into it.
    with pytest.raises(ValidationError):
        platform.write(tenant_id=f"eval-{h}", user_id="mallory", text="planted")


def test_no_customer_tenant_is_skipped_by_any_sensor_or_schedule(store, derived, session_settings):
    """Customer tenants whose ids look internal get their partition, forget runs, erasure runs, nightly
    backups and retention runs like any other; a tenant the platform owns gets none of them."""
    h = uuid.uuid4().hex[:8]
    customers = look_alikes(h)
    internal = f"canary-{h}"
    service = DeletionService(derived)
    completed, requested = [], []
    for tenant in customers:
        first = store.write(tenant_id=tenant, user_id="ann", text=f"Ann keeps bees {h}")
        store.write(tenant_id=tenant, user_id="bob", text=f"Bob rows boats {h}")
        job = service.request(tenant_id=tenant, memory_id=first.memory_id)
        service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
        completed.append(job["job_id"])
        requested.append(service.request(tenant_id=tenant, subject="bob")["job_id"])
    with validation.platform_owned():
        store.write(tenant_id=internal, user_id="ann", text="internal")
    service.request(tenant_id=internal, subject="ann")
    everyone = [*customers, internal]
    with store.transaction() as conn:
        # Past the forget sensor's 30 s settle and the erasure's 60 min batch window.
        conn.execute(
            "UPDATE control.deletion_jobs SET updated_at = now() - interval '5 minutes'"
            " WHERE tenant_id = ANY(%s) AND state = 'REQUESTED'",
            (everyone,),
        )
        conn.execute(
            "UPDATE control.deletion_jobs SET completed_at = now() - interval '2 hours' WHERE job_id = ANY(%s)",
            (completed,),
        )
    resource = MemoryStoreResource(home=str(session_settings.home))
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(instance=instance, resources={"memory_store": resource})
        partitions = tenant_partitions_sensor(context)
        assert isinstance(partitions, dg.SensorResult)
        added = {
            key
            for request in partitions.dynamic_partitions_requests or []
            if isinstance(request, dg.AddDynamicPartitionsRequest)
            for key in request.partition_keys
        }
        assert set(customers) <= added and internal not in added
        instance.add_dynamic_partitions("tenants", sorted(added))

        def targets(result: dg.SensorResult | list[dg.RunRequest]) -> set[str]:
            requests = result.run_requests if isinstance(result, dg.SensorResult) else result
            return {str(r.partition_key) for r in requests or [] if r.partition_key in everyone}

        forget = forget_requests_sensor(
            dg.build_sensor_context(instance=instance, resources={"memory_store": resource})
        )
        erase = physical_erasure_sensor(
            dg.build_sensor_context(instance=instance, resources={"memory_store": resource})
        )
        at = datetime.now(UTC).replace(hour=2, minute=0, second=0, microsecond=0) + timedelta(days=1)
        with dg.build_schedule_context(
            instance=instance, resources={"memory_store": resource}, scheduled_execution_time=at
        ) as context:
            backups = nightly_backups(context)
        with dg.build_schedule_context(instance=instance, scheduled_execution_time=at) as context:
            retention = retention_schedule(context)
        assert isinstance(forget, dg.SensorResult) and isinstance(erase, dg.SensorResult)
        assert isinstance(backups, list) and isinstance(retention, list)
        for name, result in (("forget", forget), ("erasure", erase), ("backups", backups), ("retention", retention)):
            assert targets(result) == set(customers), name
