"""No plaintext memory text anywhere under HOME: heap, WAL, logs, key files, Dagster storage."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from memory_pipelines.demo import materialize_memories
from memory_pipelines.lib import services
from tests.conftest import run_cli, scan_for, settings_for

pytestmark = pytest.mark.slow


def test_canary_text_is_in_zero_files_under_home(tmp_path, monkeypatch):
    home = tmp_path / "canary-home"
    settings = settings_for(home)
    canary = f"canary-{uuid.uuid4().hex}"
    query_canary = f"query-canary-{uuid.uuid4().hex}"
    team_canary = f"team-canary-{uuid.uuid4().hex}"
    try:

        def cli(*args: str) -> dict:
            result = run_cli(*args, home=home)
            assert result.returncode == 0, result.stderr
            assert canary not in result.stderr
            return json.loads(result.stdout)

        cli("team", "add-member", "--tenant", "canary", "--team", "core", "--user", "alice")
        first = cli(
            "write", "--tenant", "canary", "--user", "alice", "--original-query", query_canary, f"My secret is {canary}"
        )
        cli(
            "write",
            "--tenant",
            "canary",
            "--user",
            "alice",
            "--memory-id",
            first["memory_id"],
            f"My secret is still {canary}",
        )
        cli("rollback", "--tenant", "canary", "--memory-id", first["memory_id"])
        cli("write", "--tenant", "canary", "--user", "alice", "--team", "core", f"Team secret {team_canary}")
        # The canary really is stored: reads return it.
        exported = cli("export", "--tenant", "canary", "--subject", "alice")
        assert sum(canary in m["text"] for m in exported["memories"]) == 3

        for key in ("DAGSTER_HOME", "MEMORY_PIPELINES_HOME"):
            monkeypatch.setenv(key, "unset-by-test")
        run = materialize_memories(settings, "canary")
        assert run["success"] and run["materialized_counts"]["versions"] == 4

        endpoints = services.ensure_services(settings)
        with psycopg.connect(endpoints.store_conninfo, autocommit=True) as conn:
            conn.execute("CHECKPOINT")  # heap pages reach the data files, not only the WAL
        needles = [canary.encode(), query_canary.encode(), team_canary.encode()]
        hits = scan_for(home, needles)
        assert hits == {needle: [] for needle in needles}

        # The scan can fail: plaintext put in on purpose is found in the data files.
        control = f"control-{uuid.uuid4().hex}"
        with psycopg.connect(endpoints.store_conninfo, autocommit=True) as conn:
            conn.execute("CREATE TABLE public.scan_control (t text)")
            conn.execute("INSERT INTO public.scan_control VALUES (%s)", (control,))
            conn.execute("CHECKPOINT")
        assert scan_for(home, [control.encode()])[control.encode()] != []
    finally:
        services.stop_services(settings)
