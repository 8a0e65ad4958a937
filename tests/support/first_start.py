"""Starts several fresh HOMEs at once, one process each, and reports what happened as JSON.

Run inside the namespace a test prepares (a private /etc without the service user, or a user
namespace where the caller is not root): `python -m tests.support.first_start HOME...`. Each child
imports everything first and then waits at a barrier, so the first starts begin within a
millisecond of each other: the window in which two processes both find no service user is hit, not
left to chance. Every HOME is then checked with the CLI (`tenants`) and stopped, whatever happened.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memory_pipelines.lib.infra.machine import SERVICE_USER

CLI = Path(sys.executable).parent / "memory-pipelines"


def _owners(pgdata: Path) -> list[int]:
    uids = {pgdata.stat().st_uid} if pgdata.exists() else set()
    for root, dirs, files in os.walk(pgdata):
        uids.update(os.lstat(os.path.join(root, name)).st_uid for name in dirs + files if name != ".handle_pids.json")
    return sorted(uids)


def child(home: str, barrier: str, index: str) -> None:
    from memory_pipelines.lib.infra.services import ensure_services
    from memory_pipelines.lib.infra.settings import Settings

    settings = Settings.from_env({"MEMORY_PIPELINES_HOME": home})
    Path(barrier, f"ready-{index}").touch()
    while not Path(barrier, "go").exists():
        time.sleep(0.001)
    ensure_services(settings)


def main(homes: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMORY_PIPELINES_")}
    barrier = tempfile.mkdtemp()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.first_start", "--child", home, barrier, str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i, home in enumerate(homes)
    ]
    deadline = time.monotonic() + 120
    while len(list(Path(barrier).glob("ready-*"))) < len(homes) and time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in procs):
            break
        time.sleep(0.01)
    Path(barrier, "go").touch()
    results: list[dict[str, Any]] = []
    for home, proc in zip(homes, procs, strict=True):
        _out, err = proc.communicate(timeout=300)
        results.append({"home": home, "rc": proc.returncode, "stderr": err[-2000:]})
    try:
        service = pwd.getpwnam(SERVICE_USER).pw_uid if os.geteuid() == 0 else os.geteuid()
    except KeyError:
        service = None
    for result in results:
        # A start that "succeeded" must have left a HOME that later commands can use.
        listed = subprocess.run(
            [str(CLI), "--home", result["home"], "tenants"], capture_output=True, text=True, env=env, timeout=120
        )
        result["tenants"] = {"rc": listed.returncode, "stdout": listed.stdout, "stderr": listed.stderr[-2000:]}
        result["owners"] = _owners(Path(result["home"]) / "pg" / "data")
        stopped = subprocess.run(
            [str(CLI), "--home", result["home"], "stop"], capture_output=True, text=True, env=env, timeout=120
        )
        result["stop"] = json.loads(stopped.stdout) if stopped.returncode == 0 else stopped.stderr
    shutil.rmtree(barrier, ignore_errors=True)
    print(json.dumps({"euid": os.geteuid(), "service_uid": service, "results": results}))


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:
        main(sys.argv[1:])
