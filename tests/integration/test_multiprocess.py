"""Several processes on one HOME: the embedded Chroma server is shared and managed with PostgreSQL,
dagster.yaml is ours once and the user's afterwards, and two processes refreshing, recalling and
forgetting one tenant at once never meet a lock."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memory_pipelines.lib.infra import services
from memory_pipelines.lib.infra.settings import ENV_DAGSTER_PG_URL, Settings
from tests.conftest import settings_for
from tests.support.instances import database_sessions

# Earlier shipped dagster.yaml files, as shipped.
SNAPSHOTS = Path(__file__).resolve().parents[1] / "snapshots"
WORKER_SECONDS = 20.0
MIN_OPERATIONS = 40  # per process; one loop is 10 operations (about 250 in 20 s here)


@pytest.fixture(scope="module")
def fresh_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, services.Endpoints]]:
    """A HOME of its own (its own PostgreSQL and Chroma server), stopped at the end."""
    settings = settings_for(tmp_path_factory.mktemp("mp-home"))
    try:
        yield settings, services.ensure_services(settings)
    finally:
        services.stop_services(settings)


def _in_another_process(home: Path, code: str) -> dict[str, Any]:
    """Runs `code` (which prints one JSON line) in a fresh interpreter on `home`."""
    env = {**os.environ, "MEMORY_PIPELINES_HOME": str(home)}
    env.pop(ENV_DAGSTER_PG_URL, None)  # as a new shell would: the child computes its own
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_chroma_server_is_shared_by_processes_and_stopped_with_postgres(fresh_home):
    settings, endpoints = fresh_home
    state = services.chroma_state(settings)
    assert state is not None and endpoints.chroma_embedded
    assert endpoints.chroma_url == state["url"] and services.chroma_heartbeat(endpoints.chroma_url)
    assert (settings.chroma_path / "server.log").exists()

    other = _in_another_process(
        settings.home,
        "import json\n"
        "from memory_pipelines.lib.infra.services import ensure_services, chroma_state\n"
        "from memory_pipelines.lib.infra.settings import Settings\n"
        "s = Settings.from_env()\n"
        "e = ensure_services(s)\n"
        "print(json.dumps({'url': e.chroma_url, 'pid': chroma_state(s)['pid']}))\n",
    )
    assert other == {"url": state["url"], "pid": state["pid"]}
    assert services.pid_alive(state["pid"]), "the server outlives the process that asked for it"

    # Every product path goes to that server, never to an embedded PersistentClient.
    from memory_pipelines.lib.runtime import open_store
    from memory_pipelines.lib.stores.derived import open_derived
    from memory_pipelines.lib.stores.embedding import HashingEmbedder
    from memory_pipelines.resources import ChromaResource

    store = open_store(settings, endpoints)
    try:
        vectors = open_derived(settings, store, embedder=HashingEmbedder()).vectors
        assert vectors.url == state["url"] and not vectors.embedded
    finally:
        store.close()
    resource = ChromaResource(home=str(settings.home), embedding_model="hashing-test-only")
    held = resource.vector_store()  # a long-lived process's client, connected before the restart below
    assert held.url == state["url"] and held.client().heartbeat() > 0
    # Its warnings and errors only, no INFO line (one a request by default; RUST_LOG=info here gives some).
    assert b" INFO" not in (settings.chroma_path / "server.log").read_bytes()

    stopped = services.stop_services(settings)
    assert stopped["stopped"] is True
    assert stopped["chroma"]["stopped"] is True and stopped["chroma"]["pid"] == state["pid"]
    assert stopped["postgres"]["stopped"] is True
    assert not services.pid_alive(state["pid"]) and not services.chroma_heartbeat(state["url"])
    assert services.chroma_state(settings) is None
    again = services.stop_services(settings)
    assert again["stopped"] is False and again["chroma"]["stopped"] is False

    # Started again on demand by the next process, behind the same door, with the data kept.
    restarted = _in_another_process(
        settings.home,
        "import json\n"
        "from memory_pipelines.lib.infra.services import ensure_services\n"
        "from memory_pipelines.lib.infra.settings import Settings\n"
        "print(json.dumps({'url': ensure_services(Settings.from_env()).chroma_url}))\n",
    )
    assert restarted["url"] == state["url"] and services.chroma_heartbeat(restarted["url"])
    assert services.chroma_state(settings)["pid"] != state["pid"]
    # The client made before the restart needs nothing re-resolved: the door's path is the same.
    assert held.client().heartbeat() > 0 and held.client().list_collections() is not None


def test_chroma_start_failure_names_chroma_with_the_log_tail(tmp_path, monkeypatch):
    settings = settings_for(tmp_path / "home")
    fake = tmp_path / "chroma"
    fake.write_text("#!/bin/sh\necho 'no server today' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(services, "chroma_binary", lambda: fake)
    with pytest.raises(services.ServiceError) as err:
        services.ensure_chroma(settings)
    assert err.value.field == "chroma" and "no server today" in err.value.message
    assert services.chroma_state(settings) is None


def test_dagster_yaml_is_ours_once_then_the_users(fresh_home, tmp_path):
    settings, _ = fresh_home
    services.ensure_services(settings)
    path = settings.dagster_home / "dagster.yaml"
    shipped = services.DAGSTER_YAML.read_text()
    assert path.read_text() == shipped
    assert "postgresql" not in shipped and "@" not in shipped and "password" not in shipped.lower()
    assert "env: MEMORY_PIPELINES_DAGSTER_PG_URL" in shipped
    assert os.environ[ENV_DAGSTER_PG_URL].startswith("postgresql+psycopg2://")

    edited = shipped.replace("max_concurrent_runs: 4", "max_concurrent_runs: 2") + "# mine\n"
    path.write_text(edited)
    services.ensure_services(settings)
    assert path.read_text() == edited, "a user's dagster.yaml is never overwritten"

    old = tmp_path / "old-dagster-home"
    old.mkdir()
    (old / "dagster.yaml").write_text(
        "# Written by memory-pipelines; regenerated when the database location changes.\n"
        'storage:\n  postgres:\n    postgres_url: "postgresql+psycopg2://postgres@/dagster?host=%2Ftmp"\n'
    )
    services.install_dagster_yaml(old)
    assert (old / "dagster.yaml").read_text() == shipped, "the file we used to regenerate is replaced once"

    # A copy of an earlier shipped file, never edited, is ours too; the same file edited is the user's.
    earlier = (SNAPSHOTS / "dagster-yaml-8160a84.yaml").read_bytes()
    assert earlier != shipped.encode()
    (old / "dagster.yaml").write_bytes(earlier)
    services.install_dagster_yaml(old)
    assert (old / "dagster.yaml").read_text() == shipped, "an unedited earlier shipped file is replaced"
    (old / "dagster.yaml").write_bytes(earlier + b"# mine\n")
    services.install_dagster_yaml(old)
    assert (old / "dagster.yaml").read_bytes() == earlier + b"# mine\n", "an edited one is the user's"


def test_shipped_dagster_yaml_validates_and_queues_one_run_per_tenant(fresh_home, tmp_path):
    import dagster as dg
    from dagster._core.instance.config import dagster_instance_config
    from dagster._core.run_coordinator import QueuedRunCoordinator

    settings, _ = fresh_home
    endpoints = services.ensure_services(settings)
    home = tmp_path / "dagster-home"
    home.mkdir()
    services.install_dagster_yaml(home)
    # Dagster's own schema: a typo in the shipped file fails here.
    config, _cls = dagster_instance_config(str(home))
    assert config["storage"]["custom"]["config"]["postgres_url"] == {"env": ENV_DAGSTER_PG_URL}
    assert os.environ[ENV_DAGSTER_PG_URL] == endpoints.dagster_url
    with dg.DagsterInstance.from_config(str(home)) as instance:
        coordinator = instance.run_coordinator
        assert isinstance(coordinator, QueuedRunCoordinator)
        queue = coordinator.get_run_queue_config()
        assert queue is not None and queue.max_concurrent_runs == 4
        limits = {limit["key"]: limit for limit in queue.tag_concurrency_limits}
        for key in ("dagster/partition", "memory_pipelines/tenant"):
            assert limits[key]["limit"] == 1 and limits[key]["value"] == {"applyLimitPerUniqueValue": True}
        assert instance.run_monitoring_enabled
        assert not instance.telemetry_enabled
        instance.get_runs(limit=1)  # the storage answers on the URL from the environment


def test_the_shipped_storage_keeps_its_connections_where_dagster_postgres_opens_one_per_call(fresh_home, tmp_path):
    """Every process that opens the instance of the shipped dagster.yaml (the daemon, its code
    servers and run workers, the webserver, `dagster` commands) keeps a connection per storage;
    `storage: postgres:` with the same config opens one per call (an idle daemon: about 940 a minute)."""
    import dagster as dg

    from memory_pipelines.launch.dagster_internals import HELD_STORAGES, HeldPostgresStorage, instance_conninfo

    settings, _ = fresh_home
    services.ensure_services(settings)
    held, plain = tmp_path / "held", tmp_path / "plain"
    for home in (held, plain):
        home.mkdir()
        services.install_dagster_yaml(home)
    shipped = (plain / "dagster.yaml").read_text()
    block = shipped[shipped.index("storage:\n") : shipped.index("\n\n", shipped.index("storage:\n"))]
    (plain / "dagster.yaml").write_text(
        shipped.replace(block, "storage:\n  postgres:\n    postgres_url:\n      env: " + ENV_DAGSTER_PG_URL)
    )

    opened = {}
    for home in (held, plain):
        with dg.DagsterInstance.from_config(str(home)) as instance:
            conninfo = instance_conninfo(instance)
            assert conninfo is not None
            assert isinstance(instance.get_ref().storage, HeldPostgresStorage) == (home == held)
            assert (instance.run_storage in HELD_STORAGES) == (home == held)  # hold_connections leaves it
            before = database_sessions(conninfo)
            for _ in range(20):  # what a daemon's threads ask, tick after tick
                instance.get_runs(limit=1)
                instance.all_instigator_state()
                instance.get_latest_materialization_events([dg.AssetKey("memory_embeddings")])
            opened[home.name] = database_sessions(conninfo) - before - 1
    assert opened["plain"] >= 60, opened  # the control: dagster-postgres' own pool opens one per call
    assert opened["held"] <= 5, opened  # one per storage (3 here), and room for one replaced


def test_a_processs_instances_of_the_shipped_storage_share_its_connections_across_a_restart(fresh_home, tmp_path):
    """A code server opens an instance for each sensor tick and run. With the shipped storage every
    instance of the process shares one engine, so the later ones open no session (each opened ten
    before); a kept connection idle for a second is pinged before use, so a server restarted
    meanwhile costs a reconnection, not a failed call."""
    import dagster as dg

    from memory_pipelines.launch.dagster_internals import instance_conninfo

    settings, _ = fresh_home
    services.ensure_services(settings)
    services.install_dagster_yaml(tmp_path)

    def ask(instance: dg.DagsterInstance) -> list[str]:  # what a sensor tick asks
        instance.all_instigator_state()
        instance.get_latest_materialization_events([dg.AssetKey("memory_embeddings")])
        return [run.run_id for run in instance.get_runs(limit=5)]

    with dg.DagsterInstance.from_config(str(tmp_path)) as first:
        conninfo = instance_conninfo(first)
        assert conninfo is not None
        runs = ask(first)
    before = database_sessions(conninfo)
    for _ in range(10):
        with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
            assert ask(instance) == runs
    assert database_sessions(conninfo) - before - 1 == 0

    services.stop_services(settings)  # every kept connection of this process is now closed by the server
    services.ensure_services(settings)
    with dg.DagsterInstance.from_config(str(tmp_path)) as after:
        assert instance_conninfo(after) == conninfo
        assert ask(after) == runs


def test_exported_dagster_url_follows_the_server_and_a_users_value_wins(fresh_home, monkeypatch):
    settings, _ = fresh_home
    current = services.ensure_services(settings).dagster_url
    stale = "postgresql+psycopg2://postgres@/dagster?host=%2Fgone"
    monkeypatch.setattr(services, "_exported_dagster_url", stale)
    monkeypatch.setenv(ENV_DAGSTER_PG_URL, stale)
    # Settings.from_env reads back what we exported earlier (an old socket): still ours, refreshed.
    refreshed = services.ensure_services(
        Settings.from_env({"MEMORY_PIPELINES_HOME": str(settings.home), ENV_DAGSTER_PG_URL: stale})
    )
    assert refreshed.dagster_url == current == os.environ[ENV_DAGSTER_PG_URL]
    # A value the user set is left alone and used.
    mine = current + "&application_name=mine"
    monkeypatch.setenv(ENV_DAGSTER_PG_URL, mine)
    user = services.ensure_services(
        Settings.from_env({"MEMORY_PIPELINES_HOME": str(settings.home), ENV_DAGSTER_PG_URL: mine})
    )
    assert user.dagster_url == mine and os.environ[ENV_DAGSTER_PG_URL] == mine


def test_a_child_on_another_home_computes_its_own_dagster_url(fresh_home, tmp_path):
    """A child inherits our exported URL with its marker: on another HOME it exports that HOME's."""
    settings, _ = fresh_home
    ours = services.ensure_services(settings).dagster_url
    other_home = tmp_path / "other-home"
    code = (
        "import json, os\n"
        "from memory_pipelines.lib.infra.services import ensure_services, stop_services\n"
        "from memory_pipelines.lib.infra.settings import Settings\n"
        "s = Settings.from_env()\n"
        "e = ensure_services(s)\n"
        "print(json.dumps({'url': e.dagster_url, 'env': os.environ['MEMORY_PIPELINES_DAGSTER_PG_URL'],"
        " 'stop': stop_services(s)['stopped']}))\n"
    )
    env = {**os.environ, "MEMORY_PIPELINES_HOME": str(other_home)}
    assert env[ENV_DAGSTER_PG_URL] == ours
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child["url"] == child["env"] != ours and str(other_home) in child["url"].replace("%2F", "/")
    assert child["stop"] is True


# ---------------------------------------------------------------------------------------------
# Two processes on one tenant


def _worker(home: str, tenant: str, label: str, seconds: float, out: Any) -> None:
    """Loops over every kind of work on one tenant; reports operations done and every exception."""

    from memory_pipelines.lib.forget.deletion import DeletionService
    from memory_pipelines.lib.runtime import open_store
    from memory_pipelines.lib.stores.derived import open_derived
    from memory_pipelines.lib.stores.embedding import HashingEmbedder
    from memory_pipelines.lib.stores.recall.recall import MODES

    ops: dict[str, int] = {}
    errors: list[str] = []
    forgotten: list[str] = []

    def attempt(name: str, fn: Any) -> Any:
        try:
            result = fn()
        except Exception as exc:
            errors.append(f"{label} {name}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
            return None
        ops[name] = ops.get(name, 0) + 1
        return result

    try:
        settings = Settings.from_env({"MEMORY_PIPELINES_HOME": home})
        store = open_store(settings)
        derived = open_derived(settings, store, embedder=HashingEmbedder())
        deletion = DeletionService(derived)
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            n += 1
            gone = f"gone-{label}-{n}"
            attempt("write", lambda n=n: store.write(tenant_id=tenant, user_id=f"keep-{label}", text=f"kept {n}"))
            attempt("write", lambda gone=gone: store.write(tenant_id=tenant, user_id=gone, text=f"throwaway {gone}"))
            attempt("sync_all", lambda: derived.sync_all(tenant_id=tenant))
            for mode in MODES:
                attempt(
                    f"recall_{mode}",
                    lambda mode=mode: derived.recaller.recall(
                        tenant_id=tenant, user_id=f"keep-{label}", query="kept", mode=mode
                    ),
                )

            def forget(gone: str = gone) -> None:
                job = deletion.request(tenant_id=tenant, subject=gone)
                deletion.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
                state = deletion.status(job_id=job["job_id"])["state"]
                if state != "COMPLETE":
                    raise AssertionError(f"forget of {gone} ended {state}")
                forgotten.append(gone)

            attempt("forget", forget)
            attempt("analytics_rebuild", lambda: derived.analytics.rebuild(store=store, tenant_id=tenant))
            attempt(
                "analytics_query",
                lambda: derived.analytics.query("SELECT count(*) FROM memories", tenant_id=tenant),
            )
        store.close()
    except Exception as exc:
        errors.append(f"{label} setup: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
    out.put({"label": label, "ops": ops, "errors": errors, "forgotten": forgotten})


@pytest.mark.slow
def test_two_processes_refreshing_recalling_and_forgetting_one_tenant_at_once_produce_no_lock_error(fresh_home):
    # A HOME of its own: the churn (about 50 erasures) stays out of the session's Chroma files,
    # which other tests scan byte by byte.
    session_settings, _ = fresh_home
    services.ensure_services(session_settings)
    tenant = "t-mp-" + uuid.uuid4().hex[:10]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    workers = [
        ctx.Process(target=_worker, args=(str(session_settings.home), tenant, label, WORKER_SECONDS, out))
        for label in ("a", "b")
    ]
    for worker in workers:
        worker.start()
    results = [out.get(timeout=WORKER_SECONDS + 150) for _ in workers]
    for worker in workers:
        worker.join(30)
    errors = [e for r in results for e in r["errors"]]
    summary = {r["label"]: {"ops": sum(r["ops"].values()), **r["ops"]} for r in results}
    print(json.dumps(summary))
    assert not [e for e in errors if "lock" in e.lower()], "\n\n".join(errors)
    assert errors == [], "\n\n".join(errors)
    for r in results:
        assert sum(r["ops"].values()) >= MIN_OPERATIONS, summary
        assert r["ops"].get("forget", 0) >= 1 and r["ops"].get("sync_all", 0) >= 1, summary

    # Afterwards every current version the vector index has lineage for has its vector (no
    # process's stale copy of the index wrote over the other's), and no forgotten subject is left.
    from memory_pipelines.lib.runtime import open_store
    from memory_pipelines.lib.stores import lineage
    from memory_pipelines.lib.stores.derived import open_derived
    from memory_pipelines.lib.stores.embedding import HashingEmbedder

    store = open_store(session_settings)
    try:
        derived = open_derived(session_settings, store, embedder=HashingEmbedder())
        current = {cv.record_id: cv for cv in store.current_versions(tenant_id=tenant)}
        with store.transaction() as conn:
            edges = set(lineage.records_of_store(conn, tenant_id=tenant, store="chroma"))
        vectors = derived.vectors.ids(tenant)
    finally:
        store.close()
    assert {r for r in edges if r in current} <= vectors
    forgotten = {s for r in results for s in r["forgotten"]}
    assert not {cv.user_id for cv in current.values()} & forgotten


def test_a_busy_chroma_server_is_waited_for_and_a_wedged_one_replaced_never_doubled(tmp_path, monkeypatch):
    """A recorded server that is ours but does not answer (here: stopped with SIGSTOP) is waited for;
    one that stays silent is stopped before another starts, so two servers never share the files."""
    import signal

    import psutil

    settings = settings_for(tmp_path / "wedged-home")
    try:
        first = services.ensure_chroma(settings)
        old_pid = int(services.chroma_state(settings)["pid"])
        os.kill(old_pid, signal.SIGSTOP)
        monkeypatch.setattr(services, "CHROMA_START_SECONDS", 3.0)
        second = services.ensure_chroma(settings)
        new_pid = int(services.chroma_state(settings)["pid"])
        assert new_pid != old_pid and second == first and services.chroma_heartbeat(second)
        assert not services.pid_alive(old_pid)
        on_path = [
            p.pid
            for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and str(settings.chroma_path) in p.info["cmdline"]
        ]
        assert on_path == [new_pid], on_path
    finally:
        services.stop_chroma(settings)
