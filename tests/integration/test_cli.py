"""The `memory-pipelines` CLI contract: one JSON document on stdout, errors on stderr naming the field."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cli_env(endpoints, tmp_path_factory):
    """The CLI against the session server through MEMORY_PIPELINES_PG_URL: no second server to start."""
    return {"home": tmp_path_factory.mktemp("cli-home"), "env": {"MEMORY_PIPELINES_PG_URL": endpoints.store_conninfo}}


def cli(cli_env, *args, input_text=None):
    return run_cli(*args, home=cli_env["home"], env=cli_env["env"], input_text=input_text)


def ok(cli_env, *args, input_text=None):
    result = cli(cli_env, *args, input_text=input_text)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


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

    rolled = ok(cli_env, "rollback", "--tenant", tenant, "--memory-id", memory_id)
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

    flagged = ok(cli_env, "do-not-sell", "--tenant", tenant, "--subject", "bob")
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
def test_errors_exit_non_zero_and_name_the_field_on_stderr(cli_env, args, field, code):
    result = cli(cli_env, *args)
    assert result.returncode == code, (result.returncode, result.stderr)
    assert result.stdout == ""
    assert field in result.stderr
    assert "Traceback" not in result.stderr


def test_oversized_text_is_refused_by_the_cli(cli_env, tenant):
    result = cli(cli_env, "write", "--tenant", tenant, "--user", "alice", "-", input_text="x" * (64 * 1024 + 1))
    assert result.returncode == 2 and "text:" in result.stderr and "64 KiB" in result.stderr
    listing = cli(cli_env, "list", "--tenant", tenant, "--user", "alice")
    assert listing.returncode == 3  # the tenant was never created
