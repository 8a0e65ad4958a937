"""The forget graph's own resource: `forget_batch`, the holder of a run's batch (see ops.py)."""

import dagster as dg

from memory_pipelines.defs.forget.ops import forget_batch


@dg.definitions
def forget_resources() -> dg.Definitions:
    return dg.Definitions(resources={"forget_batch": forget_batch})
