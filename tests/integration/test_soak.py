"""Issue 11's concurrency soak at CI size: eight OS processes race writes, bulk writes, rollbacks,
every derived-store build (one with a slow summarizer, one with a slow embedder), agent runs and
backups against SUBJECT, MEMORY, TENANT and retention deletions, physical erasures and restores
accepted at random moments (each restore after an erasure, and after do-not-sell and membership
changes), while a long-lived oracle checks every COMPLETE job in every store, the tenant's files after
each restore and every consent change across it (tests/support/soak.py). Fixed seed, about two
minutes; run the module itself for longer soaks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SECONDS = 100  # the racing phase; setup and the final checks add about 40 s on two cores
SEED = 7

# Every kind of operation the soak is about; each must have succeeded at least once, or the race
# it stands for was not run at all.
EVERY_KIND = (
    "write",
    "write_version",
    "write_many",
    "rollback",
    "team_join",
    "sync_vectors",
    "sync_keywords",
    "sync_analytics",
    "sync_summaries",
    "sync_summaries_slow",
    "slow_summarize_calls",
    "sync_vectors_slow",
    "slow_embed_calls",
    "lease",
    "agent_recall",
    "permit_stream",
    "snapshot",
    "forget_subject",
    "forget_memory",
    "forget_version",
    "forget_tenant",
    "forget_twin",
    "run_batch",
    "retention_sweep",
    "backup",
    "erase",
    "consent_memory",
    "consent_subject",
    "member_remove",
    "restore",
    "retention_restores",
)
EVERY_CHECK = (
    "decrypt_before",
    "exact_id:primary",
    "exact_id:keyword_index",
    "exact_id:lineage",
    "exact_id:recall_cache",
    "exact_id:chroma",
    "exact_id:analytics",
    "rule:covered_versions_gone",
    "rule:forgotten_memory_has_no_version",
    "rule:deleted_tenant_empty",
    "decrypt:targets_unreadable",
    "decrypt:destroyed_key_refused",
    "probe:chroma",
    "probe:keyword",
    "probe:recall",
    "recheck_after_restore",
    "byte_scan:erased_after_restore",
    "consent:memory_dns",
    "consent:subject_dns",
    "consent:member",
    "consent:team_view_closed",
    "consent:analytics_excludes_do_not_sell",
    "rule:swept_between_restores_stays_gone",
    "content:summary",
    "content:prompt_snapshot",
    "content:primary_row",
    "byte_scan:passes",
    "final_recheck",
    "gate_audit",
)


def test_soak_ci_size(tmp_path: Path) -> None:
    report_file = tmp_path / "soak.json"
    command = [sys.executable, "-m", "tests.support.soak", "--seconds", str(SECONDS), "--seed", str(SEED)]
    soak = subprocess.Popen(
        [*command, "--json", str(report_file)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The soak enforces its own deadline (SECONDS + 300 s + 10%) and cleans up after itself.
        stdout, stderr = soak.communicate(timeout=SECONDS + 360)
    except subprocess.TimeoutExpired:
        soak.terminate()  # SIGTERM: the soak stops its processes, Chroma and PostgreSQL
        stdout, stderr = soak.communicate(timeout=90)
    print(stdout)  # the summary block: operations, deletions, checks, violations
    assert report_file.exists(), f"no report (exit {soak.returncode}):\n{stderr[-4000:]}"
    report = json.loads(report_file.read_text())
    assert "harness_error" not in report, report["harness_error"]

    violations = report["violations"]
    assert violations == [], f"{len(violations)} violation(s), first: {json.dumps(violations[:3], indent=1)}"
    deletions = report["deletions"]
    assert deletions["accepted"] >= 50, deletions
    assert deletions["complete"] >= 50, deletions
    assert set(deletions["accepted_by_scope"]) == {"SUBJECT", "MEMORY", "TENANT", "RETENTION"}, deletions
    assert deletions["restores"].get("COMPLETE", 0) >= 1, deletions

    missing = [kind for kind in EVERY_KIND if not report["ops"].get(kind)]
    assert missing == [], f"operations that never succeeded: {missing}"
    unchecked = [kind for kind in EVERY_CHECK if not report["checks"].get(kind)]
    assert unchecked == [], f"oracle checks that never ran: {unchecked}"
    assert report["checks"]["byte_scan:passes"] >= 3
    assert report["phases"]["wall"] < SECONDS + 120, report["phases"]
    assert soak.returncode == 0
