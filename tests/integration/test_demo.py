"""The README's demo command, run as a user runs it, on a fresh HOME: every section says what it should."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def test_demo_end_to_end(tmp_path):
    home = tmp_path / "demo-home"
    try:
        done = run_cli("demo", home=home, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        out = json.loads(done.stdout)
    finally:
        run_cli("stop", home=home)
    assert out["dagster"]["success"] and all(out["dagster"]["checks"].values())
    assert out["recall"]["results"][0]["text"] == "Allergic to penicillin."
    forget = out["forget_bob"]
    assert forget["state"] == "COMPLETE" and forget["proof"]["targets"]["backups"] == "SHREDDED:1"
    assert forget["after"]["list"] == []
    cycle = out["backup_then_restore"]
    assert cycle["restore"]["state"] == "COMPLETE"
    assert cycle["restore"]["replayed"]["rows_removed"]["subject_epochs"] == 3
    assert set(cycle["restore"]["verification"].values()) == {0}
    assert cycle["bob_after_restore"] == {"list": [], "export": [], "others_back": {"alice": 4}}
    assert cycle["backfill_after_restore"]["success"] and all(cycle["backfill_after_restore"]["checks"].values())
    assert out["retention"]["success"] and out["retention"]["removed"] == 0 and out["retention"]["run_id"]
