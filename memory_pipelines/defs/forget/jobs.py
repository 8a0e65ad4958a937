from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

import dagster as dg

from memory_pipelines.defs.forget.ops import deletion_service, switch_deletions
from memory_pipelines.defs.runs.executors import leased_in_process

__all__ = [
    "FORGET_JOB",
    "SWITCH_JOB",
    "deletion_service",
    "deletion_switch_job",
    "forget_job",
    "forget_run_config",
    "named_job_ids",
]

FORGET_JOB = "forget"

# The freeze step's config with a commented request of each scope. Dagster renders a job's default
# config as YAML without comments, but opens its launchpad on any YAML given in the `config` query
# parameter of `.../playground/setup`: the job's description links there. Such a launchpad has no
# partition picker, so the tenant is its `dagster/partition` tag (a placeholder that fails if kept).
TENANT_PLACEHOLDER = "TENANT"
LAUNCHPAD_REQUESTS = """\
# 1. Edit tags: set dagster/partition to the tenant (TENANT is a placeholder).
# 2. Uncomment ONE request below (delete its #s): job_ids, or a scope with its fields. 3. Launch Run.
ops:
  memory_deletions:
    ops:
      freeze:
        config:
          # Re-run existing jobs, e.g. BLOCKED ones; [] runs every REQUESTED or BLOCKED job of the tenant
          job_ids: []
          # SUBJECT: everything one user wrote, personal and team (the exact user id)
          # scope: SUBJECT
          # subject: alice
          # MEMORY: one memory, every version, or only `version`
          # scope: MEMORY
          # memory_id: m_0123456789abcdef0123456789abcdef
          # version: 2
          # TENANT: offboard the whole tenant; confirm repeats the tenant id
          # scope: TENANT
          # confirm: acme
          # Legal basis: gdpr-art17 (30 days), ccpa (45), user-request (30), retention, offboarding
          basis: user-request
          # requested_by: privacy-desk
"""
LAUNCHPAD_LINK = "/locations/memory_pipelines/jobs/forget/playground/setup?" + urlencode(
    {
        "config": LAUNCHPAD_REQUESTS,
        "tags[0][key]": "dagster/partition",
        "tags[0][value]": TENANT_PLACEHOLDER,
    },
    quote_via=quote,
)

HOW_TO = f"""Forget: freeze a batch of one tenant's deletion jobs, delete through every registered store, verify, prove.

**[Open the launchpad with a commented request of each scope]({LAUNCHPAD_LINK})**: set the tenant
(tag `dagster/partition`), uncomment one request, launch. Or open the launchpad, pick the tenant as the
partition, and give the `freeze` step's config (`ops.memory_deletions.ops.freeze.config`) one of:

```yaml
# Re-run existing jobs (e.g. BLOCKED ones); job_ids: [] runs every REQUESTED or BLOCKED job of the tenant
job_ids: [del_0123456789abcdef0123456789abcdef]

# SUBJECT: everything one user wrote, personal and team (the exact user id)
scope: SUBJECT
subject: alice
basis: gdpr-art17          # gdpr-art17 (30 days), ccpa (45), user-request (30), retention, offboarding

# MEMORY: one memory, every version (or only `version`)
scope: MEMORY
memory_id: m_0123456789abcdef0123456789abcdef
version: 2                 # leave it out for every version

# TENANT: offboard the whole tenant; confirm repeats the tenant id
scope: TENANT
confirm: acme
basis: offboarding
```

A new request is validated like `memory-pipelines forget`: a bad field fails the `freeze` step naming
it, and nothing is created. The CLI's `memory-pipelines forget --tenant T --subject U [--wait]` and
`forget_requests_sensor` run the same job.
"""

# The launchpad opens on this: every request field, null until set (a run's own config fills in the rest).
DEFAULT_REQUEST: dict[str, Any] = {
    "job_ids": [],
    "scope": None,
    "subject": None,
    "memory_id": None,
    "version": None,
    "confirm": None,
    "basis": "user-request",
    "requested_by": None,
}

forget_job = dg.define_asset_job(
    FORGET_JOB,
    selection=dg.AssetSelection.assets("memory_deletions"),
    config={"ops": {"memory_deletions": {"ops": {"freeze": {"config": DEFAULT_REQUEST}}}}},
    # One process, so every step shares the `forget_batch` resource's batch (lock, probes): see ops.py.
    executor_def=leased_in_process,
    description=HOW_TO,
    tags={"domain": "forget"},
)

SWITCH_JOB = "deletion_switch"


@dg.job(
    name=SWITCH_JOB,
    description="Incident switch: `action: pause` (with a `reason`) or `resume` deletion work of `tenant`"
    " (empty: every tenant). While paused, requests are accepted and hidden at once, but no cascade or"
    " erasure starts; deadlines keep running and every proof lists the pause. No COMPLETE job is re-opened.",
    tags={"domain": "forget"},
)
def deletion_switch_job() -> None:
    switch_deletions()


def forget_run_config(*, job_ids: list[str], **request: Any) -> dict[str, Any]:
    """Run config of a `forget` run for existing job ids (empty: every REQUESTED or BLOCKED job of the tenant).

    Keyword arguments instead of job ids make a new request (scope, subject, memory_id, version,
    confirm, basis, requested_by), validated in the run's freeze step.
    """
    config: dict[str, Any] = {"job_ids": list(job_ids), **{k: v for k, v in request.items() if v is not None}}
    return {"ops": {"memory_deletions": {"ops": {"freeze": {"config": config}}}}}


def named_job_ids(run_config: Mapping[str, Any]) -> list[str]:
    """The job ids a `forget` run's config names (the inverse of `forget_run_config`); [] for a new
    request or for "every pending job of the tenant"."""
    try:
        ids = run_config["ops"]["memory_deletions"]["ops"]["freeze"]["config"].get("job_ids") or []
    except (KeyError, TypeError, AttributeError):
        return []
    return [str(i) for i in ids] if isinstance(ids, list) else []
