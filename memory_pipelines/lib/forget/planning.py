"""When the forget sensor runs a tenant's deletion jobs: new requests once settled, BLOCKED jobs after
their backoff, jobs a dead run left in flight; each failed run relaunched once, with a growing grace.

Pure planning over the rows of `DeletionLedger.ledger` and the tenant's last forget run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

__all__ = [
    "MAX_BACKOFF",
    "MAX_RELAUNCH_GRACE",
    "RELAUNCH_GRACE",
    "REQUEST_SETTLE",
    "STALL_GRACE",
    "LastRun",
    "PlannedRun",
    "backoff",
    "plan_forget_runs",
    "relaunch_grace",
]

MAX_BACKOFF = timedelta(hours=1)


def backoff(attempts: int) -> timedelta:
    """How long a BLOCKED job waits before its next attempt: 1 minute, doubling, at most 1 hour
    (the same rule as the ledger trigger of migration 0009)."""
    doublings: int = 2 ** min(max(attempts, 1) - 1, 12)  # typed: `int ** int` is Any to mypy
    return min(MAX_BACKOFF, timedelta(minutes=1) * doublings)


# A non-fresh forget run (relaunch, retry) waits this long after the tenant's last run ended, so a
# run that fails before reaching the jobs is not relaunched in a tight loop.
RELAUNCH_GRACE = timedelta(minutes=1)
MAX_RELAUNCH_GRACE = timedelta(hours=1)
# A job left FROZEN, DELETING or VERIFYING this long with no run in progress was orphaned by a run
# that died; a relaunch resumes it (the tenant run lock makes a needless one a no-op).
STALL_GRACE = timedelta(minutes=5)
# How long a new request waits before the sensor runs it: `forget --wait` requests, then submits its
# own run (a code server starts first, a few seconds); the sensor leaves the job to that run.
REQUEST_SETTLE = timedelta(seconds=30)
_IN_FLIGHT = ("FROZEN", "DELETING", "VERIFYING")


@dataclass(frozen=True)
class PlannedRun:
    """One forget run the sensor should request: a tenant, its job ids and a run key."""

    tenant_id: str
    job_ids: list[str]
    run_key: str
    reason: str


@dataclass(frozen=True)
class LastRun:
    """The tenant's latest forget run as the sensor sees it: `active`, `failed` or `succeeded`."""

    run_id: str
    status: str
    ended_at: datetime | None
    failures: int = 0  # consecutive failed forget runs of the tenant, this one included


def relaunch_grace(last: LastRun) -> timedelta:
    """How long after a tenant's last forget run ended before its jobs are run again: a minute, doubling
    per consecutive failed run up to an hour, so a run that fails before it records anything (a worker
    that never starts, the database away) is not relaunched every minute forever."""
    doublings: int = 2 ** max(last.failures - 1, 0)
    return min(RELAUNCH_GRACE * doublings, MAX_RELAUNCH_GRACE)


def plan_forget_runs(
    rows: list[dict[str, Any]],
    *,
    cursor: int,
    last_runs: dict[str, LastRun],
    now: datetime,
    claimed: frozenset[str] | set[str] = frozenset(),
    settle: timedelta = REQUEST_SETTLE,
) -> tuple[list[PlannedRun], int]:
    """Which forget runs to request from the open jobs of `DeletionLedger.ledger`, and the new cursor.

    New requests (REQUESTED, seq > cursor) get one run per tenant, keyed by their highest seq, once
    they are `settle` old; they queue behind a run in progress. A job a forget run not yet ended
    names (`claimed`: e.g. the run of `forget --wait`) is that run's, never launched again. With no
    run of the tenant in progress, a BLOCKED job whose backoff ended, and a job still REQUESTED (or
    left in flight) after the tenant's last run ended, get a run keyed by the last run's id as well,
    so each failed run is relaunched once. The cursor stays below a request that has not settled.
    """
    fresh: dict[str, list[dict[str, Any]]] = {}
    again: dict[str, list[dict[str, Any]]] = {}
    unsettled: list[int] = []
    for row in rows:
        tenant, seq, state = row["tenant_id"], row["seq"], row["state"]
        if row["job_id"] in claimed:
            continue
        if state == "REQUESTED" and seq is not None and seq > cursor:
            if now - row["updated_at"] < settle:
                unsettled.append(seq)  # its requester may be submitting its own run right now
            else:
                fresh.setdefault(tenant, []).append(row)
            continue
        last = last_runs.get(tenant)
        waiting = last is not None and (
            last.status == "active" or (last.ended_at is not None and now - last.ended_at < relaunch_grace(last))
        )
        if waiting:
            continue
        # A job blocked by its verification found forgotten data: a person looks first (`deletion retry`),
        # since a retry after the primary rows are gone has no text left to build paraphrase probes from.
        due = (
            (
                state == "BLOCKED"
                and not row.get("verification_failed")
                and (row["next_attempt_at"] is None or row["next_attempt_at"] <= now)
            )
            or state == "REQUESTED"
            or (state in _IN_FLIGHT and now - row["updated_at"] >= STALL_GRACE)
        )
        if due:
            again.setdefault(tenant, []).append(row)
    planned = [
        PlannedRun(
            t,
            [r["job_id"] for r in jobs + again.pop(t, [])],  # due retries of the tenant ride along
            f"forget:{t}:{max(r['seq'] for r in jobs)}",
            "requested",
        )
        for t, jobs in sorted(fresh.items())
    ]
    for tenant, jobs in sorted(again.items()):
        last = last_runs.get(tenant)
        top = max((r["seq"] or 0) for r in jobs)
        planned.append(
            PlannedRun(
                tenant,
                [r["job_id"] for r in jobs],
                f"forget:{tenant}:{top}:after:{last.run_id if last else 'none'}",
                "retry" if all(r["state"] == "BLOCKED" for r in jobs) else "relaunch",
            )
        )
    requested = [r["seq"] for r in rows if r["seq"] is not None and r["state"] == "REQUESTED"]
    # Requests launched now that sit above a held-back one come again next tick as claimed (their run
    # exists by then), so holding the cursor never launches them twice.
    new_cursor = min(unsettled) - 1 if unsettled else max([cursor, *requested])
    return planned, max(cursor, new_cursor)
