"""The HOME's warm code server (memory_pipelines/launch/code_server.py): commands started together share one,
another environment gets its own, a dead one is replaced, an idle one ends by itself, and where no
private runtime directory can be had a command runs its own server and leaves nothing behind."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from memory_pipelines.lib.infra import code_runtime, processes, services
from tests.conftest import CLI, run_cli, settings_for

# Servers that must outlive a slow command on a loaded machine, and one that must end by itself soon.
# (The idle time is part of a server's environment: each value has servers of its own.)
IDLE = {"MEMORY_PIPELINES_CODE_SERVER_IDLE_SECONDS": "120"}
SHORT_IDLE = {"MEMORY_PIPELINES_CODE_SERVER_IDLE_SECONDS": "15"}


def code_servers(home: Path) -> list[int]:
    return sorted(proc.pid for proc in processes.home_processes(home) if " api grpc " in " ".join(proc.args))


def ok(result: subprocess.CompletedProcess[str]) -> dict:
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.5)
    return condition()


@pytest.mark.slow
def test_commands_share_one_warm_server_per_environment_and_an_idle_one_ends(tmp_path):
    home = tmp_path / "home"
    try:
        ok(run_cli("tenant", "create", "--tenant", "acme", home=home))
        ok(run_cli("write", "--tenant", "acme", "--user", "alice", "alice likes green tea", home=home))
        env = {**os.environ, "MEMORY_PIPELINES_HOME": str(home), **IDLE}
        together = [
            subprocess.Popen(
                [str(CLI), "materialize", "--tenant", "acme"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        for proc in together:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0 and json.loads(out)["success"], (proc.returncode, out[-3000:], err[-3000:])
        first = code_servers(home)
        assert len(first) == 1, "two commands starting at once started one server"

        # Another environment is served by a server of its own (a run worker inherits the server's).
        other = ok(run_cli("materialize", "--tenant", "acme", home=home, env={**IDLE, "TZ": "UTC"}))
        assert other["success"]
        both = code_servers(home)
        assert len(both) == 2 and first[0] in both

        # A server that died is replaced by the next command, and what it could not remove goes: the
        # socket directory of its run workers' fork server (launch/serve_code.py).
        (killed,) = _fork_server_sockets(first[0])
        os.kill(first[0], 9)
        assert wait_for(lambda: first[0] not in code_servers(home), 10)
        assert killed.exists(), "the control: SIGKILL leaves the fork server's socket"
        assert ok(run_cli("materialize", "--tenant", "acme", home=home, env=IDLE))["success"]
        serving = code_servers(home)
        assert len(serving) == 2 and first[0] not in serving
        assert not killed.exists()
        assert all(len(_fork_server_sockets(pid)) == 1 for pid in serving)

        # A server nobody sends heartbeats to any more ends by itself within about twice its idle time.
        assert ok(run_cli("materialize", "--tenant", "acme", home=home, env=SHORT_IDLE))["success"]
        (short,) = set(code_servers(home)) - set(serving)
        assert wait_for(lambda: short not in code_servers(home), 45), code_servers(home)
    finally:
        services.stop_services(settings_for(home))


@pytest.mark.slow
def test_without_a_private_runtime_directory_a_command_runs_its_own_server(tmp_path):
    home = tmp_path / "home"
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    runtime = shared / f"mp-code-{os.geteuid()}"
    runtime.mkdir()
    runtime.chmod(0o777)  # others could plant a socket here: not used
    try:
        ok(run_cli("tenant", "create", "--tenant", "acme", home=home))
        ok(run_cli("write", "--tenant", "acme", "--user", "alice", "alice likes green tea", home=home))
        result = ok(run_cli("materialize", "--tenant", "acme", home=home, env={"TMPDIR": str(shared)}))
        assert result["success"] and result["assets"]["memory_embeddings"]["embedded"] == 1
        assert list(runtime.iterdir()) == []
        assert processes.home_processes(home) == []  # its own server ended before it returned
    finally:
        services.stop_services(settings_for(home))


def _records() -> list[tuple[Path, dict]]:
    """Every readable server record in the runtime directory, with what it says (pid, HOME)."""
    runtime = code_runtime.runtime_dir()
    assert runtime is not None
    found = []
    for record in runtime.glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            found.append((record, json.loads(record.read_text())))
    return found


def _fork_server_sockets(pid: int) -> list[Path]:
    """The listening sockets of the fork server of code server `pid`, in the server's runtime files."""
    for record, said in _records():
        if said.get("pid") == pid:
            return sorted(code_runtime.scratch_of(record.with_suffix(".sock")).glob("pymp-*/listener-*"))
    return []


def _records_naming(home: Path) -> list[str]:
    return [record.name for record, said in _records() if said.get("home") == str(home)]


@pytest.mark.slow
def test_stop_leaves_no_record_of_its_code_servers_outside_home(tmp_path):
    """Issue 33: the record of a stopped code server (/tmp/mp-code-<uid>/<hash>.json: its pid and the
    HOME) stayed after `stop`, naming a dead process and the HOME, until another command swept it."""
    home = tmp_path / "home"
    try:
        ok(run_cli("tenant", "create", "--tenant", "acme", home=home))
        assert ok(run_cli("materialize", "--tenant", "acme", home=home, env=IDLE))["success"]
        assert len(code_servers(home)) == 1 and len(_records_naming(home)) == 1, "the control"
        (listener,) = _fork_server_sockets(code_servers(home)[0])
        scratch = listener.parent.parent
        stopped = ok(run_cli("stop", home=home))
        assert stopped["stopped"] and code_servers(home) == []
        assert _records_naming(home) == []
        assert not scratch.exists()  # the socket directory of its run workers' fork server
    finally:
        services.stop_services(settings_for(home))
