"""Bulk writes (issue 21, item 4): linear in the batch, and a deletion of the same tenant is accepted
between two chunks instead of after the whole write.

Each concurrency test runs the bulk write in another interpreter on the session's HOME, as an agent
runtime would, and requests the deletion from this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.infra.errors import PartialWriteError, PermissionDeniedError, ValidationError
from memory_pipelines.lib.infra.settings import ENV_DAGSTER_PG_URL

pytestmark = pytest.mark.slow

BIG = 12_000  # chunks of 250: about 1.5 s here, and about 10 s as one transaction (quadratic)

_WRITER = """
import json, sys, time
from memory_pipelines.lib.infra.errors import PartialWriteError
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.infra.settings import Settings
tenant, n, hal_every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
store = open_store(Settings.from_env())
items = [
    {"user_id": "hal" if hal_every and i % hal_every == 0 else f"w{i % 20:02d}", "text": f"bulk note {i} of {tenant}"}
    for i in range(n)
]
print(json.dumps({"started": time.time()}), flush=True)
try:
    written = [r.as_dict() for r in store.write_many(tenant_id=tenant, items=items)]
    out = {"written": len(written), "error": None}
except PartialWriteError as exc:
    out = {"written": len(exc.written), "error": exc.field, "exit_code": exc.exit_code,
           "last": exc.written[-1], "message": exc.message}
out["finished"] = time.time()
store.close()
print(json.dumps(out), flush=True)
"""


def _start_writer(home: Path, tenant: str, n: int, hal_every: int = 0) -> subprocess.Popen[str]:
    env = {**os.environ, "MEMORY_PIPELINES_HOME": str(home)}
    env.pop(ENV_DAGSTER_PG_URL, None)
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, tenant, str(n), str(hal_every)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _count(store: Any, tenant: str, user: str | None = None) -> int:
    with store.transaction() as conn:
        row = conn.execute(
            "SELECT count(*) FROM memory.memories WHERE tenant_id = %s AND (%s::text IS NULL OR user_id = %s)",
            (tenant, user, user),
        ).fetchone()
    return int(row[0])


def _await_rows(store: Any, tenant: str, writer: subprocess.Popen[str], at_least: int) -> None:
    """Until the writer's first chunks are committed (or it is done, as one transaction would be)."""
    deadline = time.monotonic() + 120
    while _count(store, tenant) < at_least and writer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)


def _finish(writer: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = writer.communicate(timeout=300)
    assert writer.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_a_deletion_of_the_tenant_is_accepted_while_a_bulk_write_runs(session_settings, store, derived, tenant):
    """hal's old memories are hidden in the middle of another writer's 12,000-item write_many; on
    970c91a the acceptance waited for the whole write (its one transaction held the gate)."""
    store.write_many(tenant_id=tenant, items=[{"user_id": "hal", "text": f"hal {i}"} for i in range(5)])
    assert len(store.list_visible(tenant_id=tenant, user_id="hal")) == 5
    writer = _start_writer(session_settings.home, tenant, BIG)
    _await_rows(store, tenant, writer, at_least=5 + 500)
    job = DeletionService(derived).request(tenant_id=tenant, subject="hal")
    accepted = time.time()
    landed_at_acceptance = _count(store, tenant) - 5
    assert store.list_visible(tenant_id=tenant, user_id="hal") == []  # hidden at once
    result = _finish(writer)
    assert result["error"] is None and result["written"] == BIG
    assert accepted < result["finished"], "the deletion was accepted only after the bulk write had finished"
    assert 0 < landed_at_acceptance < BIG
    DeletionService(derived).run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert _count(store, tenant, "hal") == 0 and _count(store, tenant) == BIG


def test_a_subject_forgotten_mid_write_stops_it_and_nothing_of_theirs_lands_after(
    session_settings, store, derived, tenant
):
    """hal authors every tenth item; forgetting hal part way stops the write with what was written,
    and once the job is COMPLETE no memory of hal exists. Writing the rest again is safe."""
    writer = _start_writer(session_settings.home, tenant, BIG, hal_every=10)
    _await_rows(store, tenant, writer, at_least=500)
    job = DeletionService(derived).request(tenant_id=tenant, subject="hal")
    result = _finish(writer)
    assert result["error"] == "user" and result["exit_code"] == 5, result
    assert "being forgotten" in result["message"] and f"of {BIG} items were written" in result["message"]
    assert 0 < result["written"] < BIG
    assert _count(store, tenant) == result["written"]  # exactly what the error says landed
    DeletionService(derived).run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert _count(store, tenant, "hal") == 0

    # The caller writes the others' items again: what landed comes back unchanged, the rest is new.
    again = [{"user_id": f"w{i % 20:02d}", "text": f"bulk note {i} of {tenant}"} for i in range(BIG) if i % 10]
    results = store.write_many(tenant_id=tenant, items=again)
    kept = sum(1 for r in results if not r.changed)
    assert kept == result["written"] - len([i for i in range(result["written"]) if i % 10 == 0])
    assert _count(store, tenant) == len(again)


def test_a_bulk_write_never_walks_the_tenant_per_row(store, tenant):
    """8,000 new memories: the foreign-key checks probe the heads by primary key. On 970c91a, with
    statistics of an empty partition, each row's check walked the tenant through `memories_by_owner`
    (about 30 million index tuples read for 8,000 rows; the write took 5 s instead of 1)."""
    n = 8_000

    def owner_index_reads() -> int:
        with store.transaction() as conn:
            conn.execute("SELECT pg_stat_force_next_flush()")
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'memories_by_owner'"
            ).fetchone()
        return int(row[0])

    def settled() -> int:
        # Other backends (the store's pool) flush their counters when idle, within a second or so.
        last, deadline = -1, time.monotonic() + 15
        while time.monotonic() < deadline:
            time.sleep(1.2)
            now = owner_index_reads()
            if now == last:
                return now
            last = now
        return last

    start = settled()
    results = store.write_many(
        tenant_id=tenant, items=[{"user_id": f"u{i % 50}", "text": f"row {i} of {tenant}"} for i in range(n)]
    )
    read = settled() - start
    assert len(results) == n and all(r.changed for r in results)
    assert read < n, f"{read:,} index tuples of memories_by_owner read for {n:,} rows"


def test_every_item_is_checked_before_anything_is_written(store, tenant):
    """A bad item at the end refuses the whole batch, whatever its size: nothing lands."""
    items: list[dict[str, Any]] = [{"user_id": "ann", "text": f"fine {i}"} for i in range(1_000)]
    items.append({"user_id": "ann", "text": "bad", "shareable": "no"})
    with pytest.raises(ValidationError) as refused:
        store.write_many(tenant_id=tenant, items=items)
    assert refused.value.field == "items[1000].shareable"
    assert _count(store, tenant) == 0
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="bob")
    with pytest.raises(PermissionDeniedError) as not_member:
        store.write_many(tenant_id=tenant, items=[*items[:600], {"user_id": "ann", "text": "t", "team_id": "core"}])
    assert not_member.value.field == "team" and "not a member" in not_member.value.message
    assert _count(store, tenant) == 0


def test_partial_write_error_names_the_cause_and_what_landed():
    from memory_pipelines.lib.infra.errors import ConflictError

    cause = ConflictError("user", "subject 'hal' is being forgotten")
    error = PartialWriteError(cause, written=[{"memory_id": "m_1"}], total=3)
    assert error.field == "user" and error.exit_code == 5 and error.written == [{"memory_id": "m_1"}]
    assert str(error).startswith("user: subject 'hal' is being forgotten (the first 1 of 3 items")
