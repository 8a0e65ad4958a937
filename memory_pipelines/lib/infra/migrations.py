"""Idempotent, versioned schema migrations from `assets/migrations/NNNN_name.sql`."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg

from memory_pipelines.lib.infra.paths import ASSETS_DIR

__all__ = [
    "MIGRATIONS_DIR",
    "available",
    "migrate",
]

MIGRATIONS_DIR = ASSETS_DIR / "migrations"
_NAME_RE = re.compile(r"(\d{4})_[a-z0-9_]+\.sql")
# Any constant works; it only has to be the same in every process that migrates.
_MIGRATION_LOCK = 7_150_433_210


def available(directory: Path = MIGRATIONS_DIR) -> list[tuple[int, str, Path]]:
    found = []
    for path in sorted(directory.iterdir()):
        match = _NAME_RE.fullmatch(path.name)
        if match:
            found.append((int(match.group(1)), path.stem, path))
    return found


def migrate(conn: psycopg.Connection, directory: Path = MIGRATIONS_DIR) -> list[str]:
    """Apply every migration not yet applied, all or none, under an advisory lock; returns what ran."""
    applied_now: list[str] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS public.memory_pipelines_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {row[0] for row in conn.execute("SELECT version FROM public.memory_pipelines_migrations")}
        for version, name, path in available(directory):
            if version in done:
                continue
            with conn.transaction():  # a savepoint per file: a failing file names itself
                conn.execute(path.read_text(encoding="utf-8"))
                conn.execute(
                    "INSERT INTO public.memory_pipelines_migrations (version, name) VALUES (%s, %s)",
                    (version, name),
                )
            applied_now.append(name)
    return applied_now
