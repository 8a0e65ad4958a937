"""Code location: everything under memory_pipelines/defs/."""

import functools
from pathlib import Path

import dagster as dg


@dg.definitions
def defs() -> dg.Definitions:
    return built()


@functools.cache
def built() -> dg.Definitions:
    """The definitions, built once per process. The warm code server's fork server builds them before
    it forks a run worker (memory_pipelines/launch/built_definitions.py), so no worker builds them again."""
    return dg.load_from_defs_folder(path_within_project=Path(__file__).parent / "defs")
