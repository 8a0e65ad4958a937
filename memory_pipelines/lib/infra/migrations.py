"""Idempotent, versioned schema migrations from `assets/migrations/NNNN_name.sql`, and the downgrade gate.

A migration that changes what deletion, consent or keys mean to the code that reads the database
says so in a line of its own, `-- gate: <what older code would get wrong>`. `migrate` records that
line with the migration, and refuses to go on when the database holds a gated migration this code
does not know: the code is older than the database, and would read and write as if the migration
had not happened (a forget that leaves the rows of a table it never heard of). So after a rollback of
the software, memory reads and writes stay closed until a release that knows every gated migration
runs; `memory-pipelines stop` and `env` never migrate, and still work. Code from before the gate
checks nothing: the gate protects rollbacks to releases that have it.
"""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import psycopg

from memory_pipelines.lib.infra.errors import ConflictError
from memory_pipelines.lib.infra.paths import ASSETS_DIR

__all__ = [
    "MIGRATIONS_DIR",
    "DowngradeRefused",
    "available",
    "gate_of",
    "migrate",
    "release",
]

MIGRATIONS_DIR = ASSETS_DIR / "migrations"
_NAME_RE = re.compile(r"(\d{4})_[a-z0-9_]+\.sql")
_GATE_RE = re.compile(r"^-- gate: (.+)$", re.MULTILINE)
# Any constant works; it only has to be the same in every process that migrates.
_MIGRATION_LOCK = 7_150_433_210


def available(directory: Path = MIGRATIONS_DIR) -> list[tuple[int, str, Path]]:
    found = []
    for path in sorted(directory.iterdir()):
        match = _NAME_RE.fullmatch(path.name)
        if match:
            found.append((int(match.group(1)), path.stem, path))
    return found


class DowngradeRefused(ConflictError):
    """The database holds a gated migration this code does not know: it is older than the database."""

    def __init__(self, newer: list[tuple[str, str]], known: str | None) -> None:
        self.newer = newer
        name, gate = newer[0]
        super().__init__(
            "release",
            f"this database was migrated by a newer release: {name} ({gate}). This code is release"
            f" {release()} and knows migrations up to {known or 'none'}, so it would read and forget as if"
            f" that had not happened. Run a release that includes {newer[-1][0]} (memory reads and writes"
            " stay closed until then; `memory-pipelines stop` still works)",
        )


def release() -> str:
    """This code's release (the installed package's version)."""
    try:
        return metadata.version("memory_pipelines")
    except metadata.PackageNotFoundError:
        return "unknown"


def gate_of(path: Path) -> str | None:
    """What older code would get wrong on a database with this migration (its `-- gate:` line), if anything."""
    found = _GATE_RE.search(path.read_text(encoding="utf-8"))
    return found.group(1).strip() if found else None


def migrate(conn: psycopg.Connection, directory: Path | None = None) -> list[str]:
    """Apply every migration not yet applied, all or none, under an advisory lock; returns what ran.

    Raises DowngradeRefused, applying nothing, when the database holds a gated migration that is not
    in `directory` (this code's migrations by default)."""
    known = available(directory or MIGRATIONS_DIR)
    applied_now: list[str] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS public.memory_pipelines_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        # Since the gate: what each gated migration changes, for older code to read and refuse. Added
        # once (an ALTER needs the table's owner and its exclusive lock: not on every open).
        has_gate = conn.execute(
            "SELECT 1 FROM information_schema.columns WHERE table_schema = 'public'"
            " AND table_name = 'memory_pipelines_migrations' AND column_name = 'gate'"
        ).fetchone()
        if has_gate is None:
            conn.execute("ALTER TABLE public.memory_pipelines_migrations ADD COLUMN gate text")
        applied = conn.execute("SELECT version, name, gate FROM public.memory_pipelines_migrations ORDER BY version")
        done = {row[0]: (row[1], row[2]) for row in applied.fetchall()}
        ours = {version for version, _, _ in known}
        newer = [(name, gate) for version, (name, gate) in sorted(done.items()) if version not in ours and gate]
        if newer:
            raise DowngradeRefused(newer, known[-1][1] if known else None)
        # A gate line this code has for a migration applied without it (by a build before the line).
        for version, _, path in known:
            gate = gate_of(path)
            if version in done and gate and done[version][1] is None:
                conn.execute(
                    "UPDATE public.memory_pipelines_migrations SET gate = %s WHERE version = %s", (gate, version)
                )
        for version, name, path in known:
            if version in done:
                continue
            with conn.transaction():  # a savepoint per file: a failing file names itself
                conn.execute(path.read_text(encoding="utf-8"))
                conn.execute(
                    "INSERT INTO public.memory_pipelines_migrations (version, name, gate) VALUES (%s, %s, %s)",
                    (version, name, gate_of(path)),
                )
            applied_now.append(name)
    return applied_now
