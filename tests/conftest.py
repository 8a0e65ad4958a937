"""Shared fixtures: one embedded PostgreSQL per test session (real engine), unique tenants per test."""

from __future__ import annotations

import compileall
import io
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from memory_pipelines.lib.infra import processes, services
from memory_pipelines.lib.infra import settings as infra_settings
from memory_pipelines.lib.infra.services import (
    Endpoints,
    ensure_services,
    export_dagster_url,
    stop_chroma,
    stop_services,
)
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores.derived import DerivedStores, open_derived
from tests.support import durations, instances
from tests.support.cpu import CpuByModule, cpu_seconds

ROW_COUNT_TABLES = (
    "memory.tenants",
    "memory.subjects",
    "memory.teams",
    "memory.team_members",
    "memory.memories",
    "memory.memory_versions",
    "keystore.tenant_keys",
    "keystore.subject_keys",
)


CLI = Path(sys.executable).parent / "memory-pipelines"


def settings_for(home: Path) -> Settings:
    return Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})


# -- no process outlives the test run -----------------------------------------------------------

# Set by the controller (the only process without xdist) for the run; every process the tests
# start inherits it, however far it is reparented.
ENV_TEST_RUN = "MEMORY_PIPELINES_TEST_RUN"
# What the guard waits for the processes of the run to end by themselves (a code server ends a
# second or two after its last run) before it names them.
LEAK_GRACE_SECONDS = 10.0


def _is_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


# The run's HOMEs (PostgreSQL's data and WAL, Chroma's files, backups: about 3 GB, written, fsynced
# and deleted) go to memory when it has room: what the tests read and erase is files, never a
# medium. On the ext4 root of these machines (mounted with `discard`) the block layer's kernel threads
# spent on them CPU the tests needed (figures in docs/development.md). pytest's `--basetemp` or its
# documented PYTEST_DEBUG_TEMPROOT still choose.
MEMORY_TEMP_ROOT = Path("/dev/shm")
MEMORY_TEMP_MIN_FREE = 8 << 30


def memory_temp_root(root: Path = MEMORY_TEMP_ROOT, min_free: int = MEMORY_TEMP_MIN_FREE) -> Path | None:
    """`root` when it is a writable directory with `min_free` bytes free, else None (pytest's default)."""
    try:
        stat = os.statvfs(root)
    except OSError:
        return None
    if not os.access(root, os.W_OK | os.X_OK) or stat.f_bavail * stat.f_frsize < min_free:
        return None
    return root


# Hundreds of processes the tests start import these from their sources. Where PYTHONDONTWRITEBYTECODE
# is set (these machines set it) none keeps what it compiled, so each compiled them again: about 0.1
# CPU-seconds a command and 0.2 a Dagster process (docs/development.md). Compiled once, here.
COMPILED = (Path(__file__).resolve().parents[1] / "memory_pipelines", Path(__file__).resolve().parent / "support")


def pytest_configure(config: pytest.Config) -> None:
    if _is_controller(config):
        os.environ[ENV_TEST_RUN] = uuid.uuid4().hex  # before xdist starts the workers: they inherit it
        for package in COMPILED:
            compileall.compile_dir(package, quiet=2)  # a checkout it cannot write only costs the time
        if config.option.basetemp is None and "PYTEST_DEBUG_TEMPROOT" not in os.environ:
            root = memory_temp_root()
            if root is not None:
                os.environ["PYTEST_DEBUG_TEMPROOT"] = str(root)  # read when the base is first made


CPU = CpuByModule()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    before = cpu_seconds()
    try:
        return (yield)
    finally:
        CPU.add(item.nodeid, cpu_seconds() - before)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    """A test that leaves a DagsterInstance entered fails here, not a later one (tests/support/instances.py)."""
    with instances.entered() as open_now:
        try:
            result = yield
        finally:
            left = instances.leave(open_now)
    if left:
        raise AssertionError(f"the test entered Dagster instances it never left (use `with`): {left}")
    return result


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """A worker ended: its CPU per module joins the controller's (xdist hook)."""
    dumped = getattr(node, "workeroutput", {}).get("cpu_by_module")
    if dumped:
        CPU.merge(dumped)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _is_controller(config) and CPU.seconds:
        terminalreporter.write_sep("=", "CPU-seconds by test module (tests/support/cpu.py)")
        for line in CPU.lines():
            terminalreporter.write_line(line)


def run_processes(basetemp: Path, run: str) -> list[tuple[processes.Proc, str]]:
    """Live processes of this test run, each with why it is one: a descendant of this process, or
    one whose command line or MEMORY_PIPELINES_HOME / DAGSTER_HOME names the run's temporary
    directory (every test HOME is under it), or whose environment carries the run's mark."""
    table = processes.processes()
    spared = processes.ancestry(os.getpid(), table)
    # This process's own multiprocessing helpers end when it does, by design: they outlive nothing.
    spared |= {proc.pid for proc in table if proc.ppid == os.getpid() and _multiprocessing_helper(proc)}
    found = {proc.pid: (proc, "started by the test session") for proc in processes.descendants(os.getpid(), table)}
    for proc in table:
        if proc.pid in found or proc.pid in spared:
            continue
        env = processes.process_environ(proc.pid)
        if processes.names_path(proc.command, basetemp):
            found[proc.pid] = (proc, f"its command line names {basetemp}")
        elif any(processes.names_path(env.get(name, ""), basetemp) for name in processes.HOME_VARIABLES):
            found[proc.pid] = (proc, f"its HOME is under {basetemp}")
        elif run and env.get(ENV_TEST_RUN) == run:
            found[proc.pid] = (proc, "started by the test run")
    return [found[pid] for pid in sorted(found) if pid not in spared]


def _multiprocessing_helper(proc: processes.Proc) -> bool:
    """multiprocessing's resource tracker or fork server: each exits when the process it serves does."""
    return any(
        f"multiprocessing.{name} import main" in arg for arg in proc.args for name in ("resource_tracker", "forkserver")
    )


def outlived(procs: Sequence[tuple[processes.Proc, str]], grace: float) -> list[tuple[processes.Proc, str]]:
    """The processes still running after `grace` seconds."""
    left = {proc.pid for proc in processes.wait_for_exit([proc for proc, _ in procs], grace)}
    return [(proc, why) for proc, why in procs if proc.pid in left]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest modules first (`tests/support/durations.py` says why), each in its file order."""
    recorded = durations.load()
    slow = {durations.module_of(item.nodeid) for item in items if item.get_closest_marker("slow")}
    weight = {
        module: recorded.get(module, durations.UNRECORDED_SLOW_SECONDS if module in slow else 0.0)
        for module in {durations.module_of(item.nodeid) for item in items}
    }
    items.sort(key=lambda item: -weight[durations.module_of(item.nodeid)])  # stable: file order within


@pytest.hookimpl(trylast=True)  # after xdist's own hook has ended the workers
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run, naming each one, if a process the tests started outlives them; then end it."""
    config = session.config
    if not _is_controller(config):
        config.workeroutput["cpu_by_module"] = CPU.dumps()  # type: ignore[attr-defined]
        return
    basetemp = config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]
    leaked = outlived(run_processes(basetemp, os.environ.get(ENV_TEST_RUN, "")), LEAK_GRACE_SECONDS)
    if not leaked:
        return
    lines = [f"pid {proc.pid} (parent {proc.ppid}): {proc.describe()['command']}  <- {why}" for proc, why in leaked]
    ended = processes.end_processes([proc for proc, _ in leaked], timeout=5.0)
    lines.append(f"ended now: {[entry['pid'] for entry in ended if entry['ended']]}")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", f"{len(leaked)} process(es) outlived the tests", red=True, bold=True)
        for line in lines:
            reporter.write_line(line, red=True)
        reporter.stats.setdefault("leaked process", []).extend(lines[:-1])  # counted in the summary line
    else:
        sys.stderr.write("\n".join(lines) + "\n")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def _no_chroma_server_outlives_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every HOME a test makes without MEMORY_PIPELINES_CHROMA_URL gets a `chroma run` server that
    outlives its process, as in production; the ones under this session's temporary directory
    are stopped at the end (a fixture that only points PostgreSQL elsewhere never stops them)."""
    yield
    for state in tmp_path_factory.getbasetemp().rglob("chroma/server.json"):
        stop_chroma(settings_for(state.parent.parent))


@pytest.fixture(scope="session")
def session_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    settings = settings_for(tmp_path_factory.mktemp("home"))
    yield settings
    stop_services(settings)


_session_endpoints: list[Endpoints] = []


@pytest.fixture(scope="session")
def endpoints(session_settings: Settings) -> Endpoints:
    found = ensure_services(session_settings)
    _session_endpoints.append(found)
    return found


@pytest.fixture(autouse=True)
def _no_disposed_instance_as_defs_state_storage() -> Iterator[None]:
    """Each test loads definitions with no defs-state storage left by an earlier test's instance.

    Dagster 1.13's `DagsterInstance.__enter__` makes the instance's storage the current one (a
    ContextVar) and `__exit__` restores what was current before it. Instance contexts left out of
    order (a fixture's instance entered before a test's and left first) restore a disposed one,
    and once it is collected the next definitions load in that worker fails with "Attempted to
    resolve undefined DagsterInstance weakref" (seen in CI, depending on which tests ran before on
    the worker). An instance never left at all does it mid-test, whenever it is collected: that the
    test's call fails instead (tests/support/instances.py). Dagster has no public way to reset the
    storage, hence its private module here, in tests only."""
    from dagster._core.storage.defs_state.base import set_defs_state_storage

    with set_defs_state_storage(None):
        yield


@pytest.fixture(scope="module", autouse=True)
def _no_disposed_instance_as_defs_state_storage_for_the_module() -> Iterator[None]:
    """The same for a module's fixtures, set up before any test's: with whole modules per worker, a
    module-scoped `defs()` (tests/test_defs.py) once loaded after a module that left a disposed one."""
    from dagster._core.storage.defs_state.base import set_defs_state_storage

    with set_defs_state_storage(None):
        yield


@pytest.fixture(autouse=True)
def _home_variables_restored() -> Iterator[None]:
    """Commands run in-process point HOME and DAGSTER_HOME at their HOME; later tests start clean."""
    saved = {name: os.environ.get(name) for name in ("MEMORY_PIPELINES_HOME", "DAGSTER_HOME")}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _session_dagster_url() -> None:
    """dagster.yaml reads MEMORY_PIPELINES_DAGSTER_PG_URL, one value per process, and a test that
    runs ensure_services on a HOME of its own exports that HOME's: each test starts with the
    session HOME's again, so an instance loaded from session_settings.dagster_home finds its database."""
    if _session_endpoints:
        # Forget what earlier tests exported or set (a monkeypatched value restored after a test
        # would otherwise pass for the user's): the session's URL is ours again.
        os.environ.pop(infra_settings.ENV_DAGSTER_PG_URL, None)
        os.environ.pop(infra_settings.ENV_DAGSTER_PG_URL_EXPORTED, None)
        services._exported_dagster_url = None
        services._exported_before.clear()
        export_dagster_url(_session_endpoints[0].dagster_url)


@pytest.fixture(scope="session")
def store(session_settings: Settings, endpoints: Endpoints) -> Iterator[MemoryStore]:
    memory_store = open_store(session_settings, endpoints)
    yield memory_store
    memory_store.close()


@pytest.fixture(scope="session")
def derived(session_settings: Settings, endpoints: Endpoints, store: MemoryStore) -> DerivedStores:
    """Every derived store on the session's engines (the embedding model loads once); vectors on the
    session HOME's Chroma server, as every product path uses them."""
    return open_derived(session_settings, store, endpoints=endpoints)


@pytest.fixture
def scratch_database(store: MemoryStore) -> Iterator[str]:
    """A database of its own on the session server (dropped afterwards), e.g. for an upgrade."""
    name = "mp_scratch_" + uuid.uuid4().hex[:8]
    with psycopg.connect(store.conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(store.conninfo, dbname=name)
    finally:
        with psycopg.connect(store.conninfo, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def tenant() -> str:
    """A fresh tenant id per test: tests share one server and stay out of each other's way."""
    return "t-" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def cli_env(
    endpoints: Endpoints, session_settings: Settings, store: MemoryStore, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The CLI against the session server through MEMORY_PIPELINES_PG_URL: no second server to start.

    It shares the session's master key and key vault, as every process sharing one database must; a
    HOME per module.
    """
    home = tmp_path_factory.mktemp("cli-home")
    (home / "keys").mkdir(mode=0o700)
    shutil.copy2(session_settings.master_key_path, home / "keys" / "master.key")
    env = {
        "MEMORY_PIPELINES_PG_URL": endpoints.store_conninfo,
        "MEMORY_PIPELINES_CHROMA_URL": endpoints.chroma_url,
        "MEMORY_PIPELINES_KEY_VAULT": str(session_settings.key_vault_path),
    }
    yield {"home": home, "env": env}
    # The module's CLI commands left the HOME's warm code server running; the servers are external.
    stop_services(Settings.from_env({"MEMORY_PIPELINES_HOME": str(home), **env}))


def row_counts(conninfo: str) -> dict[str, int]:
    """Rows in every store table; equal before and after a rejected request means nothing was written."""
    with psycopg.connect(conninfo) as conn:
        return {
            table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]  # type: ignore[index]
            for table in ROW_COUNT_TABLES
        }


def run_cli(
    *args: str, home: Path, env: dict[str, str] | None = None, input_text: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Runs the installed `memory-pipelines` entry point in a subprocess, as a user would."""
    full_env = {**os.environ, "MEMORY_PIPELINES_HOME": str(home), **(env or {})}
    return subprocess.run(
        [str(CLI), *args],
        capture_output=True,
        text=True,
        env=full_env,
        input=input_text,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def cli_here(
    cli_env: dict[str, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """`run_cli` through `cli.main(argv)` in this process, for a check that ends before any run or
    process starts (argument and input checks: exit code, stdout, stderr), where a process of its
    own proves nothing more and costs a second or more to import Dagster."""
    from memory_pipelines import cli

    def run(*args: str, input_text: str | None = None) -> subprocess.CompletedProcess[str]:
        with monkeypatch.context() as patched:
            patched.setenv("MEMORY_PIPELINES_HOME", str(cli_env["home"]))
            for name, value in cli_env["env"].items():
                patched.setenv(name, value)
            stdin = io.TextIOWrapper(io.BytesIO((input_text or "").encode("utf-8")), encoding="utf-8")
            patched.setattr(sys, "stdin", stdin)
            capsys.readouterr()
            code = cli.main(list(args))  # main returns its code; anything escaping it fails the test
            out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["memory-pipelines", *args], code, out, err)

    return run


@pytest.fixture
def kms_key(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A KMS master key on moto's server (127.0.0.1), reached through the standard boto3 variables
    a deployment sets for its KMS region, endpoint and credentials."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for name, value in {
        "AWS_ENDPOINT_URL_KMS": f"http://{host}:{port}",
        "AWS_DEFAULT_REGION": "eu-west-1",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
    }.items():
        monkeypatch.setenv(name, value)
    yield boto3.client("kms").create_key(Description="memory-pipelines master")["KeyMetadata"]["KeyId"]
    server.stop()
