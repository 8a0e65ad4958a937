from typing import Any

import dagster as dg

from memory_pipelines.defs.forget.ops import deletion_service

__all__ = ["FORGET_JOB", "deletion_service", "forget_job", "forget_run_config"]

FORGET_JOB = "forget"

forget_job = dg.define_asset_job(
    FORGET_JOB,
    selection=dg.AssetSelection.assets("memory_deletions"),
    executor_def=dg.in_process_executor,  # the batch (lock, probes) lives in the run's one process
    description="Forget: freeze a batch of one tenant's deletion jobs, delete through every registered store,"
    " verify, prove.",
    tags={"domain": "forget"},
)


def forget_run_config(*, job_ids: list[str], **request: Any) -> dict[str, Any]:
    """Run config of a `forget` run for existing job ids (empty: every REQUESTED or BLOCKED job of the tenant).

    Keyword arguments instead of job ids make a new request (scope, subject, memory_id, version,
    confirm, basis, requested_by), validated in the run's freeze step.
    """
    config: dict[str, Any] = {"job_ids": list(job_ids), **{k: v for k, v in request.items() if v is not None}}
    return {"ops": {"memory_deletions": {"ops": {"freeze": {"config": config}}}}}
