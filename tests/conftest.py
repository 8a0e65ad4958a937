"""Shared fixtures: one embedded PostgreSQL per test session (real engine), unique tenants per test."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from memory_pipelines.lib.derived import DerivedStores, open_derived
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.services import Endpoints, ensure_services, stop_services
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


@pytest.fixture(scope="session")
def session_settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    settings = settings_for(tmp_path_factory.mktemp("home"))
    yield settings
    stop_services(settings)


@pytest.fixture(scope="session")
def endpoints(session_settings: Settings) -> Endpoints:
    return ensure_services(session_settings)


@pytest.fixture(scope="session")
def store(session_settings: Settings, endpoints: Endpoints) -> Iterator[MemoryStore]:
    memory_store = open_store(session_settings, endpoints)
    yield memory_store
    memory_store.close()


@pytest.fixture(scope="session")
def derived(session_settings: Settings, store: MemoryStore) -> DerivedStores:
    """Every derived store on the session's engines (the embedding model loads once)."""
    return open_derived(session_settings, store)


@pytest.fixture
def tenant() -> str:
    """A fresh tenant id per test: tests share one server and stay out of each other's way."""
    return "t-" + uuid.uuid4().hex[:12]


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
