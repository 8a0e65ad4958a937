"""The embedded Chroma server's door: nobody else can reach it, stand in its place or shut it
(issue 34, findings 2 and 3).

On e54b03f the door was a TCP port on 127.0.0.1. `nobody` could shut it: `Door.serve` ended its
accept loop on EMFILE, and 1,100 connections held open left it alive but deaf. And `nobody` could
stand in its place: once the pair restarted on a new port, a long-lived process still sent its
token to the old one, which `nobody` had bound. Now the door is HOME/chroma/door.sock, in a
directory only the owner may enter, and it sheds rather than closes when descriptors run out.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memory_pipelines.lib.infra.services import ensure_services, stop_services
from memory_pipelines.lib.infra.settings import Settings
from tests.conftest import settings_for
from tests.support.cpu_share import own_cpu_share
from tests.support.local_user import AS_NOBODY

pytestmark = pytest.mark.slow

CONNECTIONS = 2000
DESCRIPTORS = 200  # the proxy's limit while the flood runs
# Run with the system's python3: hold CONNECTIONS connections to the door open, each sent one byte
# of a request head and another every few seconds, opening new ones as the door closes old ones.
FLOOD = textwrap.dedent(
    """
    import collections, json, resource, socket, sys, time
    door, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 200), hard))
    held, opened, most, end = [], 0, 0, time.monotonic() + seconds
    refused = collections.Counter()
    while time.monotonic() < end:
        while len(held) < count and time.monotonic() < end:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(2)
                sock.connect(door)
                sock.sendall(b"G")
                sock.setblocking(False)
            except OSError as exc:
                sock.close()
                refused[type(exc).__name__] += 1
                break
            held.append(sock)
            opened += 1
        most = max(most, len(held))
        time.sleep(1.0)
        alive = []
        for sock in held:
            try:
                if sock.recv(1) == b"":
                    sock.close()
                    continue
            except BlockingIOError:
                pass
            except OSError:
                sock.close()
                continue
            try:
                sock.send(b"E")
            except OSError:
                sock.close()
                continue
            alive.append(sock)
        held = alive
    print(json.dumps({"opened": opened, "most": most, "refused": refused}))
    """
)
# The owner's operations, each in a process of its own (new connections through the door).
OWNER = textwrap.dedent(
    """
    import secrets, sys
    from memory_pipelines import MemoryPlatform
    mp = MemoryPlatform.from_env()
    tenant, what, arg = sys.argv[1], sys.argv[2], sys.argv[3]
    if what == "recall":
        hits = mp.recall(tenant_id=tenant, user_id="alice", query=f"{arg} {secrets.token_hex(4)}", k=3)
        assert hits, "nothing recalled"
    else:
        assert mp.forget(tenant_id=tenant, memory_id=arg).wait(timeout=120)["state"] == "COMPLETE"
    """
)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    settings = settings_for(tmp_path_factory.mktemp("flood") / "home")
    ensure_services(settings)
    try:
        yield settings
    finally:
        stop_services(settings)


def _owner(settings: Settings, tenant: str, what: str, arg: str) -> float:
    """Seconds for a new process to start, reach the services and do `what`: a door that does not
    answer shows in the start (e54b03f waited 62 s there before restarting the pair)."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", OWNER, tenant, what, arg],
        env={**os.environ, "MEMORY_PIPELINES_HOME": str(settings.home)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return time.perf_counter() - started


def _proxy(settings: Settings) -> tuple[int, str]:
    """The proxy's pid and door, as `chroma/server.json` records them."""
    state = json.loads((settings.chroma_path / "server.json").read_text())
    return int(state["proxy_pid"]), str(state["socket"])


def _write(settings: Settings, tenant: str, count: int) -> list[str]:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json; from memory_pipelines import MemoryPlatform; mp = MemoryPlatform.from_env();"
            f"ids = [mp.write(tenant_id={tenant!r}, user_id='alice', text=f'alice note {{i}} on bees')['memory_id']"
            f" for i in range({count})]; mp.sync(tenant_id={tenant!r}); print(json.dumps(ids))",
        ],
        env={**os.environ, "MEMORY_PIPELINES_HOME": str(settings.home)},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _flood(door: str, seconds: int, *, as_nobody: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *(AS_NOBODY if as_nobody else ()),
            "/usr/bin/python3",
            "-I",
            "-c",
            FLOOD,
            door,
            str(CONNECTIONS),
            str(seconds),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to `nobody` needs root (CI runs as root)")
def test_a_flood_never_closes_the_door_and_another_user_cannot_even_knock(home: Settings) -> None:
    # The owner, the door and both floods on a CPU share of their own: the suite's other tests, on the
    # other workers, stay out of the owner's timings (tests/support/cpu_share.py).
    with own_cpu_share(home=home.home):
        settings = home
        tenant = "flood"
        ids = _write(settings, tenant, 6)
        proxy, door = _proxy(settings)
        # Fewer descriptors than the door lets connections wait without the token (256): the flood
        # runs it out of them (EMFILE), where the door of e54b03f stopped accepting for good.
        subprocess.run(["prlimit", f"--pid={proxy}", f"--nofile={DESCRIPTORS}:{DESCRIPTORS}"], check=True)
        usual_recall = statistics.median(_owner(settings, tenant, "recall", "bees") for _ in range(3))
        usual_forget = _owner(settings, tenant, "forget", ids[0])

        # Another user's flood (issue 34's): not one connection, so the owner's work goes at its usual pace.
        nobody = _flood(door, 20, as_nobody=True)
        try:
            time.sleep(3)
            during_recall = max(_owner(settings, tenant, "recall", "bees") for _ in range(3))
            during_forget = _owner(settings, tenant, "forget", ids[1])
        finally:
            nobody_out, nobody_err = nobody.communicate(timeout=120)
        knocked = json.loads(nobody_out)
        assert knocked["opened"] == 0 and set(knocked["refused"]) == {"PermissionError"}, (knocked, nobody_err[-500:])
        assert during_recall < usual_recall + 2.0, (usual_recall, during_recall)
        assert during_forget < usual_forget + 2.0, (usual_forget, during_forget)

        # The owner's own flood without the token (a leaking client of theirs, not a boundary: the owner
        # may stop the server anyway), 2,000 connections at a time: the door runs out of descriptors,
        # sheds waiting connections that sent no whole head, and goes on accepting; the owner's work is
        # slower behind it (the door serves connections in turn) but done.
        flood = _flood(door, 40, as_nobody=False)
        try:
            # The flood at full strength: a busy machine's flood takes longer to get there (a full run of
            # 2026-12-06 looked for 2 s after a fixed 8 and saw 104 of 200), so look until it is or 30 s.
            in_use, until = 0, time.monotonic() + 30
            while in_use < DESCRIPTORS - 24 and time.monotonic() < until and flood.poll() is None:
                in_use = max(in_use, _descriptors(proxy))
                time.sleep(0.05)
            behind_recall = _owner(settings, tenant, "recall", "bees")
            behind_forget = _owner(settings, tenant, "forget", ids[2])
        finally:
            out, err = flood.communicate(timeout=120)
        held = json.loads(out)
        # At its limit, less what one shed frees (16) and what the sampling misses between two looks.
        assert in_use >= DESCRIPTORS - 24, f"the proxy held {in_use} descriptors of {DESCRIPTORS}"
        # Accepted far past its descriptors (with its shedding off, as on e54b03f, it stopped at 325).
        assert held["opened"] >= 3 * DESCRIPTORS, f"the flood held {held} ({err[-500:]})"
        assert behind_recall < 60 and behind_forget < 90, (behind_recall, behind_forget)
        # Afterwards nothing needs a restart: the same proxy serves a recall at its usual pace.
        assert _proxy(settings) == (proxy, door) and Path(f"/proc/{proxy}").exists()
        assert _owner(settings, tenant, "recall", "bees") < usual_recall + 2.0


# A long-lived process using the Python API, one command per line on stdin, one JSON line back. An
# audit hook records every TCP connection it makes: a port it used is a port someone could take.
LONG_LIVED = textwrap.dedent(
    """
    import json, secrets, socket, sys
    tcp = []

    def audit(event, args):
        if event == "socket.connect" and args[0].family in (socket.AF_INET, socket.AF_INET6):
            tcp.append(list(args[1][:2]))

    sys.addaudithook(audit)
    from memory_pipelines import MemoryPlatform

    mp = MemoryPlatform.from_env()
    tenant = sys.argv[1]
    for line in sys.stdin:
        what, arg = json.loads(line)
        try:
            if what == "write":
                result = [mp.write(tenant_id=tenant, user_id="alice", text=f"alice note {i} on bees")["memory_id"]
                          for i in range(arg)]
                mp.sync(tenant_id=tenant)
            elif what == "recall":
                result = len(mp.recall(tenant_id=tenant, user_id="alice", query=f"{arg} {secrets.token_hex(4)}", k=3))
            else:
                result = mp.forget(tenant_id=tenant, memory_id=arg).wait(timeout=120)["state"]
            print(json.dumps({"result": result, "tcp": tcp}), flush=True)
        except Exception as exc:
            print(json.dumps({"error": f"{type(exc).__name__}: {exc}", "tcp": tcp}), flush=True)
    """
)
# Run by `nobody`: listen on every port given, and at the door's path, until stdin closes; print
# what each received.
SQUATTER = textwrap.dedent(
    """
    import json, os, select, socket, sys
    door, ports = sys.argv[1], [int(p) for p in sys.argv[2:]]
    out = {"listening": [], "received": {}, "door": None}
    listeners = []
    for port in ports:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(16)
        except OSError as exc:
            out["received"][str(port)] = f"cannot listen: {exc}"
            continue
        listeners.append(sock)
        out["listening"].append(port)
    try:
        os.unlink(door)
        out["door"] = "removed"
    except OSError as exc:
        out["door"] = type(exc).__name__
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin, *listeners], [], [], 1.0)
        if sys.stdin in ready:
            break
        for sock in ready:
            conn, _ = sock.accept()
            conn.settimeout(2)
            try:
                data = conn.recv(65536)
            except OSError:
                data = b""
            out["received"][str(sock.getsockname()[1])] = data.decode(errors="replace")
            conn.close()
    print(json.dumps(out))
    """
)


def _ask(process: subprocess.Popen[str], what: str, arg: object) -> dict[str, Any]:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(json.dumps([what, arg]) + "\n")
    process.stdin.flush()
    line = process.stdout.readline()
    assert line, f"the long-lived process ended: {process.stderr.read() if process.stderr else ''}"
    return dict(json.loads(line))


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to `nobody` needs root (CI runs as root)")
def test_a_squatter_gets_nothing_and_a_long_lived_client_outlives_the_pair(home: Settings) -> None:
    """The pair dies under a long-lived process (the door shut, a host's OOM killer); `nobody` stands
    on every port that process ever connected to and tries the door's path. The process's next
    recall starts the pair again behind the same door and goes on; nothing reached `nobody`."""
    settings = home
    process = subprocess.Popen(
        [sys.executable, "-c", LONG_LIVED, "squat"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MEMORY_PIPELINES_HOME": str(settings.home)},
    )
    squatter = None
    try:
        ids = _ask(process, "write", 4)["result"]
        before = _ask(process, "recall", "bees")
        assert before["result"] == 3, before
        proxy, door = _proxy(settings)
        server = int(json.loads((settings.chroma_path / "server.json").read_text())["pid"])
        args = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
        inner = int(args[args.index(b"--port") + 1])  # the server's own port, in its namespace
        os.killpg(proxy, signal.SIGKILL)  # no cleanup: the door's file stays, with nothing behind it
        deadline = time.monotonic() + 30
        while Path(f"/proc/{server}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        ports = sorted({int(port) for _, port in before["tcp"]} | {inner})
        squatter = subprocess.Popen(
            [*AS_NOBODY, "/usr/bin/python3", "-I", "-c", SQUATTER, door, *map(str, ports)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "ready", squatter.stderr
        after = _ask(process, "recall", "bees")  # nothing answers at the door: the pair is started again
        restarted = _proxy(settings)
        forgotten = _ask(process, "forget", ids[0])
        again = _ask(process, "recall", "bees")
        out, err = squatter.communicate("", timeout=60)
    finally:
        process.kill()
        process.wait(30)
        if squatter is not None and squatter.poll() is None:
            squatter.kill()
    assert after["result"] == 3 and forgotten["result"] == "COMPLETE" and again["result"] == 3, (after, forgotten)
    # The whole life of the process, restart included, without one TCP connection: no port to take.
    assert again["tcp"] == [], again["tcp"]
    seen = json.loads(out)
    assert seen["door"] == "PermissionError" and seen["received"] == {}, (seen, err[-500:])
    assert seen["listening"] == ports  # the squatter did stand where the server's port had been
    assert restarted[0] != proxy and restarted[1] == door, "the recall itself started the pair again"
