"""The README's demo command, run as a user runs it, on a fresh HOME: every section says what it should."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from memory_pipelines.demo import last_completed_month
from memory_pipelines.lib import registry
from memory_pipelines.lib.paths import ASSETS_DIR
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def test_demo_end_to_end(tmp_path):
    home = tmp_path / "demo-home"
    try:
        done = run_cli("demo", home=home, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        out = json.loads(done.stdout)
        listed = run_cli("tenants", home=home)
        assert listed.returncode == 0, listed.stderr
        tenants = [t["tenant_id"] for t in json.loads(listed.stdout)]
        job_id = out["forget_bob"]["proof"]["jobId"]
        certificates = {}
        for fmt in ("md", "html"):
            rendered = run_cli("deletion", "proof", job_id, "--format", fmt, home=home)
            assert rendered.returncode == 0, rendered.stderr
            certificates[fmt] = rendered.stdout
    finally:
        run_cli("stop", home=home)
    # The UI has something to show for every asset: the month that ended evaluated, a canary drill
    # run, and the drill's tenant gone again.
    evaluation = out["evaluation"]
    assert evaluation["success"] and evaluation["run_id"], evaluation
    assert evaluation["month"] == last_completed_month(datetime.now(UTC).date()).isoformat()[:7]
    assert set(evaluation["checks"]) == {"precision_target", "drift_target"}
    assert evaluation["checks"]["precision_target"]["passed"] and evaluation["precision_hybrid"] >= 0.84
    assert 0 <= evaluation["drift"] <= 1
    canary = out["canary_drill"]
    assert canary["success"] and canary["passed"] and canary["run_id"], canary
    assert canary["checks"] == {"nothing_left_behind": {"passed": True, "severity": "ERROR"}}
    assert (canary["restore_from_backup"], canary["tenant_removed"]) == ("COMPLETE", "COMPLETE")
    assert canary["canary_tenants_left"] == [] and "demo" in tenants
    assert [t for t in tenants if t.startswith("canary-")] == []
    assert out["dagster"]["success"] and all(out["dagster"]["checks"].values())
    assert out["recall"]["results"][0]["text"] == "Allergic to penicillin."
    forget = out["forget_bob"]
    assert forget["state"] == "COMPLETE" and forget["proof"]["targets"]["backups"] == "SHREDDED:1"
    assert forget["after"]["list"] == []
    # The privacy officer's certificate of that forget: the job, every registered store, no content.
    corpus = json.loads((ASSETS_DIR / "demo" / "corpus.json").read_text(encoding="utf-8"))
    texts = [m["text"] for m in corpus["memories"]] + [corpus["versioned"]["first"], corpus["versioned"]["second"]]
    for fmt, document in certificates.items():
        assert job_id in document, fmt
        assert all(spec.name in document for spec in registry.STORES), fmt
        assert not [text for text in texts if text in document], fmt
    cycle = out["backup_then_restore"]
    assert cycle["restore"]["state"] == "COMPLETE"
    assert cycle["restore"]["replayed"]["rows_removed"]["subject_epochs"] == 3
    assert set(cycle["restore"]["verification"].values()) == {0}
    assert cycle["bob_after_restore"] == {"list": [], "export": [], "others_back": {"alice": 4}}
    assert cycle["backfill_after_restore"]["success"] and all(cycle["backfill_after_restore"]["checks"].values())
    assert out["retention"]["success"] and out["retention"]["removed"] == 0 and out["retention"]["run_id"]
