"""Another local user (`nobody`), for the tests of what such a user can and cannot do."""

from __future__ import annotations

import json
import subprocess
from typing import Any

__all__ = ["AS_NOBODY", "run_as_nobody"]

AS_NOBODY = ("setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups")


def run_as_nobody(script: str, *args: str, timeout: float = 120) -> Any:
    """Run `script` as `nobody` with the system's python3 (the project's may sit under /root) in
    isolated mode from /, and return the JSON its last line prints."""
    done = subprocess.run(
        [*AS_NOBODY, "/usr/bin/python3", "-I", "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
