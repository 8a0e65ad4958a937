"""The CLI's error contract without any service: refused before a store is opened, one line, no traceback."""

from __future__ import annotations

import io
import os
import sys

import pytest

from memory_pipelines import cli

UNDECODABLE = os.fsdecode(b"caf\xe9")  # what Python makes of a non-UTF-8 argv byte


@pytest.fixture(autouse=True)
def no_services(monkeypatch, tmp_path):
    """Every case here must be refused before a store (or anything under HOME) is opened."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("a store was opened for input that should have been refused")

    monkeypatch.setattr(cli, "_store", refuse)
    monkeypatch.setattr(cli, "_derived", refuse)
    monkeypatch.setattr("memory_pipelines.lib.infra.services.ensure_services", refuse)
    monkeypatch.setattr(os, "execve", refuse)
    monkeypatch.setenv("MEMORY_PIPELINES_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MEMORY_PIPELINES_DEBUG", raising=False)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(result: tuple[int, str, str], code: int, field: str) -> None:
    got, out, err = result
    assert got == code, err
    assert out == ""
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"memory-pipelines: error: {field}: "), err


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["write", "--tenant", "acme", "--user", "alice", UNDECODABLE], "text"),
        (["write", "--tenant", UNDECODABLE, "--user", "alice", "x"], "tenant"),
        (["write", "--tenant", "acme", "--user", "alice", "--original-query", UNDECODABLE, "x"], "original_query"),
        (["recall", "--tenant", "acme", "--user", "alice", UNDECODABLE], "query"),
        (["analytics", "--tenant", "acme", "--sql", "SELECT '" + UNDECODABLE + "'"], "sql"),
        (["run", "snapshot", "--lease", "lease_x", UNDECODABLE], "prompt"),
        (["--home", UNDECODABLE, "tenants"], "home"),
    ],
)
def test_arguments_that_are_not_utf8_are_refused_naming_the_field(capsys, argv, field):
    assert_refused(run(capsys, *argv), 2, field)


@pytest.mark.parametrize(
    ("argv", "data", "field"),
    [
        (["write", "--tenant", "acme", "--user", "alice", "-"], b"caf\xe9", "text"),
        (["write", "--tenant", "acme", "--user", "alice", "-"], b"\xff\xfe\x00", "text"),
        (["write", "--tenant", "acme", "--user", "alice", "-"], b"x" * (64 * 1024 + 1), "text"),
        (["run", "snapshot", "--lease", "lease_x", "-"], b"\xc3(", "prompt"),
    ],
)
def test_stdin_is_decoded_strictly(capsys, monkeypatch, argv, data, field):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    assert_refused(run(capsys, *argv), 2, field)


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["write", "--tenant", "acme"], "user"),
        (["write", "--tenant", "acme", "--user", "alice", "--confidence", "high", "x"], "confidence"),
        (["recall", "--tenant", "acme", "--user", "alice", "--k", "many", "q"], "k"),
        (["do-not-sell", "--tenant", "acme", "--user", "a", "--memory-id", "m", "--subject", "s"], "subject"),
        (["rollback", "--tenant", "acme", "--memory-id", "m_" + "0" * 32], "user"),
        (["do-not-sell", "--tenant", "acme", "--subject", "alice"], "user"),
        (["analytics", "--sql", "SELECT 1"], "tenant"),
        (["backup", "nonsense"], "backup_command"),
        (["no-such-command"], "command"),
        (["tenants", "--bogus"], "arguments"),
    ],
)
def test_usage_errors_follow_the_error_contract(capsys, argv, field):
    assert_refused(run(capsys, *argv), 2, field)


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["retention", "sweep", "--date", "2099-01-01"], "date"),
        (["retention", "sweep", "--date", "2099-01-01", "--wait"], "date"),
        (["retention", "sweep", "--date", "not-a-day"], "date"),
        (["eval", "run", "--month", "2026-13"], "month"),
        (["eval", "report", "--mode", "x"], "mode"),
        (["analytics", "--tenant", "acme", "--sql", "EXPLAIN ANALYZE COPY (SELECT 1) TO 'x'"], "sql"),
        (["analytics", "--tenant", "acme", "--sql", "SELECT 1; SELECT 2"], "sql"),
        (["dev", "--port", "0"], "port"),
        (["dev", "--port", "70000"], "port"),
    ],
)
def test_bad_values_are_refused_before_any_service_starts(capsys, argv, field):
    assert_refused(run(capsys, *argv), 2, field)


def test_an_unexpected_error_is_one_line_without_traceback(capsys, monkeypatch):
    def broken(_args):
        raise RuntimeError("something\nbroke")

    monkeypatch.setattr(cli, "cmd_tenants", broken)
    code, out, err = run(capsys, "tenants")
    assert (code, out) == (1, "")
    assert err == (
        "memory-pipelines: error: internal: RuntimeError: something broke"
        " (set MEMORY_PIPELINES_DEBUG=1 for the traceback)\n"
    )
    monkeypatch.setenv("MEMORY_PIPELINES_DEBUG", "1")
    code, out, err = run(capsys, "tenants")
    assert code == 1 and "Traceback" in err and err.endswith("for the traceback)\n")
