"""Issue 21, item 3 (files): everything the project creates under HOME is its owner's alone, whatever
the umask. On 970c91a, with umask 022, `chroma.sqlite3` and the analytics Parquet files were
world-readable; here the CLI and the Python API both run with umask 022 on a fresh HOME.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from memory_pipelines.lib.infra import services
from tests.conftest import CLI, settings_for

pytestmark = pytest.mark.slow

PLATFORM = """
from memory_pipelines import MemoryPlatform
with MemoryPlatform.from_env() as mp:
    mp.write(tenant_id="acme", user_id="bea", text="Bea's bike lock is 3141", category="general")
    mp.recall(tenant_id="acme", user_id="bea", query="bike lock", k=3)
    mp.sync(tenant_id="acme")
    mp.backup(tenant_id="acme")
"""


def _run(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MEMORY_PIPELINES_HOME": str(home)}
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, umask=0o022, check=False)


def _too_open(home: Path) -> list[str]:
    """Entries under HOME that anyone but their owner may read, write or list (HOME and HOME/pg may be
    traversable by PostgreSQL's service user as root: 0711, never listable)."""
    traversable = {home, home / "pg"} if os.geteuid() == 0 else set()
    found = []
    for root, dirs, files in os.walk(home):
        for name in [*dirs, *files, ""]:
            path = Path(root) / name if name else Path(root)
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode) or (stat.S_ISSOCK(info.st_mode) and path.parent == home / "pg" / "data"):
                continue  # PostgreSQL's socket is 0777 by its default, inside its 0700 data directory
            extra = info.st_mode & 0o077
            if path in traversable:
                extra &= ~0o011
            if extra:
                found.append(f"{oct(info.st_mode & 0o777)} {path.relative_to(home)}")
    return sorted(set(found))


def test_nothing_under_home_is_open_to_others_whatever_the_umask(tmp_path):
    home = tmp_path / "private-home"
    settings = settings_for(home)
    try:

        def cli(*args: str) -> dict:
            result = _run([str(CLI), *args], home)
            assert result.returncode == 0, result.stderr
            return json.loads(result.stdout)

        cli("team", "add-member", "--tenant", "acme", "--team", "crew", "--user", "ann")
        cli("write", "--tenant", "acme", "--user", "ann", "--team", "crew", "Ann's badge is 2718")
        cli("write", "--tenant", "acme", "--user", "cal", "Cal's locker is 1618")
        assert cli("materialize", "--tenant", "acme")["success"] is True
        assert cli("analytics", "--tenant", "acme", "--sql", "SELECT count(*) FROM memories")["rows"] == [[2]]
        cli("backup", "--tenant", "acme")
        assert cli("forget", "--tenant", "acme", "--subject", "cal", "--wait")["state"] == "COMPLETE"
        assert cli("deletion", "erase", "--tenant", "acme")["success"] is True
        # The Python API in a process of its own, with umask 022 and no CLI around it.
        done = _run([sys.executable, "-c", PLATFORM], home)
        assert done.returncode == 0, done.stderr
        assert _too_open(home) == []
        if os.geteuid() == 0:
            # Read as another user would: nothing under HOME opens for `nobody`.
            for target in [home / "chroma" / "chroma.sqlite3", *home.glob("analytics/tenants/*/*/*.parquet")]:
                peek = subprocess.run(
                    ["runuser", "-u", "nobody", "--", "head", "-c", "16", str(target)],
                    capture_output=True,
                    timeout=30,
                    check=False,
                )
                assert peek.returncode != 0 and b"Permission denied" in peek.stderr, target
    finally:
        services.stop_services(settings)
