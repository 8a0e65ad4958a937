"""No plaintext memory text anywhere under HOME: heap, WAL, logs, key files, Dagster storage,
Chroma, the keyword index, summaries, the recall cache, Parquet and DuckDB."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from memory_pipelines.launch.materialize import materialize
from memory_pipelines.lib.forget.canary import files_containing as scan_for
from memory_pipelines.lib.infra import services
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores.derived import open_derived
from tests.conftest import run_cli, settings_for

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
        cli("rollback", "--tenant", "canary", "--user", "alice", "--memory-id", first["memory_id"])
        cli("write", "--tenant", "canary", "--user", "alice", "--team", "core", f"Team secret {team_canary}")
        # The canary really is stored: reads return it.
        exported = cli("export", "--tenant", "canary", "--subject", "alice")
        assert sum(canary in m["text"] for m in exported["memories"]) == 3

        for key in ("DAGSTER_HOME", "MEMORY_PIPELINES_HOME"):
            monkeypatch.setenv(key, "unset-by-test")
        run = materialize(settings, "canary")
        assert run["success"], run["failures"]
        assert run["assets"]["memories"]["versions"] == 4
        assert run["assets"]["memory_embeddings"]["embedded"] == 2  # current versions only
        assert all(run["checks"].values()), run["checks"]
        # Recall through every derived index decrypts the canary for the caller only.
        derived = open_derived(settings, open_store(settings))
        hits = derived.recaller.recall(tenant_id="canary", user_id="alice", query="what is my secret?", k=5)
        assert any(canary in hit["text"] for hit in hits)
        derived.store.close()

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
