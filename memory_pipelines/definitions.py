"""Code location: everything under memory_pipelines/defs/."""

import functools
import os
from pathlib import Path

import dagster as dg

# What a build reads of the environment: our variables only (defs/resources.py chooses each resource's
# source by which of them are set). Dagster adds others of its own in a run worker (SF_PARTNER).
READS = "MEMORY_PIPELINES_"


@dg.definitions
def defs() -> dg.Definitions:
    return built()


def built() -> dg.Definitions:
    """The definitions for this process's settings, built once for them. The warm code server's fork
    server builds them before it forks a run worker (memory_pipelines/launch/built_definitions.py),
    so a worker, forked with the same environment, does not build them again."""
    return build_for(tuple(sorted((name, value) for name, value in os.environ.items() if name.startswith(READS))))


@functools.lru_cache(maxsize=1)
def build_for(settings: tuple[tuple[str, str], ...]) -> dg.Definitions:
    """The definitions, built from scratch. `settings` (READS's variables) only keys the cache: the
    build reads os.environ itself, so the same code under other settings builds other definitions."""
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent / "defs")
