"""The one place that decides local (embedded) versus production resources, from the environment."""

import os

import dagster as dg

from memory_pipelines.lib.settings import DEFAULT_HOME, ENV_HOME, ENV_KMS_KEY_ID, ENV_PG_URL
from memory_pipelines.resources import MemoryStoreResource


def _env_or(name: str, default: str | None) -> dg.EnvVar | str | None:
    # Read at definitions load, not import; EnvVar keeps the value out of the UI and run config.
    return dg.EnvVar(name) if os.environ.get(name) else default


@dg.definitions
def resources() -> dg.Definitions:
    return dg.Definitions(
        resources={
            "memory_store": MemoryStoreResource(
                home=_env_or(ENV_HOME, DEFAULT_HOME),  # type: ignore[arg-type]
                pg_url=_env_or(ENV_PG_URL, None),
                kms_key_id=_env_or(ENV_KMS_KEY_ID, None),
            )
        }
    )
