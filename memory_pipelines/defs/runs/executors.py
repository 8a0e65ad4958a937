"""Every job's executor holds the run's lease (lib/infra/leases.py) while it orchestrates the run,
so a run whose worker died is found by anyone sharing the instance (defs/runs/sensors.py).

Each is Dagster's own executor, same name and config (the launchpad's `execution:` is unchanged; a
run that sets none runs its steps in its worker), held as a field and wrapped: the lease is taken
before the first step and tagged on the run, so a STARTED run tagged and without its lease has lost
its worker.
"""

from collections.abc import Iterator
from typing import Any

import dagster as dg

from memory_pipelines.launch.dagster_internals import hold_connections, instance_conninfo
from memory_pipelines.lib.infra import faults, leases

# Set on a run once its worker holds the lease: from then on a free lease means a dead worker.
LEASE_TAG = "memory_pipelines/lease"


class LeasedExecutor(dg.Executor):
    """Dagster's executor `inner`, run under the run's lease."""

    def __init__(self, inner: dg.Executor) -> None:
        self.inner = inner

    @property
    def retries(self) -> Any:
        return self.inner.retries

    @property
    def step_dependency_config(self) -> Any:
        return self.inner.step_dependency_config

    def execute(self, plan_context: Any, execution_plan: Any) -> Iterator[dg.DagsterEvent]:
        instance = plan_context.instance
        conninfo = instance_conninfo(instance)
        if conninfo is None:  # an in-memory or SQLite instance: one process, nobody to tell
            yield from self.inner.execute(plan_context, execution_plan)
            return
        hold_connections(instance)  # every event of the run is written through it
        with leases.held(conninfo, plan_context.run_id):
            instance.add_run_tags(plan_context.run_id, {LEASE_TAG: "held"})
            faults.point("run.leased")
            yield from self.inner.execute(plan_context, execution_plan)


def leased(inner: dg.ExecutorDefinition, *, default: dict[str, Any] | None = None) -> dg.ExecutorDefinition:
    """`inner` under the same name and config, its executor wrapped in the run's lease; `default`,
    when given, is the config of a run whose config sets no `execution:`."""
    schema = inner.config_schema.as_field()
    if default is not None:
        schema = dg.Field(schema.config_type, default_value=default, description=schema.description)
    return dg.ExecutorDefinition(
        name=inner.name,
        config_schema=schema,
        requirements=inner.get_requirements,
        executor_creation_fn=lambda context: _created(inner, context),
        description=inner.description,
    )


def _created(inner: dg.ExecutorDefinition, context: dg.InitExecutorContext) -> LeasedExecutor:
    faults.point("run.executor")  # in the worker, before the run is STARTED
    return LeasedExecutor(inner.executor_creation_fn(context))  # type: ignore[misc]


leased_in_process = leased(dg.in_process_executor)
# Steps run in the run's worker unless a run's config asks for `multiprocess`: a process per step
# imports Dagster, the code location and the embedding model again (docs/operating.md).
leased_default = leased(dg.multi_or_in_process_executor, default={"in_process": {}})


@dg.definitions
def executor() -> dg.Definitions:
    """The default of every job that names none (asset jobs, the launchpad's ad hoc runs)."""
    return dg.Definitions(executor=leased_default)
