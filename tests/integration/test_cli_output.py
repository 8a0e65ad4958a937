"""What the CLI says while runs work: one JSON document on stdout; on a non-terminal stderr only
errors (the runs' output goes to HOME/logs/cli-runs.log); Dagster's event log with --verbose; and
the library's progress lines in the run's event log, where the UI and the CLI's bar read them."""

from __future__ import annotations

import json

import pytest

from memory_pipelines import cli
from memory_pipelines.lib.infra import progress
from tests.conftest import run_cli, settings_for

pytestmark = pytest.mark.slow


def _cli(cli_env, *args):
    return run_cli(*args, home=cli_env["home"], env=cli_env["env"], timeout=300)


def _seed(cli_here, tenant: str, memories: int) -> None:
    """Memories to materialize, written in-process: the output under test is the run's, not the write's."""
    for n in range(memories):
        done = cli_here("write", "--tenant", tenant, "--user", "alice", f"Note number {n} about kayaks")
        assert done.returncode == 0, done.stderr


# -- the progress protocol (no engines) --------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_throttled_progress_writes_the_first_every_tenth_and_the_last_line():
    lines: list[str] = []
    clock = _Clock()
    report = progress.Throttled(lines.append, seconds=5.0, step=0.1, clock=clock)
    for done in range(1, 1001):  # a thousand batches in no time: only every 10% gets a line
        report(done, 1000, "embeddings")
    assert lines == [progress.line(1, 1000, "embeddings")] + [
        progress.line(done, 1000, "embeddings") for done in range(101, 1001, 100)
    ] + [progress.line(1000, 1000, "embeddings")]
    report(1000, 1000, "embeddings")  # the last line is never repeated
    assert len(lines) == 11


def test_throttled_progress_of_an_unknown_total_writes_by_time_only():
    lines: list[str] = []
    clock = _Clock()
    report = progress.Throttled(lines.append, seconds=5.0, clock=clock)
    for done in range(1, 50):
        report(done, None, "backup rows")
    assert lines == ["progress: backup rows 1/?"]
    clock.now += 5.0
    report(50, None, "backup rows")
    report(51, None, "backup rows")
    assert lines == ["progress: backup rows 1/?", "progress: backup rows 50/?"]
    report(3, 4, "backup tables")  # another `what` has its own first line
    assert lines[-1] == "progress: backup tables 3/4"


def test_progress_lines_parse_back():
    assert progress.parse(progress.line(3, 10, "erasure scan")) == ("erasure scan", 3, 10)
    assert progress.parse(progress.line(7, None, "backup rows")) == ("backup rows", 7, None)
    assert progress.parse("backup b_1 of acme: 10 bytes") is None
    progress.no_progress(1, 2, "nothing")  # the default accepts every call


def test_eval_report_before_any_evaluation_is_not_found(monkeypatch, capsys, tmp_path):
    from memory_pipelines.lib.evaluation import evaluator as evaluation

    class _Store:
        pass

    monkeypatch.setattr(cli, "_store", lambda args: _Store())
    monkeypatch.setattr(evaluation, "trend", lambda store, *, tenant_id, mode: [])
    monkeypatch.setattr(evaluation, "latest_at_k", lambda store, *, tenant_id: [])
    assert cli.main(["--home", str(tmp_path), "eval", "report"]) == 3
    err = capsys.readouterr().err
    assert "memory-pipelines: error: eval: no evaluation yet: run `eval run --month YYYY-MM` first" in err


def test_a_failed_runs_error_names_the_run_log_unless_verbose(monkeypatch, tmp_path):
    from memory_pipelines.launch import materialize

    log = tmp_path / "logs" / "cli-runs.log"
    monkeypatch.setattr(materialize, "_run_log", log)
    monkeypatch.delenv(progress.ENV_VERBOSE, raising=False)
    failures = [{"step": "memories", "error": "tenant: is closed"}]
    assert materialize.failure_message(failures) == f"tenant: is closed (run output: {log})"
    monkeypatch.setenv(progress.ENV_VERBOSE, "1")  # the output was on stderr already
    assert materialize.failure_message(failures) == "tenant: is closed"


# -- the CLI around a run ----------------------------------------------------------------------


def test_a_run_on_a_non_terminal_stderr_prints_no_event_log_or_warning(cli_env, cli_here, tenant, monkeypatch):
    _seed(cli_here, tenant, 3)
    done = _cli(cli_env, "materialize", "--tenant", tenant, "--select", "memories,memory_embeddings")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)  # still exactly one JSON document
    assert result["success"] and result["assets"]["memory_embeddings"]["embedded"] == 3
    lines = done.stderr.splitlines()
    assert not [line for line in lines if "DEBUG" in line or "Warning" in line], done.stderr[-2000:]
    assert len(lines) <= 2, done.stderr[-2000:]
    # The children's output is kept, for a failed run's error to point at.
    log = cli_env["home"] / "logs" / "cli-runs.log"
    assert result["run_id"] in log.read_text(encoding="utf-8")

    # The library's progress reached the run's event log, from the memory_embeddings step.
    import dagster as dg

    from memory_pipelines.lib.infra import services

    # The CLI's runs are in the instance its MEMORY_PIPELINES_PG_URL names, not the session HOME's.
    monkeypatch.setenv(
        services.ENV_DAGSTER_PG_URL, services._dagster_url_from(cli_env["env"]["MEMORY_PIPELINES_PG_URL"])
    )
    with dg.DagsterInstance.from_config(str(settings_for(cli_env["home"]).dagster_home)) as instance:
        assert instance.get_run_by_id(result["run_id"]) is not None
        said = [
            (record.event_log_entry.step_key, progress.parse(record.event_log_entry.user_message))
            for record in instance.get_records_for_run(result["run_id"], limit=1000).records
            if record.event_log_entry.dagster_event is None
        ]
    assert ("memory_embeddings", ("embeddings", 3, 3)) in said, said


def test_verbose_shows_the_event_log_on_stderr(cli_env, cli_here, tenant):
    _seed(cli_here, tenant, 1)
    done = _cli(cli_env, "--verbose", "materialize", "--tenant", tenant, "--select", "memories,keyword_index")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["success"]
    assert "STEP_SUCCESS" in done.stderr and " - DEBUG - " in done.stderr, done.stderr[-2000:]
