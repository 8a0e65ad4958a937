"""Pure logic of memory_pipelines: no dagster import, reusable by the API, the CLI and the defs."""
