"""No process outlives its owner: a CLI command returns only once the run workers of its runs have
ended, leaving only the HOME's warm code server (a service, like PostgreSQL and Chroma, that ends by
itself when idle), and `stop` ends everything of its HOME (Dagster processes first, then Chroma and
PostgreSQL) and nothing of another HOME."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from memory_pipelines.lib.infra import processes, services
from memory_pipelines.lib.infra.settings import ENV_HOME
from tests.conftest import run_cli, settings_for


def of_home(home: Path) -> list[str]:
    """Every live process whose command line or HOME variables name `home` (not this one or its parents)."""
    table = processes.processes()
    spared = processes.ancestry(os.getpid(), table)
    found = []
    for proc in table:
        env = processes.process_environ(proc.pid)
        named = processes.names_path(proc.command, home) or any(
            processes.names_path(env.get(name, ""), home) for name in processes.HOME_VARIABLES
        )
        if named and proc.pid not in spared:
            found.append(f"{proc.pid}: {proc.describe()['command']}")
    return found


@pytest.mark.slow
def test_a_cli_session_then_stop_leaves_no_process_of_its_home(tmp_path):
    home = tmp_path / "home"
    settings = settings_for(home)

    def cli(*args: str) -> dict:
        result = run_cli(*args, home=home, timeout=300)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    try:
        cli("write", "--tenant", "acme", "--user", "alice", "alice likes green tea")
        memory = cli("write", "--tenant", "acme", "--user", "alice", "alice works on project kappa")["memory_id"]
        cli("write", "--tenant", "acme", "--user", "alice", "--memory-id", memory, "alice works on project lambda")
        cli("write", "--tenant", "acme", "--user", "bob", "bob prefers coffee")
        servers: set[int] = set()
        for command in (
            ("materialize", "--tenant", "acme"),
            ("analytics", "--tenant", "acme", "--sql", "SELECT count(*) FROM memories"),
            ("retention", "sweep", "--date", "2024-01-01", "--wait"),
            ("forget", "--tenant", "acme", "--subject", "bob", "--wait"),
        ):
            cli(*command)
            # The command waited for its run workers; what is left is the one warm code server.
            left = {proc.pid: " ".join(proc.args) for proc in processes.home_processes(home)}
            warm = {pid for pid, args in left.items() if " api grpc " in args}
            # Besides the server, only its multiprocessing helpers, made with its first run worker: the
            # fork server its run workers fork from (launch/serve_code.py) and the resource tracker.
            helpers = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
            assert all(any(h in args for h in helpers) for pid, args in left.items() if pid not in warm), (
                command,
                left,
            )
            servers |= warm
        assert len(servers) == 1, "every command reused the first command's code server"
        cli("rollback", "--tenant", "acme", "--user", "alice", "--memory-id", memory)
        cli("summary", "--tenant", "acme", "--subject", "alice")
        assert of_home(home), "the embedded servers run until `stop`"

        stopped = cli("stop")
        assert stopped["postgres"]["stopped"] and stopped["chroma"]["stopped"], stopped
        assert servers <= {entry["pid"] for entry in stopped["dagster"]["processes"]}, stopped
        # Nothing waits for a grace period: `stop` returns once everything of HOME has ended.
        assert of_home(home) == []
    finally:
        services.stop_services(settings)


# A stand-in for a Dagster process that ignores SIGTERM, as a code server whose cleanup thread died
# does: named `dagster`, so `stop` knows it for one. It says it is ready on stdout.
STUBBORN = textwrap.dedent(
    """
    import signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ready", flush=True)
    time.sleep(300)
    """
)


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_stop_ends_the_dagster_processes_of_its_home_and_spares_everything_else(tmp_path):
    home = tmp_path / "home"
    other = tmp_path / "home-other"  # a sibling whose path begins with HOME's
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "dagster"
    program.write_text(STUBBORN)
    worker_code = "import multiprocessing\n" + STUBBORN  # as a run worker: `python -c ...multiprocessing...`
    python = sys.executable
    procs = {
        # Named by its command line, ignoring SIGTERM: ended by SIGKILL.
        "code server": start([python, str(program), "api", "grpc", "--instance-ref", f"base_dir: {home}/dagster"]),
        # Named only by its environment, as a run worker is.
        "run worker": start([python, "-c", worker_code], env={"DAGSTER_HOME": str(home / "dagster")}),
        # Spared: another HOME's code server, and a program that is not Dagster's but names HOME.
        "other home": start([python, str(program), "api", "grpc", str(other)], env={ENV_HOME: str(other)}),
        "not dagster": start([python, "-c", STUBBORN, str(home)]),
        # Spared: a Dagster process of another project whose files lie under HOME (a HOME such as ~).
        "project under home": start([python, str(program), "api", "grpc", "--socket", f"{home}/project/grpc.sock"]),
    }
    try:
        report = services.stop_services(settings_for(home), timeout=2.0)
        dagster = report["dagster"]
        assert isinstance(dagster, dict)
        ended = {entry["pid"]: entry for entry in dagster["processes"]}
        assert set(ended) == {procs["code server"].pid, procs["run worker"].pid}, dagster
        assert all(entry["ended"] for entry in ended.values()) and dagster["left"] == []
        assert ended[procs["code server"].pid]["signal"] == "SIGKILL"  # SIGTERM was ignored
        assert report["stopped"] is True
        assert all(procs[name].poll() is None for name in ("other home", "not dagster", "project under home"))
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(5)


LEAKY_TESTS = """
import subprocess


def test_leaks_a_process():
    subprocess.Popen(["sleep", "317"], start_new_session=True)


def test_starts_a_process_that_ends_within_the_grace_period():
    subprocess.Popen(["sleep", "2"])
"""


@pytest.mark.slow
def test_the_end_of_run_guard_fails_a_run_that_leaks_a_process_and_names_it(tmp_path):
    """The guard of tests/conftest.py, in a run of its own (two xdist workers) of a test that leaks."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_configure, pytest_sessionfinish  # noqa\n")
    (tmp_path / "test_leaky.py").write_text(LEAKY_TESTS)
    project = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--basetemp", str(tmp_path / "t")],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(project)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "2 passed" in output and "1 process(es) outlived the tests" in output, output
    assert "sleep 317" in output and "sleep 2 " not in output, output
    # The guard ended what it named: nothing of that run is left.
    assert not [proc for proc in processes.processes() if proc.args == ("sleep", "317")]
