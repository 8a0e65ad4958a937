"""The suite's check for Dagster instances a test enters and never leaves (tests/support/instances.py):
such an instance puts back an older defs-state storage whenever the garbage collector frees it, in
whatever test runs then."""

from __future__ import annotations

from datetime import UTC, datetime

import dagster as dg
from dagster._core.storage.defs_state.base import DefsStateStorage

from memory_pipelines.defs.retention.schedules import retention_schedule
from tests.support import instances

AT = datetime(2026, 6, 16, 2, tzinfo=UTC)


def test_a_schedule_context_used_without_with_leaves_its_instance_entered():
    with instances.entered() as open_now, dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", ["t-1"])
        before = DefsStateStorage.get()
        requests = retention_schedule(dg.build_schedule_context(instance=instance, scheduled_execution_time=AT))
        assert [r.partition_key for r in requests] == ["t-1"]
        # The context reopened the instance from its ref: a second instance, its storage now current.
        assert len(open_now) == 2 and open_now[1][0] is not instance
        assert DefsStateStorage.get() is not before
        left = instances.leave(open_now)
        assert len(left) == 2 and "test_instances_left.py:" in left[0], left
        assert DefsStateStorage.get() is None  # as before the first entry


def test_a_schedule_context_used_with_with_leaves_nothing_entered():
    with instances.entered() as open_now:
        with dg.instance_for_test() as instance:
            instance.add_dynamic_partitions("tenants", ["t-1"])
            with dg.build_schedule_context(instance=instance, scheduled_execution_time=AT) as context:
                assert [r.partition_key for r in retention_schedule(context)] == ["t-1"]
            assert len(open_now) == 1 and open_now[0][0] is instance
        assert open_now == []
    assert instances.leave([]) == []


def test_an_instance_entered_twice_is_named_twice_and_left():
    with instances.entered() as open_now:
        outer = dg.instance_for_test()
        instance = outer.__enter__()
        instance.__enter__()  # entered again, as code holding it might
        assert [i for i, _ in open_now] == [instance, instance]
        left = instances.leave(open_now)
        assert len(left) == 2 and open_now == []
        outer.__exit__(None, None, None)
    assert DefsStateStorage.get() is None
