"""Shared fixtures: one embedded PostgreSQL per test session (real engine), unique tenants per test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from memory_pipelines.lib import services
from memory_pipelines.lib.derived import DerivedStores, open_derived
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.services import (
    Endpoints,
    ensure_services,
    export_dagster_url,
    stop_chroma,
    stop_services,
)
from memory_pipelines.lib.settings import Settings
from memory_pipelines.lib.store import MemoryStore

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
        os.environ.pop(services.ENV_DAGSTER_PG_URL, None)
        os.environ.pop(services.ENV_DAGSTER_PG_URL_EXPORTED, None)
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
def tenant() -> str:
    """A fresh tenant id per test: tests share one server and stay out of each other's way."""
    return "t-" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def cli_env(
    endpoints: Endpoints, session_settings: Settings, store: MemoryStore, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The CLI against the session server through MEMORY_PIPELINES_PG_URL: no second server to start.

    It shares the session's master key, as every process sharing one database must; a HOME per module.
    """
    home = tmp_path_factory.mktemp("cli-home")
    (home / "keys").mkdir(mode=0o700)
    shutil.copy2(session_settings.master_key_path, home / "keys" / "master.key")
    env = {"MEMORY_PIPELINES_PG_URL": endpoints.store_conninfo, "MEMORY_PIPELINES_CHROMA_URL": endpoints.chroma_url}
    return {"home": home, "env": env}


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
