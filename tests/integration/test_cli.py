"""The `memory-pipelines` CLI contract: one JSON document on stdout, errors on stderr naming the field."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import UTC, datetime

import pytest

from memory_pipelines.lib.stores.analytics.store import AnalyticsStore
from tests.conftest import CLI, run_cli

pytestmark = pytest.mark.slow


def cli(cli_env, *args, input_text=None):
    return run_cli(*args, home=cli_env["home"], env=cli_env["env"], input_text=input_text)


def ok(cli_env, *args, input_text=None):
    result = cli(cli_env, *args, input_text=input_text)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def cli_bytes(cli_env, *args: str | bytes, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    """`cli` with bytes: argv and stdin that are not UTF-8, as a shell passes them."""
    env = {**os.environ, "MEMORY_PIPELINES_HOME": str(cli_env["home"]), **cli_env["env"]}
    return subprocess.run([str(CLI), *args], input=stdin, capture_output=True, env=env, timeout=120, check=False)


def refused(result, code: int, field: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert f"memory-pipelines: error: {field}: " in result.stderr, result.stderr


def test_write_history_rollback_list_export(cli_env, tenant):
    first = ok(
        cli_env,
        "write",
        "--tenant",
        tenant,
        "--user",
        "alice",
        "--category",
        "medical",
        "--confidence",
        "0.9",
        "--original-query",
        "what am I allergic to?",
        "Allergic to penicillin",
    )
    assert first["version"] == 1 and first["memory_id"].startswith("m_")
    memory_id = first["memory_id"]
    second = ok(
        cli_env,
        "write",
        "--tenant",
        tenant,
        "--user",
        "alice",
        "--memory-id",
        memory_id,
        "-",
        input_text="Allergic to penicillin and latex",
    )
    assert (second["memory_id"], second["version"]) == (memory_id, 2)

    history = ok(cli_env, "history", "--tenant", tenant, "--memory-id", memory_id)
    assert [(h["version"], h["text"], h["current"]) for h in history] == [
        (1, "Allergic to penicillin", False),
        (2, "Allergic to penicillin and latex", True),
    ]

    rolled = ok(cli_env, "rollback", "--tenant", tenant, "--user", "alice", "--memory-id", memory_id)
    assert (rolled["memory_id"], rolled["version"], rolled["text"]) == (memory_id, 3, "Allergic to penicillin")

    listed = ok(cli_env, "list", "--tenant", tenant, "--user", "alice")
    assert [(m["memory_id"], m["version"], m["text"], m["user_id"], m["team_id"]) for m in listed] == [
        (memory_id, 3, "Allergic to penicillin", "alice", None)
    ]

    exported = ok(cli_env, "export", "--tenant", tenant, "--subject", "alice")
    assert (exported["subject"], exported["tenant"]) == ("alice", tenant)
    assert [(m["memory_id"], m["version"]) for m in exported["memories"]] == [(memory_id, v) for v in (1, 2, 3)]
    assert {"text", "team_id", "do_not_sell", "created_at"} <= set(exported["memories"][0])


def test_teams_tenants_sharing_mode_and_do_not_sell(cli_env, tenant):
    ok(cli_env, "tenant", "create", "--tenant", tenant)
    added = ok(cli_env, "team", "add-member", "--tenant", tenant, "--team", "core", "--user", "alice")
    assert added["members"] == ["alice"]
    ok(cli_env, "team", "add-member", "--tenant", tenant, "--team", "core", "--user", "bob")
    ok(cli_env, "write", "--tenant", tenant, "--user", "bob", "--team", "core", "Deploys on Tuesdays")
    assert ok(cli_env, "list", "--tenant", tenant, "--user", "alice", "--team", "core") == []
    ok(cli_env, "tenant", "set-mode", "--tenant", tenant, "--sharing-mode", "shared_pool")
    team_view = ok(cli_env, "list", "--tenant", tenant, "--user", "alice", "--team", "core")
    assert [(m["text"], m["user_id"], m["team_id"]) for m in team_view] == [("Deploys on Tuesdays", "bob", "core")]
    removed = ok(cli_env, "team", "remove-member", "--tenant", tenant, "--team", "core", "--user", "bob")
    assert removed["members"] == ["alice"]

    flagged = ok(cli_env, "do-not-sell", "--tenant", tenant, "--user", "bob", "--subject", "bob")
    assert flagged == {"tenant_id": tenant, "subject": "bob", "do_not_sell": True}
    assert all(m["do_not_sell"] for m in ok(cli_env, "export", "--tenant", tenant, "--subject", "bob")["memories"])

    tenants = {t["tenant_id"]: t for t in ok(cli_env, "tenants")}
    assert tenants[tenant]["sharing_mode"] == "shared_pool"
    assert tenants[tenant]["memories"] == 1


@pytest.mark.parametrize(
    ("args", "field", "code"),
    [
        (["write", "--tenant", "acme", "--user", "alice", "   "], "text", 2),
        (["write", "--tenant", "ac'me", "--user", "alice", "x"], "tenant", 2),
        (["write", "--tenant", "acme", "--user", "a;b", "x"], "user", 2),
        (["write", "--tenant", "acme", "--user", "alice", "--confidence", "2", "x"], "confidence", 2),
        (["write", "--tenant", "acme", "--user", "alice", "--confidence", "high", "x"], "--confidence", 2),
        (["history", "--tenant", "acme", "--memory-id", "42"], "memory_id", 2),
        (["list", "--tenant", "no-such-tenant-zz", "--user", "alice"], "tenant", 3),
        (["export", "--tenant", "no-such-tenant-zz", "--subject", "alice"], "tenant", 3),
        (["tenant", "create", "--tenant", "x", "--sharing-mode", "open"], "sharing_mode", 2),
        (["write", "--tenant", "acme"], "--user", 2),
    ],
)
def test_errors_exit_non_zero_and_name_the_field_on_stderr(cli_here, args, field, code):
    result = cli_here(*args)
    assert result.returncode == code, (result.returncode, result.stderr)
    assert result.stdout == ""
    assert field in result.stderr
    assert "Traceback" not in result.stderr


def test_oversized_text_is_refused_by_the_cli(cli_here, tenant):
    result = cli_here("write", "--tenant", tenant, "--user", "alice", "-", input_text="x" * (64 * 1024 + 1))
    assert result.returncode == 2 and "text:" in result.stderr and "64 KiB" in result.stderr
    listing = cli_here("list", "--tenant", tenant, "--user", "alice")
    assert listing.returncode == 3  # the tenant was never created


def test_materialize_recall_lineage_analytics_and_summaries(cli_env, tenant):
    ok(cli_env, "team", "add-member", "--tenant", tenant, "--team", "core", "--user", "alice")
    first = ok(
        cli_env,
        "write",
        "--tenant",
        tenant,
        "--user",
        "alice",
        "--category",
        "medical",
        "Takes insulin before breakfast",
    )
    ok(cli_env, "write", "--tenant", tenant, "--user", "alice", "--team", "core", "Core on-call rotates weekly")
    run = ok(cli_env, "materialize", "--tenant", tenant)
    assert run["success"] and set(run["assets"]) == {
        "memories",
        "memory_embeddings",
        "keyword_index",
        "subject_summaries",
        "team_summaries",
        "analytics_memories",
    }
    assert run["assets"]["memory_embeddings"]["embedded"] == 2
    assert all(run["checks"].values()) and len(run["checks"]) == 6

    recalled = ok(cli_env, "recall", "--tenant", tenant, "--user", "alice", "--k", "1", "diabetes medication")
    assert [(r["memory_id"], r["version"], r["text"]) for r in recalled] == [
        (first["memory_id"], 1, "Takes insulin before breakfast")
    ]
    assert isinstance(recalled[0]["score"], float)

    lineage = ok(cli_env, "lineage", "--tenant", tenant, "--memory-id", first["memory_id"])
    assert {(e["store"], e["version"]) for e in lineage} >= {
        ("chroma", 1),
        ("keyword_index", 1),
        ("analytics", 1),
        ("subject_summaries", 1),
    }
    back = ok(cli_env, "lineage", "--tenant", tenant, "--record", f"chroma:{first['memory_id']}:1")
    assert back["sources"] == [{"memory_id": first["memory_id"], "version": 1}]

    table = ok(
        cli_env,
        "analytics",
        "--tenant",
        tenant,
        "--sql",
        "SELECT category, count(*) FROM memories GROUP BY 1 ORDER BY 1",
    )
    assert table == {
        "columns": ["category", "count_star()"],
        "rows": [["general", 1], ["medical", 1]],
        "truncated": False,
    }

    ok(cli_env, "summary-mode", "--tenant", tenant, "--subject", "alice", "--mode", "full")
    ok(cli_env, "materialize", "--tenant", tenant, "--select", "subject_summaries")
    summary = ok(cli_env, "summary", "--tenant", tenant, "--subject", "alice")
    assert (summary["mode"], summary["summary"]) == ("full", "- Takes insulin before breakfast")
    assert ok(cli_env, "summary", "--tenant", tenant, "--team", "core")["source_count"] == 1


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["recall", "--tenant", "acme", "--user", "alice", "--k", "0", "x"], "k"),
        (["recall", "--tenant", "acme", "--user", "alice", " "], "query"),
        (["recall", "--tenant", "no-such-tenant-zz", "--user", "alice", "x"], "tenant"),
        (["lineage", "--tenant", "acme", "--record", "nowhere:1"], "record"),
        (["analytics", "--tenant", "acme", "--sql", "DELETE FROM memories"], "sql"),
        (["materialize", "--tenant", "acme", "--select", "memories,nonsense"], "select"),
        (["summary-mode", "--tenant", "acme", "--subject", "alice", "--mode", "poetry"], "mode"),
    ],
)
def test_derived_store_commands_reject_bad_input(cli_here, args, field):
    assert cli_here("tenant", "create", "--tenant", "acme").returncode == 0
    result = cli_here(*args)
    assert result.returncode != 0 and result.stdout == ""
    assert f"error: {field}:" in result.stderr, result.stderr


def test_forget_wait_status_proof_list_and_canary(cli_env, tenant):
    first = ok(cli_env, "write", "--tenant", tenant, "--user", "dana", "Dana's passport expires in May")
    ok(cli_env, "materialize", "--tenant", tenant)
    job = ok(cli_env, "forget", "--tenant", tenant, "--subject", "dana", "--basis", "gdpr-art17", "--wait")
    assert job["state"] == "COMPLETE" and job["targets"]["primary"] == "DONE:1" and job["run_failures"] == []
    status = ok(cli_env, "deletion", "status", job["job_id"])
    assert status["state"] == "COMPLETE" and status["basis"] == "gdpr-art17"
    proof = ok(cli_env, "deletion", "proof", job["job_id"])
    assert proof["jobId"] == job["job_id"] and proof["scopeHash"] == job["scope_hash"]
    assert "passport" not in json.dumps(proof)
    listed = ok(cli_env, "deletion", "list", "--tenant", tenant, "--state", "COMPLETE")
    assert [j["job_id"] for j in listed] == [job["job_id"]]
    gone = cli(cli_env, "history", "--tenant", tenant, "--memory-id", first["memory_id"])
    assert gone.returncode == 3
    unknown = cli(cli_env, "forget", "--tenant", tenant, "--memory-id", "m_" + "0" * 32)
    assert unknown.returncode == 3 and "memory_id" in unknown.stderr
    result = cli(cli_env, "forget", "--tenant", tenant, "--all")
    assert result.returncode == 2 and "confirm" in result.stderr
    drill = ok(cli_env, "canary")
    assert drill["passed"] is True and drill["state"] == "COMPLETE" and drill["tenant_removed"] == "COMPLETE"
    assert drill["tenant"] not in {t["tenant_id"] for t in ok(cli_env, "tenants")}  # offboarded at the end


def test_backup_forget_restore_keys_and_retention(cli_env, tenant):
    ok(cli_env, "write", "--tenant", tenant, "--user", "ann", "Ann's gate code is 2211")
    kept = ok(cli_env, "write", "--tenant", tenant, "--user", "bob", "Bob waters the ficus")
    backup = ok(cli_env, "backup", "--tenant", tenant)
    assert backup["success"] and backup["rows_memories"] == 2
    listed = ok(cli_env, "backup", "list", "--tenant", tenant)
    assert [b["backup_id"] for b in listed] == [backup["backup_id"]]
    assert ok(cli_env, "forget", "--tenant", tenant, "--subject", "ann", "--wait")["state"] == "COMPLETE"
    report = ok(cli_env, "restore", "--tenant", tenant, "--backup", backup["backup_id"], "--wait")
    assert report["state"] == "COMPLETE" and report["replayed"]["rows_removed"]["subject_epochs"] == 1
    assert ok(cli_env, "list", "--tenant", tenant, "--user", "ann") == []
    assert [m["memory_id"] for m in ok(cli_env, "list", "--tenant", tenant, "--user", "bob")] == [kept["memory_id"]]
    requested = ok(cli_env, "restore", "--tenant", tenant, "--backup", backup["backup_id"])
    assert requested["state"] == "REQUESTED"
    shred = ok(cli_env, "keys", "shred", "--tenant", tenant, "--subject", "bob")
    assert len(shred["destroyed_keys"]) == 1 and shred["forget_job"]["scope"]["subject"] == "bob"
    preview = ok(cli_env, "retention", "preview", "--date", "2025-01-01")
    assert preview["total"] >= 0 and preview["policy_version"] == "2026-11"
    swept = ok(cli_env, "retention", "sweep", "--day", "2025-01-01", "--tenant", tenant, "--wait")
    assert swept["date"] == "2025-01-01" and swept["success"] and swept["tenants"] == 1
    assert [run["tenant"] for run in swept["runs"]] == [tenant] and "removed" in swept["totals"]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["backup"], "tenant"),
        (["backup", "--tenant", "no-such-tenant-x"], "tenant"),
        (["restore", "--tenant", "acme", "--backup", "b_nope"], "backup"),
        (["restore", "--tenant", "acme", "--backup", "../etc"], "backup"),
        (["keys", "shred", "--tenant", "acme"], "confirm"),
        (["retention", "preview", "--date", "tomorrow"], "date"),
        (["retention", "sweep", "--date", "2099-01-01", "--wait"], "date"),
    ],
)
def test_backup_restore_and_retention_reject_bad_input(cli_here, args, field):
    result = cli_here(*args)
    assert result.returncode != 0
    assert f"error: {field}:" in result.stderr


def test_run_lease_permit_snapshot_and_explain(cli_env, tenant):
    memory = ok(cli_env, "write", "--tenant", tenant, "--user", "ann", "Ann is allergic to penicillin")
    ok(cli_env, "materialize", "--tenant", tenant, "--select", "keyword_index")
    lease = ok(cli_env, "run", "open", "--tenant", tenant, "--user", "ann", "--run", "r1")["lease_id"]
    hits = ok(cli_env, "run", "recall", "--lease", lease, "--mode", "keyword", "penicillin")
    assert [h["memory_id"] for h in hits] == [memory["memory_id"]]
    assert ok(cli_env, "run", "permit", "--lease", lease, "--sink", "model_output")["state"] == "RELEASED"
    assert ok(cli_env, "run", "snapshot", "--lease", lease, "the prompt")["sources"] == 1
    before = ok(cli_env, "explain", "--tenant", tenant, "--run", "r1")
    assert before["memories"][0]["text"] == "Ann is allergic to penicillin"
    assert len(before["prompt_snapshots"]) == 1
    ok(cli_env, "forget", "--tenant", tenant, "--memory-id", memory["memory_id"], "--wait")
    refused = cli(cli_env, "run", "permit", "--lease", lease, "--sink", "model_output")
    assert refused.returncode == 5 and "error: lease:" in refused.stderr and refused.stdout == ""
    after = ok(cli_env, "explain", "--tenant", tenant, "--run", "r1")
    assert after["memories"][0]["state"] == "forgotten" and after["memories"][0]["text"] is None
    assert after["prompt_snapshots"] == []
    missing = cli(cli_env, "explain", "--tenant", tenant, "--run", "nope")
    assert missing.returncode == 3 and "error: run:" in missing.stderr


def test_analytics_sql_is_sandboxed_and_sees_one_tenant(cli_env, store, tenant, tmp_path):
    other = tenant + "-other"
    store.write(tenant_id=tenant, user_id="alice", text="Alice likes tea")
    for text in ("Bob likes coffee", "Bob likes cocoa"):
        store.write(tenant_id=other, user_id="bob", text=text)
    analytics = AnalyticsStore(store=store)
    for name in (tenant, other):
        analytics.rebuild(store=store, tenant_id=name)
    count = "SELECT count(*) FROM memories"
    assert ok(cli_env, "analytics", "--tenant", tenant, "--sql", count)["rows"] == [[1]]
    assert ok(cli_env, "analytics", "--tenant", other, "--sql", count)["rows"] == [[2]]
    target = tmp_path / "written-by-sql.txt"
    master_key = cli_env["home"] / "keys" / "master.key"
    for sql in (
        f"EXPLAIN ANALYZE COPY (SELECT 'x') TO '{target}' (HEADER false)",
        "SELECT * FROM read_text('/etc/hostname')",
        f"SELECT * FROM read_blob('{master_key}')",
        "SELECT * FROM read_csv('/proc/self/environ')",
        f"SELECT * FROM read_parquet('{cli_env['home']}/**/*.parquet')",
        "SELECT * FROM postgres_scan('', 'derived', 'analytics_rows')",
        "SET enable_external_access = true",
        "SELECT 1; SELECT 2",
    ):
        refused(cli(cli_env, "analytics", "--tenant", tenant, "--sql", sql), 2, "sql")
    assert not target.exists()
    refused(cli(cli_env, "analytics", "--tenant", "no-such-tenant-zz", "--sql", count), 3, "tenant")
    refused(cli(cli_env, "analytics", "--sql", count), 2, "tenant")


def test_a_retention_sweep_of_a_day_not_ended_is_refused_and_removes_nothing(cli_env, tenant):
    written = ok(cli_env, "write", "--tenant", tenant, "--user", "ann", "--category", "general", "Ann parks on level 2")
    today = datetime.now(UTC).date().isoformat()
    for args in (["--date", "2099-01-01"], ["--date", today], ["--date", "2099-01-01", "--wait"]):
        refused(cli(cli_env, "retention", "sweep", *args), 2, "date")
    assert [m["memory_id"] for m in ok(cli_env, "list", "--tenant", tenant, "--user", "ann")] == [written["memory_id"]]
    assert ok(cli_env, "deletion", "list", "--tenant", tenant) == []
    # A preview of a future day stays allowed: counts only, nothing requested.
    assert ok(cli_env, "retention", "preview", "--date", "2099-01-01")["tenants"][tenant] == {"general": 1}
    assert ok(cli_env, "deletion", "list", "--tenant", tenant) == []


def test_eval_report_refuses_an_unknown_mode(cli_env):
    refused(cli(cli_env, "eval", "report", "--mode", "x"), 2, "mode")


def test_rollback_and_do_not_sell_act_as_a_user(cli_env, tenant):
    first = ok(cli_env, "write", "--tenant", tenant, "--user", "alice", "Likes tea")
    memory_id = first["memory_id"]
    ok(cli_env, "write", "--tenant", tenant, "--user", "alice", "--memory-id", memory_id, "Likes green tea")
    ok(cli_env, "write", "--tenant", tenant, "--user", "bob", "Likes coffee")
    refused(cli(cli_env, "rollback", "--tenant", tenant, "--user", "bob", "--memory-id", memory_id), 4, "user")
    refused(cli(cli_env, "rollback", "--tenant", tenant, "--memory-id", memory_id), 2, "user")
    assert ok(cli_env, "rollback", "--tenant", tenant, "--user", "alice", "--memory-id", memory_id)["version"] == 3
    refused(cli(cli_env, "do-not-sell", "--tenant", tenant, "--user", "bob", "--subject", "alice"), 4, "subject")
    refused(cli(cli_env, "do-not-sell", "--tenant", tenant, "--user", "bob", "--memory-id", memory_id), 4, "user")
    flagged = ok(cli_env, "do-not-sell", "--tenant", tenant, "--user", "alice", "--memory-id", memory_id)
    assert flagged["do_not_sell"] is True


@pytest.mark.parametrize(
    ("args", "stdin", "field"),
    [
        (["write", "--tenant", "acme", "--user", "alice", b"caf\xe9"], b"", "text"),
        (["write", "--tenant", b"ac\xffme", "--user", "alice", "x"], b"", "tenant"),
        (["write", "--tenant", "acme", "--user", "alice", "--original-query", b"\xff", "x"], b"", "original_query"),
        (["recall", "--tenant", "acme", "--user", "alice", b"\xc3("], b"", "query"),
        (["analytics", "--tenant", "acme", "--sql", b"SELECT '\xff'"], b"", "sql"),
        (["write", "--tenant", "acme", "--user", "alice", "-"], b"caf\xe9", "text"),
        (["run", "snapshot", "--lease", "lease_nope", "-"], b"\xff\xfe", "prompt"),
    ],
)
def test_input_that_is_not_utf8_is_exit_2_naming_the_field(cli_env, args, stdin, field):
    result = cli_bytes(cli_env, *args, stdin=stdin)
    assert result.returncode == 2, result.stderr
    assert result.stdout == b""
    assert b"Traceback" not in result.stderr
    assert f"memory-pipelines: error: {field}: ".encode() in result.stderr, result.stderr


def test_deletion_erase_of_a_tenant_dagster_has_never_seen(cli_env, store, derived, tenant):
    """Issue 21: a tenant written only through the Python API had no Dagster partition, and `deletion
    erase` failed with "Nonexistent partition keys"; an unknown tenant is refused, not made a partition."""
    from memory_pipelines.lib.forget.deletion import DeletionService

    store.write(tenant_id=tenant, user_id="ida", text="Ida's locker code is 4411")
    store.write(tenant_id=tenant, user_id="joe", text="Joe keeps the spare keys")
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="ida")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["targets"]["physical"].startswith("PENDING:")
    erased = ok(cli_env, "deletion", "erase", "--tenant", tenant)
    assert erased["success"] is True and erased["erased_jobs"] == 1 and erased["scan_hits"] == 0, erased
    assert service.status(job_id=job["job_id"])["targets"]["physical"].startswith("ERASED:")
    refused(cli(cli_env, "deletion", "erase", "--tenant", "ghost-" + tenant), 3, "tenant")


def test_a_runaway_analytics_query_ends_with_a_clear_error(cli_env, store, tenant):
    """Issue 21, item 5: DuckDB's memory, threads and time per query are capped (on the code before, a
    query over range() ran unbounded and could take the machine's memory)."""
    store.write(tenant_id=tenant, user_id="alice", text="Alice likes tea")
    AnalyticsStore(store=store).rebuild(store=store, tenant_id=tenant)
    limits = {"MEMORY_PIPELINES_ANALYTICS_TIMEOUT_SECONDS": "2", "MEMORY_PIPELINES_ANALYTICS_MEMORY_MB": "128"}
    env = {**cli_env, "env": {**cli_env["env"], **limits}}
    started = datetime.now(UTC)
    slow = cli(env, "analytics", "--tenant", tenant, "--sql", "SELECT count(*) FROM range(1000000000000)")
    refused(slow, 6, "sql")
    assert "stopped after 2 s" in slow.stderr and "MEMORY_PIPELINES_ANALYTICS_TIMEOUT_SECONDS" in slow.stderr
    assert (datetime.now(UTC) - started).total_seconds() < 30
    big = cli(env, "analytics", "--tenant", tenant, "--sql", "SELECT * FROM range(100000000) ORDER BY random()")
    refused(big, 6, "sql")
    assert "more than 128 MB" in big.stderr and "MEMORY_PIPELINES_ANALYTICS_MEMORY_MB" in big.stderr
    # A scalar DuckDB's memory_limit does not see (7.7 GB under a 1 GB limit, before the query had a
    # capped process of its own), and one that never checks for interrupts.
    huge = cli(env, "analytics", "--tenant", tenant, "--sql", "SELECT length(repeat('x', 2000000000))")
    refused(huge, 6, "sql")
    assert "more than 128 MB" in huge.stderr
    threads = ok(env, "analytics", "--tenant", tenant, "--sql", "SELECT current_setting('threads') FROM memories")
    assert threads["rows"] == [[2]]
    bad = cli(
        {**cli_env, "env": {**cli_env["env"], "MEMORY_PIPELINES_ANALYTICS_THREADS": "0"}},
        "analytics",
        "--tenant",
        tenant,
        "--sql",
        "SELECT 1",
    )
    refused(bad, 2, "MEMORY_PIPELINES_ANALYTICS_THREADS")
    assert ok(cli_env, "analytics", "--tenant", tenant, "--sql", "SELECT count(*) FROM memories")["rows"] == [[1]]
