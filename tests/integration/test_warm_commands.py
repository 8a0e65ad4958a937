"""Commands forked warm (memory_pipelines/launch/warm_commands.py): once a HOME has a warm code server
(its first launching command starts one), its commands run in a child of that server's command
forker, which has Dagster imported. The caller
imports none of it, and its output, exit code, stdin and signals are the command's own; a caller the
child could not stand in for, or another user, runs its command itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from memory_pipelines.launch.materialize import DEQUEUE_LOCK
from memory_pipelines.launch.warm_commands import ENV_WARM_COMMANDS, process_facts
from memory_pipelines.lib.infra import code_runtime, services
from memory_pipelines.lib.infra.code_runtime import link_of
from memory_pipelines.lib.infra.leases import libpq_url
from memory_pipelines.lib.infra.settings import Settings
from tests.conftest import CLI, run_cli, settings_for
from tests.integration.test_code_server import code_servers
from tests.support.local_user import AS_NOBODY, run_as_nobody

# A command as a terminal's foreground job starts: no signal ignored, whatever this worker has come to
# ignore (a CI job started in the background of a shell ignores SIGINT, and Dagster, once it has run
# in this process, gives SIGTERM SIGINT's disposition); an ignored signal survives exec.
FOREGROUND = (
    sys.executable,
    "-c",
    "import os, signal, sys\n"
    "for name in ('SIGINT', 'SIGTERM', 'SIGHUP', 'SIGQUIT'):\n"
    "    signal.signal(getattr(signal, name), signal.SIG_DFL)\n"
    "os.execv(sys.argv[1], sys.argv[1:])",
)

# A caller that is only the forwarding: what it ran, and whether it imported Dagster to do so.
CALLER = textwrap.dedent(
    """
    import json, os, sys
    from pathlib import Path
    from memory_pipelines.launch.warm_commands import forward
    if os.environ.get("CALLER_NICE"):
        os.nice(int(os.environ["CALLER_NICE"]))
    code = forward(sys.argv[1:], Path(os.environ["MEMORY_PIPELINES_HOME"]))
    sys.stderr.write("\\n" + json.dumps({"code": code, "dagster": "dagster" in sys.modules}) + "\\n")
    """
)


# The program's own main, as the `memory-pipelines` script calls it (argv from sys.argv): what it
# returned, and whether this process imported Dagster to run it.
PROGRAM = textwrap.dedent(
    """
    import json, sys
    from memory_pipelines.cli import main
    sys.argv = ["memory-pipelines", *sys.argv[1:]]
    code = main()
    sys.stderr.write("\\n" + json.dumps({"code": code, "dagster": "dagster" in sys.modules}) + "\\n")
    """
)


def caller(cli_env: dict[str, Any], *argv: str, **env: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    done = subprocess.run(
        [sys.executable, "-c", CALLER, *argv],
        env={**os.environ, "MEMORY_PIPELINES_HOME": str(cli_env["home"]), **cli_env["env"], **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stderr.strip().splitlines()[-1]), done


def command_line(result: subprocess.CompletedProcess[str]) -> str:
    """stderr without the caller's own last line."""
    return "\n".join(result.stderr.strip().splitlines()[:-1]).strip()


def forker_link(home: Path) -> Path:
    runtime = code_runtime.runtime_dir()
    assert runtime is not None
    return link_of(home, runtime)


def wait_for(condition: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return bool(condition())


def holders_of_stdin(proc: subprocess.Popen[str]) -> list[int]:
    """Processes other than `proc` whose stdin is `proc`'s (a pipe only the test and they hold)."""
    mine = os.readlink(f"/proc/{proc.pid}/fd/0")
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != proc.pid:
            try:
                if os.readlink(entry / "fd" / "0") == mine:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def warm(cli_env: dict[str, Any]) -> dict[str, Any]:
    """The module's HOME with a tenant, a memory and a warm code server whose forker answers."""
    env, home = cli_env["env"], cli_env["home"]
    tenant = "t-warm"
    assert (
        run_cli("write", "--tenant", tenant, "--user", "alice", "alice likes tea", home=home, env=env).returncode == 0
    )
    first = run_cli("materialize", "--tenant", tenant, home=home, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert wait_for(forker_link(home).exists, 120), "the warm code server's command forker never answered"
    return {**cli_env, "tenant": tenant, "first": json.loads(first.stdout)}


@pytest.mark.slow
def test_a_homes_first_launching_command_starts_its_server_and_is_forked_warm_from_it(
    cli_env: dict[str, Any], tmp_path: Path
) -> None:
    home = tmp_path / "home"
    env = {**os.environ, **cli_env["env"], "MEMORY_PIPELINES_HOME": str(home)}

    def program(*argv: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
        done = subprocess.run(
            [sys.executable, "-c", PROGRAM, *argv], env=env, capture_output=True, text=True, timeout=300, check=False
        )
        return json.loads(done.stderr.strip().splitlines()[-1]), done

    try:
        # A command that launches no run starts no server: it runs in its own process.
        said, done = program("write", "--tenant", "t-first", "--user", "alice", "alice likes tea")
        assert said == {"code": 0, "dagster": False}, done.stderr[-3000:]
        assert code_servers(home) == [] and not forker_link(home).exists()

        # The first `materialize` starts the HOME's warm server, as it did itself before, and runs in a
        # child of its command forker: the caller never imports Dagster.
        said, done = program("materialize", "--tenant", "t-first")
        assert said == {"code": 0, "dagster": False}, done.stderr[-3000:]
        assert json.loads(done.stdout)["success"]
        (server,) = code_servers(home)
        assert forker_link(home).exists()
        # The next one is served by the same server (the child found it as its own process would have).
        said, done = program("materialize", "--tenant", "t-first")
        assert said == {"code": 0, "dagster": False} and json.loads(done.stdout)["success"]
        assert code_servers(home) == [server]
    finally:
        services.stop_services(Settings.from_env({"MEMORY_PIPELINES_HOME": str(home), **cli_env["env"]}))
    assert code_servers(home) == []


@pytest.mark.slow
def test_a_command_forked_warm_answers_as_its_own_process_would(warm: dict[str, Any]) -> None:
    said, done = caller(warm, "materialize", "--tenant", warm["tenant"])
    assert said == {"code": 0, "dagster": False}, done.stderr[-3000:]
    document = json.loads(done.stdout)
    assert document.keys() == warm["first"].keys()
    assert document["success"] and document["checks"] == warm["first"]["checks"]
    assert all(document["checks"].values())

    # A refusal, as the command's own process gives it: the same line, the same exit code.
    said, refused = caller(warm, "materialize", "--tenant", "t-nobody-made")
    here = run_cli("--verbose", "materialize", "--tenant", "t-nobody-made", home=warm["home"], env=warm["env"])
    assert here.returncode != 0
    assert said == {"code": here.returncode, "dagster": False}
    assert command_line(refused) == here.stderr.strip()
    assert refused.stdout == here.stdout == ""


@pytest.mark.slow
def test_a_caller_the_child_cannot_stand_in_for_runs_its_command_itself(warm: dict[str, Any]) -> None:
    # Placed otherwise (a nice value a child would not have), importing otherwise, or asked not to.
    for env in ({"CALLER_NICE": "3"}, {"PYTHONHASHSEED": "7"}, {ENV_WARM_COMMANDS: "0"}):
        said, done = caller(warm, "tenants", **env)
        assert said == {"code": None, "dagster": False}, env
        assert done.stdout == ""
    # The program runs such a command itself, with the same result.
    mine = subprocess.run(
        ["nice", "-n", "3", str(CLI), "tenants"],
        env={**os.environ, "MEMORY_PIPELINES_HOME": str(warm["home"]), **warm["env"]},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert mine.returncode == 0 and warm["tenant"] in mine.stdout

    # A value that is neither: an error naming the variable, and nothing runs.
    bad = run_cli("tenants", home=warm["home"], env={**warm["env"], ENV_WARM_COMMANDS: "yes"})
    assert (bad.returncode, bad.stdout) == (2, "")
    assert bad.stderr.strip() == (
        f"memory-pipelines: error: {ENV_WARM_COMMANDS}: must be 1 (fork commands warm) or 0 (never), got 'yes'"
    )

    # Another local user cannot even reach the forker: its runtime directory is its owner's alone.
    link = forker_link(warm["home"])
    reach = subprocess.run(
        [
            *AS_NOBODY,
            "/usr/bin/python3",
            "-I",
            "-c",
            "import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect(sys.argv[1])\nexcept OSError as e:\n    print(type(e).__name__)\n"
            "else:\n    print('connected')",
            str(link),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd="/",
    )
    assert reach.stdout.strip() == "PermissionError", reach


@pytest.mark.slow
def test_stdin_reaches_the_command_and_its_end_is_the_callers(warm: dict[str, Any]) -> None:
    env = {**os.environ, "MEMORY_PIPELINES_HOME": str(warm["home"]), **warm["env"]}
    argv = [*FOREGROUND, str(CLI), "write", "--tenant", warm["tenant"], "--user", "bob", "-"]

    def start() -> tuple[subprocess.Popen[str], int]:
        proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert wait_for(lambda: len(holders_of_stdin(proc)) == 1, 60), "no forked command reads the caller's stdin"
        (child,) = holders_of_stdin(proc)
        return proc, child

    # The caller's stdin is the command's: it reads the text from it and writes the memory.
    proc, child = start()
    out, err = proc.communicate("bob likes green tea", timeout=120)
    assert proc.returncode == 0, err
    assert json.loads(out)["memory_id"]

    # SIGTERM ends the command; the caller ends by the same signal.
    proc, child = start()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert wait_for(lambda: not Path(f"/proc/{child}").exists(), 10)
    proc.communicate(timeout=60)

    # A caller killed outright takes its command with it, though the command's stdin stays open.
    proc, child = start()
    proc.kill()
    proc.wait(timeout=60)
    assert wait_for(lambda: not Path(f"/proc/{child}").exists(), 10), "the command outlived its caller"
    proc.communicate(timeout=60)

    # Only the first of these wrote anything.
    listing = run_cli("list", "--tenant", warm["tenant"], "--user", "bob", home=warm["home"], env=warm["env"])
    assert listing.returncode == 0 and len(json.loads(listing.stdout)) == 1


@pytest.mark.slow
def test_ctrl_c_reaches_a_forked_launch_which_cancels_its_run(tmp_path: Path) -> None:
    # A HOME of its own, on its own server: its run queue and dequeue lock are this test's alone.
    home = tmp_path / "home"
    tenant = "t-ctrl-c"
    try:
        assert run_cli("write", "--tenant", tenant, "--user", "u", "u likes tea", home=home).returncode == 0
        assert run_cli("materialize", "--tenant", tenant, home=home).returncode == 0
        assert wait_for(forker_link(home).exists, 120), "the warm code server's command forker never answered"
        exported = run_cli("env", "--format", "json", home=home)
        runs_db = libpq_url(json.loads(exported.stdout)["MEMORY_PIPELINES_DAGSTER_PG_URL"])
        store_db = runs_db.replace(f"/{services.DAGSTER_DB}?", f"/{services.STORE_DB}?")
        with psycopg.connect(store_db, autocommit=True) as holder:
            # No command dequeues meanwhile: the run stays queued, its command waiting for its turn.
            holder.execute("SELECT pg_advisory_lock(%s)", (DEQUEUE_LOCK,))
            proc = subprocess.Popen(
                [*FOREGROUND, str(CLI), "materialize", "--tenant", tenant],
                env={**os.environ, "MEMORY_PIPELINES_HOME": str(home)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )

            def waiting() -> bool:
                (waiters,) = holder.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                ).fetchone() or (0,)
                return waiters > 0 and _statuses(runs_db, tenant)[1:] == ["QUEUED"]

            try:
                assert wait_for(waiting, 120), _statuses(runs_db, tenant)
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=120)
            finally:
                proc.kill()
        assert (proc.returncode, out) == (130, ""), err
        assert "error: interrupted: stopped by the user" in err
        # The command itself got the Ctrl-C: an interrupted CLI leaves no run behind in the queue.
        assert _statuses(runs_db, tenant) == ["SUCCESS", "CANCELED"]
    finally:
        services.stop_services(settings_for(home))
    # `stop` ended the forker with SIGTERM, and it took its link with it.
    assert not forker_link(home).is_symlink()


def _statuses(conninfo: str, tenant: str) -> list[str]:
    with psycopg.connect(conninfo) as conn:
        if conn.execute("SELECT to_regclass('runs')").fetchone() == (None,):
            return []  # the instance's tables are made by the first command that opens it
        rows = conn.execute(
            "SELECT r.status FROM runs r WHERE EXISTS (SELECT 1 FROM run_tags t WHERE t.run_id = r.run_id"
            " AND t.key = 'dagster/partition' AND t.value = %s) ORDER BY r.id",
            (tenant,),
        ).fetchall()
    return [status for (status,) in rows]


# As another user: connect through the door given, send a request that claims the owner's facts.
IMPOSTOR = textwrap.dedent(
    """
    import json, socket, struct, sys
    request = json.dumps({
        "argv": ["memory-pipelines", "tenants"], "env": {}, "cwd": "/", "umask": 63, "ignored": [],
        "blocked": [], "stdio": {name: ["utf-8", "strict"] for name in ("stdin", "stdout", "stderr")},
        "facts": json.loads(sys.argv[2]),
    }).encode()
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    socket.send_fds(s, [struct.pack("!I", len(request))], [0, 1, 2])
    s.sendall(request)
    print(json.dumps(json.loads(s.makefile("rb").readline())))
    """
)


@pytest.mark.slow
def test_another_user_claiming_the_owners_process_is_refused_through_a_door_left_open(warm: dict[str, Any]) -> None:
    """The socket's directory keeps others out; were a door opened by mistake (a link to the socket,
    world-writable, where others can reach it), the forker asks the kernel who calls and refuses
    any other uid, whatever the caller claims: a child of the forker runs as the owner."""
    sock = Path(os.readlink(forker_link(warm["home"])))
    opened = Path(tempfile.mkdtemp(prefix="mp-door-", dir="/tmp"))
    door = opened / "door.sock"
    try:
        opened.chmod(0o755)
        os.link(sock, door)
        door.chmod(0o666)  # the inode: the socket's own path stays behind its owner-only directories
        said = run_as_nobody(IMPOSTOR, str(door), json.dumps(process_facts(os.environ)))
    finally:
        sock.chmod(0o600)
        door.unlink(missing_ok=True)
        opened.rmdir()
    assert said == {"refused": "user"}


@pytest.mark.slow
def test_the_forker_ends_with_its_code_server(warm: dict[str, Any]) -> None:
    link = forker_link(warm["home"])
    socket_path = Path(os.readlink(link))
    server = socket_path.parent.with_suffix(".json")
    pid = json.loads(server.read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not link.exists() and not link.is_symlink() and not socket_path.exists(), 15)
    said, _ = caller(warm, "tenants")
    assert said == {"code": None, "dagster": False}
