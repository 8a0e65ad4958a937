"""When the forget sensor runs a tenant's jobs (lib/forget/planning.py): pure planning over ledger rows,
no database."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from memory_pipelines.lib.forget.planning import (
    REQUEST_SETTLE,
    STALL_GRACE,
    LastRun,
    backoff,
    plan_forget_runs,
    relaunch_grace,
)


def job(
    job_id: str, tenant: str, state: str, seq: int | None, updated_at: datetime, **more: object
) -> dict[str, object]:
    return {
        "job_id": job_id,
        "tenant_id": tenant,
        "state": state,
        "seq": seq,
        "next_attempt_at": None,
        "updated_at": updated_at,
        **more,
    }


def test_planner_waits_for_runs_in_progress_and_after_a_failure():
    now = datetime(2026, 6, 1, tzinfo=UTC)
    rows = [
        {
            "job_id": "del_a",
            "tenant_id": "t1",
            "state": "REQUESTED",
            "seq": 5,
            "next_attempt_at": None,
            "updated_at": now - timedelta(minutes=1),
        },
        {
            "job_id": "del_b",
            "tenant_id": "t2",
            "state": "REQUESTED",
            "seq": 3,
            "next_attempt_at": None,
            "updated_at": now,
        },
        {
            "job_id": "del_c",
            "tenant_id": "t3",
            "state": "DELETING",
            "seq": 2,
            "next_attempt_at": None,
            "updated_at": now - timedelta(minutes=10),
        },
    ]
    active = {"t2": LastRun("r2", "active", None), "t3": LastRun("r3", "failed", now - timedelta(seconds=10))}
    planned, cursor = plan_forget_runs(rows, cursor=4, last_runs=active, now=now)
    assert [(p.tenant_id, p.run_key) for p in planned] == [("t1", "forget:t1:5")] and cursor == 5
    # A request seconds old waits (its requester may run it itself) and holds the cursor below it.
    young = {**rows[0], "updated_at": now - timedelta(seconds=5)}
    assert plan_forget_runs([young], cursor=4, last_runs={}, now=now) == ([], 4)
    # A job a run not yet ended names (`forget --wait`'s) is that run's: never launched, cursor past it.
    assert plan_forget_runs(rows[:1], cursor=4, last_runs={}, now=now, claimed={"del_a"}) == ([], 5)
    relaunchable = {**rows[0], "seq": 3}
    assert plan_forget_runs([relaunchable], cursor=4, last_runs={}, now=now, claimed={"del_a"}) == ([], 4)
    ended = {"t2": LastRun("r2", "failed", now - timedelta(minutes=2)), "t3": LastRun("r3", "failed", None)}
    planned, _ = plan_forget_runs(rows, cursor=5, last_runs=ended, now=now)
    assert {p.run_key for p in planned} == {"forget:t2:3:after:r2", "forget:t3:2:after:r3", "forget:t1:5:after:none"}
    assert [backoff(n) for n in (1, 2, 3, 7, 40)] == [
        timedelta(minutes=1),
        timedelta(minutes=2),
        timedelta(minutes=4),
        timedelta(hours=1),
        timedelta(hours=1),
    ]


def test_consecutive_failed_runs_back_off_and_verification_blocks_wait_for_a_person():
    now = datetime(2026, 6, 1, tzinfo=UTC)
    row = {"job_id": "del_a", "tenant_id": "t1", "state": "REQUESTED", "seq": 5, "next_attempt_at": None}
    row["updated_at"] = now
    third = LastRun("r3", "failed", now - timedelta(minutes=3), failures=3)
    assert relaunch_grace(third) == timedelta(minutes=4)
    assert plan_forget_runs([row], cursor=5, last_runs={"t1": third}, now=now)[0] == []
    later = LastRun("r3", "failed", now - timedelta(minutes=5), failures=3)
    assert [p.run_key for p in plan_forget_runs([row], cursor=5, last_runs={"t1": later}, now=now)[0]] == [
        "forget:t1:5:after:r3"
    ]
    assert relaunch_grace(LastRun("r", "failed", None, failures=30)) == timedelta(hours=1)
    blocked = {**row, "state": "BLOCKED", "next_attempt_at": now - timedelta(minutes=1)}
    assert [p.reason for p in plan_forget_runs([blocked], cursor=5, last_runs={}, now=now)[0]] == ["retry"]
    found_data = {**blocked, "verification_failed": True}
    assert plan_forget_runs([found_data], cursor=5, last_runs={}, now=now)[0] == []


def test_new_requests_of_one_tenant_ride_in_one_run_keyed_by_their_highest_seq():
    now = datetime(2026, 6, 1, tzinfo=UTC)
    old = now - REQUEST_SETTLE
    rows = [job("del_a", "t1", "REQUESTED", 7, old), job("del_b", "t1", "REQUESTED", 9, old)]
    blocked = job("del_c", "t1", "BLOCKED", 4, old - timedelta(hours=1), next_attempt_at=now, attempts=2)
    planned, cursor = plan_forget_runs([*rows, blocked], cursor=6, last_runs={}, now=now)
    # A due retry of the same tenant rides along with the fresh run rather than getting one of its own.
    assert [(p.tenant_id, p.job_ids, p.run_key, p.reason) for p in planned] == [
        ("t1", ["del_a", "del_b", "del_c"], "forget:t1:9", "requested")
    ]
    assert cursor == 9
    # The cursor never goes back, and requests at or below it are not new.
    assert plan_forget_runs(rows, cursor=12, last_runs={"t1": LastRun("r", "active", None)}, now=now) == ([], 12)


def test_a_job_in_flight_is_relaunched_only_once_its_stall_grace_passed():
    now = datetime(2026, 6, 1, tzinfo=UTC)
    fresh = job("del_a", "t1", "VERIFYING", 3, now - STALL_GRACE + timedelta(seconds=1))
    assert plan_forget_runs([fresh], cursor=3, last_runs={}, now=now) == ([], 3)
    stalled = {**fresh, "updated_at": now - STALL_GRACE}
    [run] = plan_forget_runs([stalled], cursor=3, last_runs={}, now=now)[0]
    assert (run.reason, run.run_key) == ("relaunch", "forget:t1:3:after:none")
    # A BLOCKED job whose backoff has not ended waits, with or without a last run.
    waiting = job("del_b", "t2", "BLOCKED", 2, now, next_attempt_at=now + timedelta(seconds=1))
    assert plan_forget_runs([waiting], cursor=3, last_runs={}, now=now) == ([], 3)
    assert relaunch_grace(LastRun("r", "failed", now, failures=0)) == timedelta(minutes=1)
    assert backoff(0) == backoff(1) == timedelta(minutes=1)
