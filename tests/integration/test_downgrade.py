"""The downgrade gate (lib/infra/migrations.py): code older than its database refuses to open memory
reads and writes when the database holds a gated migration it does not know, naming both; `stop`
still works; a migration without a gate (an index) does not close anything."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from memory_pipelines.lib.infra import migrations
from tests.conftest import CLI

# The newest migration with a gate: code from before it is what a rollback past it would run.
NEWEST = [m for m in migrations.available() if migrations.gate_of(m[2])][-1]
# Code without its newest migration, as a release from before it would be, in a process of its own.
OLDER_CODE = """
import sys
from pathlib import Path
from memory_pipelines.lib.infra import migrations
migrations.MIGRATIONS_DIR = Path(sys.argv[1])
from memory_pipelines.cli import main
sys.exit(main(sys.argv[2:]))
"""


def without_newest(tmp_path: Path) -> Path:
    older = tmp_path / "older-release"
    older.mkdir()
    for version, _, path in migrations.available():
        if version < NEWEST[0]:
            shutil.copy(path, older / path.name)
    return older


def run(code: list[str], home: Path, conninfo: str) -> subprocess.CompletedProcess[str]:
    env = {
        "MEMORY_PIPELINES_HOME": str(home),
        "MEMORY_PIPELINES_PG_URL": conninfo,
        "MEMORY_PIPELINES_CHROMA_URL": "http://127.0.0.1:9",  # never reached by `list`
        "PATH": str(Path(sys.executable).parent),
    }
    return subprocess.run(code, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_code_without_the_newest_migration_refuses_the_database_that_has_it(scratch_database, tmp_path):
    assert migrations.gate_of(NEWEST[2]), f"{NEWEST[1]} changes what forgetting deletes: it must be gated"
    with psycopg.connect(scratch_database) as conn:
        assert NEWEST[1] in migrations.migrate(conn)
    older = without_newest(tmp_path)
    with psycopg.connect(scratch_database) as conn:
        with pytest.raises(migrations.DowngradeRefused) as err:
            migrations.migrate(conn, older)
        assert err.value.field == "release" and err.value.exit_code == 5
        assert NEWEST[1] in err.value.message and migrations.available(older)[-1][1] in err.value.message
        assert migrations.release() in err.value.message
    # The CLI of that older code: no memory read, a clear error, and `stop` still works.
    home = tmp_path / "home"
    listed = run(
        [sys.executable, "-c", OLDER_CODE, str(older), "list", "--tenant", "acme", "--user", "alice"],
        home,
        scratch_database,
    )
    assert listed.returncode == 5, listed.stderr
    assert "release" in listed.stderr and NEWEST[1] in listed.stderr and listed.stdout == ""
    exported = run([sys.executable, "-c", OLDER_CODE, str(older), "env", "--format", "json"], home, scratch_database)
    assert exported.returncode == 0, exported.stderr
    assert json.loads(exported.stdout)["MEMORY_PIPELINES_HOME"] == str(home)
    stopped = run([sys.executable, "-c", OLDER_CODE, str(older), "stop"], home, scratch_database)
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout)["postgres"]["stopped"] is False  # external: not ours to stop
    # The same code with every migration the database has starts normally.
    current = run([str(CLI), "list", "--tenant", "acme", "--user", "alice"], home, scratch_database)
    assert current.returncode in (0, 3), current.stderr  # an unknown tenant is not a refusal
    assert "release" not in current.stderr


def test_an_ungated_newer_migration_closes_nothing_and_a_gated_one_is_recorded(scratch_database, tmp_path):
    newer = tmp_path / "newer-release"
    shutil.copytree(migrations.MIGRATIONS_DIR, newer)
    (newer / "0998_an_index.sql").write_text("CREATE INDEX newer_index ON memory.tenants (created_at);\n")
    with psycopg.connect(scratch_database) as conn:
        assert migrations.migrate(conn, newer)[-1] == "0998_an_index"
        assert migrations.migrate(conn) == []  # the current code: an index it does not know changes nothing
    (newer / "0999_new_meaning.sql").write_text(
        "-- gate: a test migration that changes what a deletion means\nCREATE TABLE public.newer_meaning (x int);\n"
    )
    with psycopg.connect(scratch_database) as conn:
        assert migrations.migrate(conn, newer) == ["0999_new_meaning"]
        gates = dict(conn.execute("SELECT name, gate FROM public.memory_pipelines_migrations WHERE gate IS NOT NULL"))
        assert gates["0999_new_meaning"] == "a test migration that changes what a deletion means"
        assert NEWEST[1] in gates and "0998_an_index" not in gates
        with pytest.raises(migrations.DowngradeRefused) as err:
            migrations.migrate(conn)
        assert "0999_new_meaning" in err.value.message and "0998" not in err.value.message
