"""Launching Dagster runs from our commands: through the instance and a warm code server of HOME
(`materialize`, `code_server`), the `dev` UI (`devserver`), and the few Dagster internals those
need, in one place (`dagster_internals`)."""
