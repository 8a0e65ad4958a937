"""A snapshot of the code location as the UI shows it: asset keys with group, kinds, owners,
partitions, deps and checks; jobs; sensors and schedules with their default status.

A change to any of them fails here until the snapshot is regenerated on purpose:
    MEMORY_PIPELINES_UPDATE_SNAPSHOT=1 .venv/bin/pytest tests/test_defs_snapshot.py
and the diff of tests/snapshots/definitions.json is reviewed with the change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg

from memory_pipelines.definitions import defs

SNAPSHOT = Path(__file__).parent / "snapshots" / "definitions.json"


def _partitions(partitions_def: Any) -> str | None:
    if partitions_def is None:
        return None
    if isinstance(partitions_def, dg.DynamicPartitionsDefinition):
        return f"dynamic:{partitions_def.name}"
    return type(partitions_def).__name__


def snapshot() -> dict[str, Any]:
    definitions = defs()
    checks: dict[str, list[str]] = {}
    for check_key in definitions.resolve_asset_graph().asset_check_keys:
        checks.setdefault(check_key.asset_key.to_user_string(), []).append(check_key.name)
    assets = {}
    for assets_def in definitions.resolve_all_asset_specs():
        name = assets_def.key.to_user_string()
        assets[name] = {
            "group": assets_def.group_name,
            "kinds": sorted(assets_def.kinds),
            "owners": list(assets_def.owners),
            "partitions": _partitions(assets_def.partitions_def),
            "deps": sorted(dep.asset_key.to_user_string() for dep in assets_def.deps),
            "checks": sorted(checks.get(name, [])),
            "automation": assets_def.automation_condition is not None,
            "description": assets_def.description,
        }
    repository = definitions.get_repository_def()
    return {
        "assets": assets,
        "jobs": sorted(job.name for job in repository.get_all_jobs() if not job.name.startswith("__")),
        "sensors": {s.name: s.default_status.value for s in repository.sensor_defs},
        "schedules": {s.name: [s.cron_schedule, s.default_status.value] for s in repository.schedule_defs},
    }


def test_definitions_match_the_snapshot():
    current = snapshot()
    if os.environ.get("MEMORY_PIPELINES_UPDATE_SNAPSHOT") == "1":
        SNAPSHOT.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    assert current == json.loads(SNAPSHOT.read_text())


def test_every_asset_has_group_owner_kind_and_a_one_line_description():
    for name, asset in snapshot()["assets"].items():
        assert asset["group"] != "default", name
        assert asset["owners"] == ["team:memory-platform"], name
        assert asset["kinds"], name
        assert asset["description"] and "\n" not in asset["description"].strip(), name


def test_loading_the_code_location_warns_about_nothing():
    """No beta, preview, supersession or deprecation warning from our definitions at load."""
    code = (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    from memory_pipelines.definitions import defs\n"
        "    d = defs(); d.resolve_asset_graph(); d.get_repository_def().get_all_jobs()\n"
        "for w in caught:\n"
        "    print(f'{w.category.__name__}: {w.filename}:{w.lineno}: {w.message}')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=True)
    ours = [line for line in result.stdout.splitlines() if "memory_pipelines" in line or "dagster" in line]
    assert ours == [], "\n".join(ours)
