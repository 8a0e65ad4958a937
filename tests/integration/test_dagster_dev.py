"""`memory-pipelines dev`: the webserver and daemon on the embedded instance show every asset,
and the sensor turns store tenants (never canary tenants) into partitions."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

import psutil
import pytest

from memory_pipelines.lib import services
from memory_pipelines.lib.runtime import open_store
from tests.conftest import CLI, settings_for

pytestmark = pytest.mark.slow

ASSET_QUERY = "{ assetNodes { assetKey { path } groupName partitionKeys } }"
DERIVED = {"memory_embeddings", "keyword_index", "subject_summaries", "team_summaries", "analytics_memories"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def graphql(port: int, query: str) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_dev_shows_memories_partitioned_by_tenant(tmp_path):
    home = tmp_path / "dev-home"
    settings = settings_for(home)
    store = open_store(settings)
    store.write(tenant_id="acme", user_id="alice", text="seen through the UI")
    store.write(tenant_id="canary-drill-x", user_id="alice", text="internal: never a partition")
    store.close()
    port = free_port()
    proc = subprocess.Popen(
        [str(CLI), "--home", str(home), "dev", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, "MEMORY_PIPELINES_HOME": str(home)},
    )
    try:
        assert proc.stdout is not None
        announced = json.loads("".join(proc.stdout.readline() for _ in range(5)))
        assert announced["url"] == f"http://127.0.0.1:{port}"
        deadline, nodes = time.monotonic() + 150, None
        while time.monotonic() < deadline:
            try:
                nodes = graphql(port, ASSET_QUERY)["data"]["assetNodes"]
                if nodes and all(
                    "acme" in n["partitionKeys"]
                    for n in nodes
                    if n["assetKey"]["path"][0] not in ("deletion_canary", "memory_eval", "memory_drift")
                ):
                    break
            except OSError:
                pass
            time.sleep(2)
        by_key = {"/".join(n["assetKey"]["path"]): n for n in nodes or []}
        expected = {
            "memories",
            "memory_deletions",
            "physical_erasure",
            "deletion_canary",
            "tenant_backups",
            "memory_eval",
            "memory_drift",
        }
        assert set(by_key) == expected | DERIVED
        assert by_key["memories"]["groupName"] == "memory_store"
        assert by_key["memory_embeddings"]["groupName"] == "derived_stores"
        assert all(by_key[name]["partitionKeys"] == ["acme"] for name in {"memories"} | DERIVED)
        # Eager automation, the daemon dequeuing CLI runs and the rest of the lifecycle run on the same
        # processes in test_daemon_e2e.py; here: what `dev` starts and shows.
    finally:
        # dagster dev's code servers may run in sessions of their own: stop every descendant too.
        children = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for child in children:
            if child.is_running():
                child.kill()
        services.stop_services(settings)
