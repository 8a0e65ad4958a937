"""The real deployment path, end to end: `dagster-daemon` and `dagster-webserver` as separate
processes on the embedded services (PostgreSQL and the `chroma run` server), driven only through
the CLI. No `execute_in_process` anywhere: every run is launched by the daemon (sensors, eager
automation, the run queue) or submitted by the CLI through the instance.

What it checks, from the CLI and the webserver's GraphQL:
- a CLI write leads to eager refresh runs of the tenant's derived stores;
- a forget request leads to a sensor-launched `forget` run that completes the deletion job;
- `forget --wait` runs the deletion in its own run, never a second time from the sensor;
- a backup, then a restore request, leads to a `restore` run and an asset backfill of the tenant;
- from the runs' timestamps, no two runs of one tenant ever overlapped (the per-tenant queue limit).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from memory_pipelines.lib.infra import services
from memory_pipelines.lib.infra.paths import PROJECT_ROOT
from tests.conftest import CLI, run_cli, settings_for
from tests.integration.test_dagster_dev import free_port, graphql

pytestmark = pytest.mark.slow

TENANT = "e2e-acme"
DERIVED = {"memory_embeddings", "keyword_index", "subject_summaries", "team_summaries", "analytics_memories"}
RUNS = """{ runsOrError { ... on Runs { results {
  runId jobName status startTime endTime tags { key value } } } } }"""
BACKFILLS = """{ partitionBackfillsOrError { ... on PartitionBackfills { results {
  id status isAssetBackfill partitionNames assetSelection { path } } } } }"""
LATEST_DELETIONS = """{ assetOrError(assetKey: {path: ["memory_deletions"]}) { ... on Asset {
  assetMaterializations(partitions: ["%s"], limit: 1) { runId } } } }"""
PARTITIONS = """{ assetNodes { assetKey { path }
  assetPartitionStatuses { ... on DefaultPartitionStatuses { materializedPartitions failedPartitions } } } }"""


def _stop(proc: subprocess.Popen) -> None:
    children = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
    for child in children:
        if child.is_running():
            child.kill()


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Embedded services, then the daemon and the webserver as their own processes."""
    home = tmp_path / "home"
    settings = settings_for(home)
    services.ensure_services(settings)  # PostgreSQL, Chroma, dagster.yaml; exports the instance URL
    env = {
        **os.environ,
        "MEMORY_PIPELINES_HOME": str(home),
        "DAGSTER_HOME": str(settings.dagster_home),
    }
    port = free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = []
    try:
        for name, command in (
            ("daemon", ["dagster-daemon", "run", "-w", "workspace.yaml"]),
            ("webserver", ["dagster-webserver", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)]),
        ):
            exe = str(Path(CLI).parent / command[0])
            with open(logs / f"{name}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [exe, *command[1:]],
                        cwd=PROJECT_ROOT,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        yield {"home": home, "port": port, "env": env, "logs": logs}
    finally:
        for proc in procs:
            _stop(proc)
        services.stop_services(settings)


_RUNNING = {"QUEUED", "NOT_STARTED", "STARTING", "STARTED", "CANCELING"}


def wait_for(what: str, probe: Callable[[], Any], timeout: float, logs: Path) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except OSError:
            last = None
        if last:
            return last
        time.sleep(3)
    tail = (logs / "daemon.log").read_text(errors="replace")[-4000:]
    raise AssertionError(f"timed out waiting for {what}; last={last!r}\n--- daemon log tail ---\n{tail}")


def cli(deployment: dict[str, Any], *args: str, timeout: float = 600) -> dict[str, Any]:
    result = run_cli(*args, home=deployment["home"], env=deployment["env"], timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def runs(port: int) -> list[dict[str, Any]]:
    results = graphql(port, RUNS)["data"]["runsOrError"]["results"]
    for run in results:
        run["tags"] = {t["key"]: t["value"] for t in run["tags"]}
    return results


def test_daemon_runs_the_lifecycle_without_overlap(deployment):
    port, logs = deployment["port"], deployment["logs"]
    wait_for("the webserver", lambda: graphql(port, "{ version }")["data"]["version"], 120, logs)

    cli(deployment, "write", "--tenant", TENANT, "--user", "alice", "alice prefers green tea")
    cli(deployment, "write", "--tenant", TENANT, "--user", "bob", "bob is allergic to penicillin")

    def derived_materialized() -> bool:
        nodes = graphql(port, PARTITIONS)["data"]["assetNodes"]
        done = {
            "/".join(n["assetKey"]["path"])
            for n in nodes
            if n["assetPartitionStatuses"] and TENANT in n["assetPartitionStatuses"]["materializedPartitions"]
        }
        return DERIVED <= done

    wait_for("eager refresh of every derived store", derived_materialized, 300, logs)
    refresh = wait_for(
        "the refresh run to end",
        lambda: [r for r in runs(port) if r["tags"].get("dagster/partition") == TENANT and r["status"] == "SUCCESS"],
        120,
        logs,
    )
    assert refresh and all(
        "dagster/from_automation_condition" in r["tags"] or "dagster/sensor_name" in r["tags"] for r in refresh
    ), [r["tags"] for r in refresh]

    # A forget request without --wait: the sensor launches the run.
    request = cli(deployment, "forget", "--tenant", TENANT, "--subject", "bob", "--basis", "gdpr-art17")
    job_id = request["job_id"]

    def forgotten() -> bool:
        return cli(deployment, "deletion", "status", job_id)["state"] == "COMPLETE"

    wait_for("the sensor-launched forget run", forgotten, 300, logs)

    def forget_runs_ended() -> list[dict[str, Any]]:
        # The job is COMPLETE once `prove` commits; the run ends after its metadata and check.
        found = [r for r in runs(port) if r["jobName"] == "forget"]
        return found if found and found[0]["status"] not in _RUNNING else []

    forget_runs = wait_for("the forget run to end", forget_runs_ended, 120, logs)
    assert forget_runs and forget_runs[0]["status"] == "SUCCESS"
    assert forget_runs[0]["tags"].get("dagster/sensor_name") == "forget_requests_sensor"
    assert forget_runs[0]["tags"].get("dagster/partition") == TENANT

    # `forget --wait` with the daemon running: the CLI's own run completes the job, and the sensor never
    # launches another for it (it leaves a new request to its requester for a while, and then sees
    # the CLI's run naming the job); the latest `memory_deletions` materialization is that forget's.
    waited = []
    for subject in ("carol", "dave"):
        cli(deployment, "write", "--tenant", TENANT, "--user", subject, f"{subject} keeps bees on the roof")
        requested = time.monotonic()
        waited.append(cli(deployment, "forget", "--tenant", TENANT, "--subject", subject, "--wait"))
        assert waited[-1]["state"] == "COMPLETE", waited[-1]
    # Past the sensor's settle time (30 s) for both requests, then two of its ticks (15 s) at least.
    time.sleep(max(0.0, requested + 65 - time.monotonic()))
    for done in waited:
        named = [r for r in runs(port) if r["jobName"] == "forget" and done["job_id"] in json.dumps(r["tags"])]
        assert named == [], [(r["runId"], r["tags"]) for r in named]  # the sensor tags the ids it launches
        ours = [r for r in runs(port) if r["runId"] == done["run_id"]]
        assert ours and ours[0]["status"] == "SUCCESS" and "dagster/sensor_name" not in ours[0]["tags"]
    latest = graphql(port, LATEST_DELETIONS % TENANT)["data"]["assetOrError"]["assetMaterializations"]
    assert latest and latest[0]["runId"] == waited[-1]["run_id"], latest
    unplanned = [r for r in runs(port) if r["jobName"] == "forget"]
    assert len(unplanned) == 3, [(r["runId"], r["tags"]) for r in unplanned]  # the sensor's one, the CLI's two

    backup = cli(deployment, "backup", "--tenant", TENANT)
    restore = cli(deployment, "restore", "--tenant", TENANT, "--backup", backup["backup_id"])
    assert restore["state"] == "REQUESTED"

    def restored_and_backfilled() -> list[dict[str, Any]]:
        backfills = graphql(port, BACKFILLS)["data"]["partitionBackfillsOrError"]["results"]
        return [b for b in backfills if b["isAssetBackfill"] and b["status"] in ("COMPLETED", "COMPLETED_SUCCESS")]

    backfills = wait_for("the restore run and its backfill", restored_and_backfilled, 420, logs)
    assert backfills[0]["partitionNames"] == [TENANT]
    selected = {"/".join(a["path"]) for a in backfills[0]["assetSelection"]}
    assert {"memories"} | DERIVED <= selected
    all_runs = runs(port)
    assert any(r["jobName"] == "restore" and r["status"] == "SUCCESS" for r in all_runs)
    assert any(r["jobName"] == "backup" and r["status"] == "SUCCESS" for r in all_runs)

    # bob stays forgotten after the restore; alice is back.
    bob = run_cli("recall", "--tenant", TENANT, "--user", "bob", "penicillin", home=deployment["home"])
    assert "penicillin" not in bob.stdout and bob.returncode in (0, 3), bob.stderr
    hits = cli(deployment, "recall", "--tenant", TENANT, "--user", "alice", "green tea")
    assert hits and "green tea" in json.dumps(hits)

    # One run of a tenant at a time: sorted by start, each starts after the previous one ended.
    ours = sorted(
        (r for r in all_runs if r["tags"].get("dagster/partition") == TENANT and r["startTime"]),
        key=lambda r: r["startTime"],
    )
    assert len(ours) >= 5, [(r["jobName"], r["status"]) for r in ours]
    for before, after in itertools.pairwise(ours):
        assert before["endTime"] is not None and after["startTime"] >= before["endTime"], (before, after)
