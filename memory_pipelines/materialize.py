"""Runs tenant partitions of the assets through the Dagster instance in-process (CLI `materialize`,
`demo`), so every run, materialization and check shows in the UI like any other run."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from memory_pipelines.lib.errors import ValidationError
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.settings import ENV_HOME, Settings

ALL_ASSETS = (
    "memories",
    "memory_embeddings",
    "keyword_index",
    "subject_summaries",
    "team_summaries",
    "analytics_memories",
)


def _root_cause(error: Any) -> str:
    """The innermost error's message (ours name the field), not Dagster's wrapper."""
    while error.cause is not None:
        error = error.cause
    return str(error.message).strip().splitlines()[-1]


def _execute(
    settings: Settings, job_name: str, tenant_id: str, *, day: str | None = None, **kwargs: Any
) -> tuple[Any, list[dict[str, Any]]]:
    """Run one partition of `job_name` in-process against the persistent instance: the tenant's,
    or for day-partitioned jobs (retention) the day's."""
    import dagster as dg

    from memory_pipelines.definitions import defs
    from memory_pipelines.lib.services import ensure_services

    ensure_services(settings)  # the embedded server and dagster.yaml, on a fresh HOME too
    os.environ["DAGSTER_HOME"] = str(settings.dagster_home)
    os.environ[ENV_HOME] = str(settings.home)
    with dg.DagsterInstance.get() as instance:
        if day is None and not instance.has_dynamic_partition("tenants", tenant_id):
            instance.add_dynamic_partitions("tenants", [tenant_id])
        result = (
            defs()
            .resolve_job_def(job_name)
            .execute_in_process(instance=instance, partition_key=day or tenant_id, raise_on_error=False, **kwargs)
        )
    failures = [
        {"step": e.step_key, "error": _root_cause(e.step_failure_data.error)}
        for e in result.all_events
        if e.event_type_value == "STEP_FAILURE" and e.step_failure_data.error is not None
    ]
    return result, failures


def run_forget(settings: Settings, tenant_id: str, job_ids: Sequence[str]) -> dict[str, Any]:
    """Run the `forget` job for one tenant now, in-process, through the Dagster instance."""
    result, failures = _execute(
        settings, "forget", tenant_id, run_config={"ops": {"forget_batch": {"config": {"job_ids": list(job_ids)}}}}
    )
    return {"run_id": result.run_id, "success": result.success, "failures": failures}


def _asset_figures(result: Any, leave_out: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """asset -> its materialization's metadata values, from an in-process run's events."""
    figures: dict[str, dict[str, Any]] = {}
    for event in result.get_asset_materialization_events():
        materialization = event.step_materialization_data.materialization
        figures[materialization.asset_key.to_user_string()] = {
            name: getattr(value, "value", None)
            for name, value in materialization.metadata.items()
            if name not in leave_out
        }
    return figures


def failure_message(failures: list[dict[str, Any]]) -> str:
    """The failed steps' root causes (our errors name their field), for a CLI error line."""
    return "; ".join(f["error"] for f in failures) or "run failed"


def _output(result: Any, node: str) -> Any:
    return result.output_for_node(node) if result.success else None


def run_backup(settings: Settings, tenant_id: str) -> dict[str, Any]:
    """Materialize `tenant_backups` for one tenant now; returns the backup's figures and the run."""
    result, failures = _execute(settings, "backup", tenant_id)
    figures = _asset_figures(result).get("tenant_backups", {})
    return {**figures, "run_id": result.run_id, "success": result.success, "failures": failures}


def run_restore(settings: Settings, tenant_id: str, backup_id: str, restore_id: str | None = None) -> dict[str, Any]:
    """Run the `restore` job for one tenant now; returns the restore report and the run."""
    config = {"backup_id": backup_id, "restore_id": restore_id}
    result, failures = _execute(
        settings, "restore", tenant_id, run_config={"ops": {"restore_tenant": {"config": config}}}
    )
    return {"report": _output(result, "restore_tenant"), "run_id": result.run_id, "failures": failures}


def run_retention(settings: Settings, day: str) -> dict[str, Any]:
    """Run the `retention` job for one day partition now; returns the sweep summary and the run."""
    result, failures = _execute(settings, "retention", "", day=day)
    return {"sweep": _output(result, "retention_sweep"), "run_id": result.run_id, "failures": failures}


def run_evaluation(settings: Settings, month: str) -> dict[str, Any]:
    """Materialize `memory_eval` and `memory_drift` for one month partition (YYYY-MM-01) now."""
    result, failures = _execute(settings, "memory_evaluation", "", day=month)
    figures = _asset_figures(result, leave_out=("trend",))  # the trend is Markdown with an embedded PNG
    checks = {
        e.check_name: {"passed": e.passed, "severity": e.severity.value} for e in result.get_asset_check_evaluations()
    }
    return {
        "month": month[:7],
        "run_id": result.run_id,
        "success": result.success,
        "assets": figures,
        "checks": checks,
        "failures": failures,
    }


def materialize(settings: Settings, tenant_id: str, select: Sequence[str] | None = None) -> dict[str, Any]:
    """Materialize `select` (default: every asset) for one tenant; returns counts and check results."""
    import dagster as dg

    chosen = list(select or ALL_ASSETS)
    unknown = sorted(set(chosen) - set(ALL_ASSETS))
    if unknown:
        raise ValidationError("select", f"unknown asset(s) {', '.join(unknown)}; choose from {', '.join(ALL_ASSETS)}")
    store = open_store(settings)
    try:
        store.require_tenant(tenant_id=tenant_id)
    finally:
        store.close()
    result, failures = _execute(
        settings, "tenant_refresh", tenant_id, asset_selection=[dg.AssetKey(name) for name in chosen]
    )
    return {
        "tenant": tenant_id,
        "run_id": result.run_id,
        "success": result.success,
        "assets": _asset_figures(result),
        "checks": {e.check_name: e.passed for e in result.get_asset_check_evaluations()},
        "failures": failures,
    }
