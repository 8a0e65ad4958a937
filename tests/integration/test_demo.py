"""The README's demo command, run as a user runs it, on a fresh HOME: every section says what it should,
and the instance the UI reads afterwards is clean, with the sensors of `dev` running over it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from dagster._core.execution.backfill import BulkActionStatus

from memory_pipelines.defs.forget.ops import job_key
from memory_pipelines.demo import last_completed_month
from memory_pipelines.lib.infra import services
from memory_pipelines.lib.infra import settings as infra_settings
from memory_pipelines.lib.infra.paths import ASSETS_DIR, PROJECT_ROOT
from memory_pipelines.lib.infra.services import Endpoints
from memory_pipelines.lib.stores import registry
from tests.conftest import CLI, run_cli, settings_for
from tests.integration.test_daemon_e2e import _stop

pytestmark = pytest.mark.slow

DELETIONS = dg.AssetKey("memory_deletions")
CHECK = dg.AssetCheckKey(DELETIONS, "deletions_on_track")
_ENDED = {BulkActionStatus.COMPLETED, BulkActionStatus.COMPLETED_SUCCESS, BulkActionStatus.COMPLETED_FAILED}
_FAILED = {BulkActionStatus.FAILED, BulkActionStatus.COMPLETED_FAILED, BulkActionStatus.CANCELED}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, endpoints: Endpoints) -> Iterator[dict[str, Any]]:
    """One demo run on a fresh HOME for the module; its services stay up until the module ends.

    Run from an environment that carries another HOME's exported instance (the session's), as a
    shell after `eval "$(memory-pipelines --home OTHER env)"` does, or a test worker: every process
    of the demo, its evaluation child included, must still use the demo HOME's own instance."""
    home = tmp_path_factory.mktemp("demo") / "demo-home"
    inherited = {
        infra_settings.ENV_DAGSTER_PG_URL: endpoints.dagster_url,
        infra_settings.ENV_DAGSTER_PG_URL_EXPORTED: endpoints.dagster_url,
    }
    try:
        done = run_cli("demo", home=home, env=inherited, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        yield {"home": home, "out": json.loads(done.stdout)}
    finally:
        run_cli("stop", home=home)


def _the_demo_says_what_it_should(demo: dict[str, Any]) -> None:
    home, out = demo["home"], demo["out"]
    listed = run_cli("tenants", home=home)
    assert listed.returncode == 0, listed.stderr
    tenants = [t["tenant_id"] for t in json.loads(listed.stdout)]
    job_id = out["forget_bob"]["proof"]["jobId"]
    certificates = {}
    for fmt in ("md", "html"):
        rendered = run_cli("deletion", "proof", job_id, "--format", fmt, home=home)
        assert rendered.returncode == 0, rendered.stderr
        certificates[fmt] = rendered.stdout
    # The UI has something to show for every asset: the month that ended evaluated, a canary drill
    # run, and the drill's tenant gone again.
    evaluation = out["evaluation"]
    assert evaluation["success"] and evaluation["run_id"], evaluation
    month = last_completed_month(datetime.now(UTC).date())
    assert month is not None and evaluation["month"] == month.isoformat()[:7]
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
    # bob's two notices reached the demo's SMTP server, once each, with nothing of him in them.
    notices = forget["notifications"]
    assert sorted(d["event"] for d in notices["delivered"]) == ["deletion.completed", "deletion.erased"]
    assert [m["subject"] for m in notices["received"]] == [
        f"Deletion {job_id} completed",
        f"Deletion {job_id} physically erased",
    ]
    assert len({m["idempotency_key"] for m in notices["received"]}) == 2
    assert "bob" not in json.dumps(notices["received"])
    # The privacy officer's certificate of that forget: the job, every registered store, no content.
    corpus = json.loads((ASSETS_DIR / "demo" / "corpus.json").read_text(encoding="utf-8"))
    texts = [m["text"] for m in corpus["memories"]] + [corpus["versioned"]["first"], corpus["versioned"]["second"]]
    for fmt, document in certificates.items():
        assert job_id in document, fmt
        assert all(spec.name in document for spec in registry.stores()), fmt
        assert not [text for text in texts if text in document], fmt
    cycle = out["backup_then_restore"]
    assert cycle["restore"]["state"] == "COMPLETE"
    assert cycle["restore"]["replayed"]["rows_removed"]["subject_epochs"] == 3
    assert set(cycle["restore"]["verification"].values()) == {0}
    assert cycle["bob_after_restore"] == {"list": [], "export": [], "others_back": {"alice": 4}}
    assert cycle["backfill_after_restore"]["success"] and all(cycle["backfill_after_restore"]["checks"].values())
    assert out["retention"]["success"] and out["retention"]["removed"] == 0 and out["retention"]["run_id"]


def _deleted_by_certificate(markdown: str) -> dict[str, int]:
    """store -> the certificate's "records deleted" (its table's fifth column, before any note)."""
    found = {}
    for line in markdown.splitlines():
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0] in registry.names() and (number := re.match(r"\d+", cells[4])):
            found[cells[0]] = int(number.group())
    return found


def _daemon(home: Path, logs: Path) -> subprocess.Popen:
    """The real `dagster-daemon` on the demo's HOME, as `dev` runs it (sensors, backfills, the queue)."""
    settings = settings_for(home)
    services.ensure_services(settings)  # exports the instance URL for this process and the daemon
    env = {**os.environ, "MEMORY_PIPELINES_HOME": str(home), "DAGSTER_HOME": str(settings.dagster_home)}
    with open(logs, "wb") as log:
        return subprocess.Popen(
            [str(Path(CLI).parent / "dagster-daemon"), "run", "-w", "workspace.yaml"],
            cwd=PROJECT_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.mark.timeout(1200)
def test_the_demo_end_to_end_then_the_instance_is_a_clean_first_look(demo, tmp_path):
    """The demo's output, then what a new user sees in `dev` after it: bob's forget is the latest
    `memory_deletions` materialization of `demo` (proof, certificate and data map, which agree), its
    check has a result, and once the sensors have ticked no run or backfill failed and none targets
    the drill's tenant. One test, so the two xdist workers do not each run the demo (100 s)."""
    _the_demo_says_what_it_should(demo)
    home, out = demo["home"], demo["out"]
    assert out["evaluation"]["success"] and out["canary_drill"]["success"], (out["evaluation"], out["canary_drill"])
    bob = out["forget_bob"]["proof"]["jobId"]
    settings = settings_for(home)
    services.ensure_services(settings)
    with dg.DagsterInstance.from_config(str(settings.dagster_home)) as instance:
        [latest] = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=DELETIONS, asset_partitions=["demo"]), limit=1
        ).records
        metadata = {k: v.value for k, v in latest.asset_materialization.metadata.items()}
        assert metadata["deletion_job_ids"] == [bob] and metadata["deletion_states"] == {bob: "COMPLETE"}
        assert metadata[job_key("proof", bob)]["jobId"] == bob and {"data_map", job_key("certificate", bob)} <= set(
            metadata
        )
        assert len(job_key("proof", bob)) <= 24  # short enough for the UI's metadata table
        # The certificate's records deleted are the data map's before - after, store by store (the team
        # summary bob wrote into is rebuilt without him: reached, not deleted).
        removed = {s: metadata["data_map_before"][s] - metadata["data_map_after"][s] for s in registry.names()}
        assert _deleted_by_certificate(metadata[job_key("certificate", bob)]) == removed
        assert (
            removed["team_summaries"] == 0 and metadata[job_key("proof", bob)]["targets"]["team_summaries"] == "DONE:1"
        )
        # The retention run that came after removed nothing: no event of its own above bob's forget (the
        # tabs open on the newest), only the erasure's observation of bob's certificate as it stands.
        observed = instance.fetch_observations(
            dg.AssetRecordsFilter(asset_key=DELETIONS, asset_partitions=["demo"]), limit=10
        ).records
        assert out["retention"]["run_id"] not in {o.run_id for o in observed}
        assert observed and observed[0].run_id == out["forget_bob"]["erasure_run_id"]
        # The check's result targets that materialization: the asset page shows it, not "Not evaluated".
        [check] = instance.event_log_storage.get_asset_check_partition_info([CHECK], partition_keys=["demo"])
        assert check.is_current and check.latest_execution_status.value == "SUCCEEDED", check
        # The drift of the month evaluated ran after its evaluation: its trend has the month's precision and
        # recall, and the chart is Markdown short enough for the asset page to draw in place.
        month = out["evaluation"]["month"]
        [drift] = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("memory_drift"), asset_partitions=[f"{month}-01"]), limit=1
        ).records
        figures = {k: v.value for k, v in drift.asset_materialization.metadata.items()}
        assert figures["precision_hybrid"] == pytest.approx(out["evaluation"]["precision_hybrid"])
        assert figures["recall_hybrid"] == pytest.approx(out["evaluation"]["recall_hybrid"])
        [row] = [line for line in figures["trend"].splitlines() if line.startswith(f"| {month} |")]
        assert "| - |" not in row, row
        assert len(figures["trend_chart"]) < 1000 and "](<data:image/svg+xml," in figures["trend_chart"]

    daemon = _daemon(home, tmp_path / "daemon.log")
    try:
        with dg.DagsterInstance.from_config(str(settings.dagster_home)) as instance:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                backfills = instance.get_backfills()
                if backfills and all(b.status in _ENDED | _FAILED for b in backfills):
                    break
                time.sleep(5)
            log = (tmp_path / "daemon.log").read_text(errors="replace")[-3000:]
            # The demo's own restore is rebuilt as a backfill; the drill's offboarded tenant gets none.
            assert [b.tags.get("memory_pipelines/tenant") for b in backfills] == ["demo"], log
            assert [b.backfill_id for b in backfills if b.status in _FAILED] == [], log
            failed = instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.FAILURE]))
            assert [(r.job_name, r.tags.get("dagster/partition")) for r in failed] == [], log
            # No sensor relaunched bob's forget: still the one forget run of the demo.
            forgets = instance.get_runs(filters=dg.RunsFilter(job_name="forget"))
            assert [r.run_id for r in forgets] == [out["forget_bob"]["run_id"]]
    finally:
        _stop(daemon)
