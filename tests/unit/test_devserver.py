"""The `dev` supervisor (memory_pipelines/launch/devserver.py) on stand-in process trees: no Dagster, a second each.

The stand-in does what Dagster's commands do with signals: it copies its SIGINT disposition onto
SIGTERM (dagster/_utils/interrupts.py). Started the old way with SIGINT ignored, it ignores both.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memory_pipelines.launch.devserver import group_members

# Ignores SIGINT and SIGTERM outright, as the old code servers did.
STUBBORN = "import signal, time; [signal.signal(s, signal.SIG_IGN) for s in (2, 15)]; time.sleep(600)"

STAND_IN = """
import json, os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))  # as Dagster's setup_interrupt_handlers
mode, ready = sys.argv[1], sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", STUBBORN if mode != "polite" else "import time; time.sleep(600)"])
def ignoring(pid):  # SigIgn has SIGINT (bit 1) and SIGTERM (bit 14): the child set them before any signal
    with open(f"/proc/{pid}/status") as status:
        return any(l.startswith("SigIgn:") and int(l.split()[1], 16) & 0x4002 == 0x4002 for l in status)
while mode != "polite" and not ignoring(child.pid):
    time.sleep(0.01)
seen = {name: str(signal.getsignal(getattr(signal, name))) for name in ("SIGINT", "SIGTERM", "SIGHUP")}
with open(ready + ".tmp", "w") as out:
    json.dump({"pid": child.pid, "seen": seen}, out)
os.rename(ready + ".tmp", ready)
if mode == "quits":
    sys.exit(3)
try:
    time.sleep(600)
except KeyboardInterrupt:
    child.wait()
""".replace("STUBBORN", repr(STUBBORN))

# The supervisor in a process of its own, started as `sh -c 'cmd &'` or `nohup` would: the
# dispositions given in argv are set to ignored first. It prints the outcome as JSON.
DRIVER = """
import dataclasses, json, os, signal, sys
for name in sys.argv[3].split(","):
    if name:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
from memory_pipelines.launch.devserver import run_supervised
command = [sys.executable, "-c", sys.argv[1], *sys.argv[2].split("|")]
outcome = run_supervised(command, dict(os.environ), grace=float(sys.argv[4]), on_stop="stopping on {signal}")
print(json.dumps(dataclasses.asdict(outcome)))
"""


def _start(tmp_path: Path, mode: str, ignored: str, grace: float = 5.0) -> tuple[subprocess.Popen[str], dict]:
    ready = tmp_path / "ready.json"
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, STAND_IN, f"{mode}|{ready}", ignored, str(grace)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a stray signal to our group never reaches pytest
    )
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert time.monotonic() < deadline, "the stand-in did not start"
        assert driver.poll() is None or mode == "quits", driver.communicate()
        time.sleep(0.05)
    return driver, json.loads(ready.read_text())


def _supervised_pids(driver: subprocess.Popen[str]) -> list[int]:
    """The driver's child (the stand-in, leader of its own group) and that group's members."""
    children = Path(f"/proc/{driver.pid}/task/{driver.pid}/children").read_text().split()
    assert len(children) == 1
    return group_members(int(children[0]))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.fixture(autouse=True)
def _linux_only() -> None:
    if not Path("/proc/self/stat").exists():
        pytest.skip("reads /proc")


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_started_with_sigint_ignored_it_still_ends_everything_gracefully(tmp_path, stop_signal):
    driver, ready = _start(tmp_path, "polite", "SIGINT,SIGQUIT,SIGHUP", grace=20.0)
    # The stand-in got a terminal's dispositions, except SIGHUP, which nohup meant to ignore.
    assert ready["seen"]["SIGINT"] == str(signal.default_int_handler)
    assert ready["seen"]["SIGTERM"] == str(signal.default_int_handler)
    assert ready["seen"]["SIGHUP"] == str(signal.Handlers.SIG_IGN)
    pids = _supervised_pids(driver)
    assert ready["pid"] in pids and len(pids) == 2
    started = time.monotonic()
    os.kill(driver.pid, stop_signal)
    out, err = driver.communicate(timeout=60)
    outcome = json.loads(out)
    assert outcome["stop_signal"] == stop_signal
    assert outcome["killed"] is False, "the stand-in ends on SIGINT: no SIGKILL needed"
    assert outcome["returncode"] == 0 and outcome["left"] == []
    assert time.monotonic() - started < 20  # before the grace ended: nothing waited for it
    assert not [pid for pid in pids if _alive(pid)]
    assert f"stopping on {signal.Signals(stop_signal).name}" in err


def test_processes_that_ignore_every_signal_are_killed_after_the_grace_period(tmp_path):
    driver, ready = _start(tmp_path, "stubborn", "SIGINT", grace=1.0)
    pids = _supervised_pids(driver)
    assert ready["pid"] in pids
    started = time.monotonic()
    os.kill(driver.pid, signal.SIGTERM)
    outcome = json.loads(driver.communicate(timeout=60)[0])
    elapsed = time.monotonic() - started
    assert outcome["killed"] is True and outcome["left"] == []
    assert 1.0 <= elapsed < 1.0 + 8  # after the grace, and not much later
    assert not [pid for pid in pids if _alive(pid)]


def test_a_second_signal_does_not_wait_for_the_grace_period(tmp_path):
    driver, _ready = _start(tmp_path, "stubborn", "", grace=30.0)
    pids = _supervised_pids(driver)
    started = time.monotonic()
    os.kill(driver.pid, signal.SIGINT)
    time.sleep(0.5)
    os.kill(driver.pid, signal.SIGINT)  # Ctrl-C twice
    outcome = json.loads(driver.communicate(timeout=60)[0])
    assert outcome["killed"] is True and time.monotonic() - started < 15  # far from the 30 s grace
    assert not [pid for pid in pids if _alive(pid)]


def test_a_command_that_ends_by_itself_leaves_nothing_in_its_group(tmp_path):
    driver, ready = _start(tmp_path, "quits", "SIGINT", grace=1.0)
    outcome = json.loads(driver.communicate(timeout=60)[0])
    # Its stubborn child was left in its group: killed after the grace period.
    assert outcome["stop_signal"] is None and outcome["returncode"] == 3
    assert outcome["killed"] is True and outcome["left"] == []
    assert not _alive(ready["pid"])
