"""`memory-pipelines dev`: the webserver and daemon on the embedded instance show every asset,
the sensor turns store tenants (never canary tenants) into partitions, and everything `dev`
started ends on SIGTERM or SIGINT, even when started as a script's `dev &` starts it (SIGINT
ignored). `env` lets Dagster's own CLI reach HOME's instance."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from memory_pipelines.launch.devserver import group_members
from memory_pipelines.lib.infra import services, validation
from memory_pipelines.lib.runtime import open_store
from tests.conftest import CLI, settings_for

pytestmark = pytest.mark.slow

ASSET_QUERY = "{ assetNodes { assetKey { path } groupName partitionKeys } }"
LOCATION_QUERY = (
    "{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus"
    " locationOrLoadError { __typename } } } } }"
)
DERIVED = {"memory_embeddings", "keyword_index", "subject_summaries", "team_summaries", "analytics_memories"}
# The assets partitioned by tenant: the sensor makes "acme" (never the canary's tenant) a partition of
# each. The others are monthly (memory_eval, memory_drift) or have no partitions at all.
TENANT_PARTITIONED = {"memories", "memory_deletions", "physical_erasure", "key_conversion", "tenant_backups"} | DERIVED
UNPARTITIONED_BY_TENANT = {"deletion_notifications", "deletion_canary", "memory_eval", "memory_drift"}
# What `dev` runs: dg dev, then the processes dagster dev starts.
DEV_PROCESSES = ("dg dev", "dagster_webserver", "dagster._daemon", "dagster code-server start", "dagster api grpc")
# As `sh -c '... &'` does (POSIX: no job control, so the background command ignores SIGINT and
# SIGQUIT), with the pid written where the test finds it and `wait` returning dev's exit status.
BACKGROUND = '"$0" --home "$1" dev --port "$2" 2>"$3" & echo $! >"$4"; wait $!'


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


def _stat(pid: int) -> list[str] | None:
    """state, ppid, pgrp, ... of a live process; None when it is gone or a zombie."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else fields


def descendants(pid: int) -> dict[int, str]:
    """Every live descendant of `pid`, with its command line, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            parents[int(entry.name)] = int(fields[1])
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child in [c for c, p in parents.items() if p == parent]:
            try:
                found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            frontier.append(child)
    return found


def _ignores(pid: int, signum: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    raise AssertionError(f"no SigIgn for {pid}")


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_dev_in_the_background_shows_every_asset_and_ends_with_all_its_processes(tmp_path, stop_signal):
    home = tmp_path / "dev-home"
    settings = settings_for(home)
    store = open_store(settings)
    store.write(tenant_id="acme", user_id="alice", text="seen through the UI")
    with validation.platform_owned():  # as the canary drill makes its tenants
        store.write(tenant_id="canary-drill-x", user_id="alice", text="internal: never a partition")
    store.close()
    port, stderr, pid_file = free_port(), tmp_path / "dev.stderr", tmp_path / "dev.pid"
    shell = subprocess.Popen(
        ["sh", "-c", BACKGROUND, str(CLI), str(home), str(port), str(stderr), str(pid_file)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the shell and dev in a session of their own, away from pytest's signals
        env={**os.environ, "MEMORY_PIPELINES_HOME": str(home)},
    )
    dev, tree, group = 0, {}, 0
    try:
        assert shell.stdout is not None
        announced = json.loads("".join(shell.stdout.readline() for _ in range(5)))
        assert announced["url"] == f"http://127.0.0.1:{port}"
        dev = int(pid_file.read_text())
        # Started as a script's `&` starts it: the shell set SIGINT and SIGQUIT to ignored. dev
        # replaces SIGINT's with its handler; SIGQUIT it leaves alone, which shows how it began.
        assert _ignores(dev, signal.SIGQUIT)
        deadline, nodes = time.monotonic() + 150, None
        while time.monotonic() < deadline:
            try:
                nodes = graphql(port, ASSET_QUERY)["data"]["assetNodes"]
                partitioned = {n["assetKey"]["path"][0]: n["partitionKeys"] for n in nodes or []}
                if all("acme" in partitioned.get(name, []) for name in TENANT_PARTITIONED):
                    break
            except OSError:
                pass
            time.sleep(2)
        by_key = {"/".join(n["assetKey"]["path"]): n for n in nodes or []}
        assert set(by_key) == TENANT_PARTITIONED | UNPARTITIONED_BY_TENANT
        assert by_key["memories"]["groupName"] == "memory_store"
        assert by_key["memory_embeddings"]["groupName"] == "derived_stores"
        assert all(by_key[name]["partitionKeys"] == ["acme"] for name in TENANT_PARTITIONED)
        # The code location of workspace.yaml, under its name, and the printed URL serves the UI.
        entries = graphql(port, LOCATION_QUERY)["data"]["workspaceOrError"]["locationEntries"]
        assert [(e["name"], e["loadStatus"]) for e in entries] == [("memory_pipelines", "LOADED")]
        assert entries[0]["locationOrLoadError"]["__typename"] == "RepositoryLocation"
        with urllib.request.urlopen(announced["url"], timeout=10) as page:
            assert page.status == 200 and "html" in page.headers["Content-Type"]
        # Eager automation, the daemon dequeuing CLI runs and the rest of the lifecycle run on the same
        # processes in test_daemon_e2e.py; here: what `dev` starts and shows, and how it ends.

        tree = descendants(dev)
        for name in DEV_PROCESSES:
            assert any(name in command for command in tree.values()), (name, tree)
        group = next(pid for pid, command in tree.items() if " dev -w " in command)  # dg dev leads its group
        members = set(group_members(group))
        assert all(pid in members or _stat(pid) is None for pid in tree), "every process of dev is in dg dev's group"
        os.kill(dev, stop_signal)
        started = time.monotonic()
        left = set(tree)
        while time.monotonic() - started < 15 and left:
            time.sleep(0.1)
            left = {pid for pid in tree if _stat(pid) is not None} | set(group_members(group)) | set(descendants(dev))
        elapsed = time.monotonic() - started
        print(f"{stop_signal.name}: {len(tree)} processes of dev ended {elapsed:.1f}s after the signal")
        assert not left, f"still alive {elapsed:.1f}s after {stop_signal.name}: {left}"
        assert elapsed < 10, f"{stop_signal.name}: everything ended only after {elapsed:.1f}s"
        assert shell.wait(10) == 0, "dev exits 0 when asked to stop"
        errors = stderr.read_text()
        assert f"dev: {stop_signal.name}: stopping Dagster" in errors
        assert "Shutting down Dagster services" in errors, "dagster dev itself received the interrupt"
        assert "SupersessionWarning" not in errors and "use 'dg dev'" not in errors.lower()
    finally:
        # Whatever a failure left: the shell's session, dg dev's group, and every descendant.
        for pgid in (shell.pid, group):
            try:
                if pgid:
                    os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in set(tree) | (set(descendants(dev)) if dev else set()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shell.wait(10)
        services.stop_services(settings)


def test_env_lets_dagsters_own_cli_reach_the_instance(tmp_path):
    """`eval "$(memory-pipelines env)"` in a fresh shell, then Dagster's CLI and API find the instance."""
    home = tmp_path / "env-home"
    settings = settings_for(home)
    # A fresh login: none of the variables this test process carries (the session's Dagster URL...).
    fresh = {"PATH": f"{CLI.parent}{os.pathsep}{os.environ.get('PATH', '')}", "HOME": str(tmp_path)}
    show = (
        "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k[:7] in ('DAGSTER', 'MEMORY_')}))"
    )
    count = "import dagster; print('runs:', dagster.DagsterInstance.get().get_runs_count())"
    script = (
        'eval "$(memory-pipelines --home "$1" env)" || exit 9\n'
        'python -c "$2"\n'
        "dagster run list || exit 10\n"
        'python -c "$3" || exit 11\n'
        "dagster instance info || exit 12\n"
    )
    try:
        done = subprocess.run(
            ["sh", "-c", script, "sh", str(home), show, count], env=fresh, capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        seen = json.loads(lines[0])
        as_json = subprocess.run(
            [str(CLI), "--home", str(home), "env", "--format", "json"], env=fresh, capture_output=True, text=True
        )
        assert as_json.returncode == 0, as_json.stderr
        # The shell read back exactly what the JSON says: the URL's ?, % and + survived the quoting.
        assert {k: seen[k] for k in json.loads(as_json.stdout)} == json.loads(as_json.stdout)
        assert seen["DAGSTER_HOME"] == str(settings.dagster_home)
        assert seen["MEMORY_PIPELINES_HOME"] == str(settings.home)
        assert "?host=" in seen["MEMORY_PIPELINES_DAGSTER_PG_URL"]
        assert "runs: 0" in lines
        assert "PostgresRunStorage" in done.stdout
        # Without the step, as the issue found it: DAGSTER_HOME alone does not reach the instance.
        bare = subprocess.run(
            [str(CLI.parent / "python"), "-c", count],
            env={**fresh, "DAGSTER_HOME": str(settings.dagster_home)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bare.returncode != 0 and "MEMORY_PIPELINES_DAGSTER_PG_URL" in bare.stderr
    finally:
        services.stop_services(settings)
