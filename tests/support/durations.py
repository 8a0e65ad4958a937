"""How long each test module took in a recorded run, so the longest start first on the xdist workers.

Each module runs whole on one worker (`--dist loadscope` in pyproject.toml), so its module-scoped
fixtures (a HOME with its servers, the crypto-erasure test's four written and forgotten tenants) are
built once, not once per worker that got one of its tests. `tests/conftest.py` orders the modules
by their recorded total, longest first, and xdist keeps that order (`--no-loadscope-reorder`), so
the run ends with short modules on both workers; in file order the daemon test started last.
Refresh the record after adding a long test:

    .venv/bin/pytest --junitxml=/tmp/run.xml && .venv/bin/python -m tests.support.durations /tmp/run.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

RECORD = Path(__file__).resolve().parents[1] / "durations.json"
# Below this a test's place in the order does not matter; leaving it out keeps the record short.
RECORDED_FROM_SECONDS = 1.0
# An unrecorded test marked slow (a new one) is assumed to take this long; an unmarked one, nothing.
UNRECORDED_SLOW_SECONDS = 20.0


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load() -> dict[str, float]:
    """Recorded seconds per module."""
    if not RECORD.exists():
        return {}
    return {str(k): float(v) for k, v in json.loads(RECORD.read_text()).items()}


def from_junit(path: Path) -> dict[str, float]:
    """Seconds per module (setup, call and teardown of its tests) from a pytest --junitxml file."""
    totals: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        totals[module] = totals.get(module, 0.0) + float(case.get("time", "0"))
    return {m: round(s, 1) for m, s in sorted(totals.items(), key=lambda kv: -kv[1]) if s >= RECORDED_FROM_SECONDS}


if __name__ == "__main__":
    RECORD.write_text(json.dumps(from_junit(Path(sys.argv[1])), indent=1) + "\n")
    print(f"wrote {RECORD}")
