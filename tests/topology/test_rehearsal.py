"""The production topology rehearsed on this machine (issue 35): every process on a host of its own,
sharing only the services and the key vault (tests/support/topology.py says how).

One lifecycle, in order, each step on a new host unless said: an application using `MemoryPlatform`
and the CLI write at once from two hosts; `tenant_refresh` runs (its run on a host of its own);
recall on the application's host; an analytics query from a host that never ran anything (with the
copy in a run's HOME, as on e54b03f, it would answer "not materialized"); a backup to S3; a SUBJECT
forget the daemon's sensor runs and a MEMORY forget with --wait; the canary drill and a retention
sweep while the daemon's erasure sensor waits out the batch window; the erasure's certificate says
what this deployment proves (keys destroyed, rows absent, nothing of the servers' files); a restore
of the backup taken before the forgets, with its backfill, brings back nothing forgotten. Then, from
the webserver: every run ran on a host of its own, and no host left a file outside its namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from memory_pipelines.lib.forget import deployment
from tests.integration.test_dagster_dev import graphql
from tests.support.servers import free_port
from tests.support.topology import HOST_TAG, Topology, topology
from tests.test_deploy import VALUES

pytestmark = [
    pytest.mark.topology,
    pytest.mark.slow,
    # Its waits add up past the suite's 600 s per test when the machine is busy.
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.geteuid() != 0, reason="each host is a mount namespace: `unshare --mount` needs root"),
]

TENANT = "acme"
RUNS = """{ runsOrError { ... on Runs { results { runId jobName status tags { key value } } } } }"""
BACKFILLS = """{ partitionBackfillsOrError { ... on PartitionBackfills { results {
  id status isAssetBackfill partitionNames } } } }"""
# The application's writes: alice's own, one to her team, and bob's through the CLI meanwhile.
APPLICATION = """
import json
from memory_pipelines.platform import MemoryPlatform
with MemoryPlatform.from_env() as mp:
    mp.create_tenant(tenant_id="acme")
    mp.add_team_member(tenant_id="acme", team_id="crew", user_id="alice")
    out = [mp.write(tenant_id="acme", user_id="alice", text=t)["memory_id"]
           for t in ("Alice keeps bees on her roof", "Alice's cardiologist is Dr. Quince")]
    out.append(mp.write(tenant_id="acme", user_id="alice", team_id="crew",
                        text="The crew ships on Thursdays")["memory_id"])
    print(json.dumps(out))
"""
RECALL = """
import json
from memory_pipelines.platform import MemoryPlatform
with MemoryPlatform.from_env() as mp:
    print(json.dumps(mp.recall(tenant_id="acme", user_id="alice", query="bees on the roof", k=3)))
"""


def ok(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-4000:]}"
    return json.loads(result.stdout)


def wait_for(what: str, probe: Callable[[], Any], timeout: float, topo: Topology) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(3)
    log = topo.root / "logs" / "daemon.log"
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}; last={last!r}\n--- daemon log ---\n{tail}")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Topology, int]]:
    """The services, then the code server, the daemon and the webserver, each on a host of its own,
    as the Helm values deploy them (the code server's arguments are the chart's)."""
    with topology(tmp_path_factory.mktemp("topology")) as topo:
        topo.env["MEMORY_PIPELINES_ERASURE_BATCH_MINUTES"] = "1"
        values = yaml.safe_load(VALUES.read_text())
        grpc_args = values["dagster-user-deployments"]["deployments"][0]["dagsterApiGrpcArgs"]
        code_port, web_port = free_port(), free_port()
        workspace = {
            "load_from": [
                {"grpc_server": {"host": "127.0.0.1", "port": code_port, "location_name": "memory_pipelines"}}
            ]
        }
        (topo.root / "config" / "workspace.yaml").write_text(yaml.safe_dump(workspace))
        ws = str(topo.root / "config" / "workspace.yaml")
        topo.start("code", ["dagster", "api", "grpc", *grpc_args, "-h", "127.0.0.1", "-p", str(code_port)])
        # The code server imports the definitions before the others ask for them.
        dagster = str(Path(sys.executable).parent / "dagster")
        health = [dagster, "api", "grpc-health-check", "-h", "127.0.0.1", "-p", str(code_port)]
        wait_for(
            "the code server",
            lambda: subprocess.run(health, capture_output=True, check=False).returncode == 0,
            120,
            topo,
        )
        topo.start("daemon", ["dagster-daemon", "run", "-w", ws])
        topo.start("webserver", ["dagster-webserver", "-w", ws, "-h", "127.0.0.1", "-p", str(web_port)])
        wait_for("the webserver", lambda: _answers(web_port), 120, topo)
        yield topo, web_port


def _answers(port: int) -> bool:
    try:
        return "data" in graphql(port, "{ version }")
    except OSError:
        return False


def test_the_lifecycle_with_every_process_on_a_host_of_its_own(deployed):
    topo, web_port = deployed
    # Two hosts write at once: an application (MemoryPlatform) and the CLI.
    command, env = topo.command("app-a", [sys.executable, "-c", APPLICATION])
    app = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(3)  # the tenant exists before bob writes to it
    bob = [
        ok(topo.cli("app-b", "write", "--tenant", TENANT, "--user", "bob", text))["memory_id"]
        for text in ("Bob plays chess on Sundays", "Bob's locker code is 4417")
    ]
    out, err = app.communicate(timeout=300)
    assert app.returncode == 0, err[-4000:]
    alice = json.loads(out)

    refreshed = ok(topo.cli("ops", "materialize", "--tenant", TENANT, timeout=600))
    assert refreshed["success"] is True and refreshed["failures"] == []
    assert refreshed["assets"]["memory_embeddings"]["records"] == 5, refreshed["assets"]
    assert all(refreshed["checks"].values()), refreshed["checks"]

    recalled = ok(topo.python("app-a", RECALL))
    assert recalled and recalled[0]["memory_id"] == alice[0]
    # A host that never ran anything reads the analytics every run wrote.
    counted = ok(topo.cli("analyst", "analytics", "--tenant", TENANT, "--sql", "SELECT count(*) FROM memories"))
    assert counted["rows"] == [[5]]

    backup = ok(topo.cli("ops", "backup", "--tenant", TENANT, timeout=600))
    objects = topo.s3.list_objects_v2(Bucket=topo.bucket).get("Contents", [])
    assert objects and all(
        b"chess" not in topo.s3.get_object(Bucket=topo.bucket, Key=o["Key"])["Body"].read() for o in objects
    )

    # A SUBJECT forget the daemon's sensor runs, and a MEMORY forget with its own run.
    subject = ok(topo.cli("app-a", "forget", "--tenant", TENANT, "--subject", "alice"))
    memory = ok(topo.cli("app-b", "forget", "--tenant", TENANT, "--memory-id", bob[1], "--wait", timeout=600))
    assert memory["state"] == "COMPLETE"

    def status(job_id: str) -> dict[str, Any]:
        return dict(ok(topo.cli("privacy", "deletion", "status", job_id)))

    def state(job_id: str) -> str:
        return str(status(job_id)["state"])

    def erased(job_id: str) -> bool:
        return str(status(job_id)["targets"].get("physical", "")).startswith("ERASED:")

    wait_for("the sensor's forget run", lambda: state(subject["job_id"]) == "COMPLETE", 300, topo)
    # While the erasure sensor waits out its batch window: the canary drill and a retention sweep.
    canary = ok(topo.cli("ops", "canary", timeout=600))
    assert canary["passed"] is True
    yesterday = (datetime.now(UTC) - timedelta(days=1)).date().isoformat()
    ok(topo.cli("ops", "retention", "sweep", "--date", yesterday, "--wait", "--tenant", TENANT, timeout=600))

    # The daemon's erasure: both jobs ERASED, and the certificate states what this deployment proves.
    wait_for("the scheduled erasure", lambda: erased(subject["job_id"]) and erased(memory["job_id"]), 300, topo)
    proof = ok(topo.cli("privacy", "deletion", "proof", subject["job_id"]))
    assert proof["erasure"]["deployment"] == dict.fromkeys(deployment.PARTS, deployment.EXTERNAL)
    assert "postgres_files" in proof["erasure"]["byteScan"]["notScanned"]
    assert proof["guarantees"]["primary"]["cryptographic"].startswith("KEY_DESTROYED:")
    md = topo.cli("privacy", "deletion", "proof", subject["job_id"], "--format", "md").stdout
    section = md[md.index("## What this deployment proves") : md.index("## Physical erasure")]
    lines = [line for line in section.splitlines() if line.startswith("| `")]
    assert [line.split("|")[2].strip(" `") for line in lines] == [deployment.EXTERNAL] * 4
    assert "Not proven: the server's files (not scanned)" in section and "bucket versioning" in section

    # The backup from before the forgets, restored with its backfill: nothing forgotten comes back.
    restored = ok(
        topo.cli("ops", "restore", "--tenant", TENANT, "--backup", backup["backup_id"], "--wait", timeout=900)
    )
    assert restored["run_id"]
    left = {m["memory_id"] for m in ok(topo.cli("app-b", "list", "--tenant", TENANT, "--user", "bob"))}
    assert left == {bob[0]}
    assert ok(topo.cli("app-a", "list", "--tenant", TENANT, "--user", "alice")) == []

    # The daemon backfills the restored tenant's derived stores, on hosts of their own: the analytics
    # copy is rebuilt with the one memory left.
    def backfilled() -> list[dict[str, Any]]:
        found = graphql(web_port, BACKFILLS)["data"]["partitionBackfillsOrError"]["results"]
        done = ("COMPLETED", "COMPLETED_SUCCESS")
        return [b for b in found if b["isAssetBackfill"] and b["status"] in done and b["partitionNames"] == [TENANT]]

    wait_for("the restore's backfill", backfilled, 420, topo)
    again = ok(topo.cli("analyst", "analytics", "--tenant", TENANT, "--sql", "SELECT count(*) FROM memories"))
    assert again["rows"] == [[1]]

    # Every run on a host of its own; no host left a file outside its own namespace.
    runs = graphql(web_port, RUNS)["data"]["runsOrError"]["results"]
    hosts = [{t["key"]: t["value"] for t in run["tags"]}.get(HOST_TAG) for run in runs]
    assert len(runs) >= 5 and all(hosts) and len(set(hosts)) == len(hosts), hosts
    jobs = {run["jobName"] for run in runs}
    assert {"tenant_refresh", "forget", "erase", "backup", "restore"} <= jobs, jobs
    assert all(run["status"] == "SUCCESS" for run in runs if run["jobName"] != "__ASSET_JOB"), runs
    assert list((topo.root / "hosts").iterdir()) == []
    assert topo.proxy.refused == 0  # every request to Chroma carried the token
    assert Path(topo.env["MEMORY_PIPELINES_KEY_VAULT"]).is_dir()
