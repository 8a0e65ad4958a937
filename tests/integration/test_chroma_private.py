"""No other local user can reach the embedded Chroma server. On 55bd21e `chroma run` listened on
127.0.0.1 with no authentication: any local user (`nobody` here) could list, read and delete every
tenant's vectors. Now the server runs in a network namespace of its own, and the only way in is its
proxy (lib/infra/chroma_proxy.py), which takes HOME's token (HOME/chroma/token, 0600) on a connection's
first request and refuses anything else with a 401 and a closed connection.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from memory_pipelines.lib.infra import processes, services, unix_http
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.stores.chroma.client import http_client
from memory_pipelines.lib.stores.chroma.index import VectorStore
from memory_pipelines.lib.stores.embedding import HashingEmbedder
from tests.conftest import settings_for
from tests.support.local_user import run_as_nobody

pytestmark = pytest.mark.slow

AS_ROOT = os.geteuid() == 0
LIST = "/api/v2/tenants/default_tenant/databases/default_database/collections"
SECRET_COLLECTION = "mem-secret-of-the-owner"

# Run by `nobody` with the system's python3 (the project's interpreter may sit under /root): what an
# attacker on the same machine can do with the paths in server.json and under HOME.
ATTACK = textwrap.dedent(
    """
    import json, os, socket, subprocess, sys

    door, inner, token_file, server_pid = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

    def ask(connect, extra=""):
        try:
            sock = connect()
        except OSError as exc:
            return {"connect": f"{type(exc).__name__}: {exc}"}
        sock.sendall(f"GET {LIST} HTTP/1.1\\r\\nHost: localhost\\r\\n{extra}\\r\\n".encode())
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except OSError:
            pass
        sock.close()
        return {"answer": data.decode(errors="replace")}

    def unix():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(door)
        return sock

    out = {
        "door": ask(unix),
        "door_with_a_guess": ask(unix, "Authorization: Bearer " + "A" * 43 + "\\r\\n"),
        "server_port": ask(lambda: socket.create_connection(("127.0.0.1", inner), timeout=5)),
    }
    # A door of one's own in its place: a file, or a socket bound beside it.
    for what, act in (
        ("replace", lambda: open(os.path.join(os.path.dirname(door), "door.sock.1"), "w")),
        ("bind", lambda: socket.socket(socket.AF_UNIX).bind(door + ".squat")),
    ):
        try:
            act()
            out[what] = "done"
        except OSError as exc:
            out[what] = f"{type(exc).__name__}: {exc}"
    try:
        open(token_file).read()
        out["token_file"] = "read"
    except OSError as exc:
        out["token_file"] = f"{type(exc).__name__}: {exc}"
    # Into the server's network namespace, where its own port is: needs CAP_SYS_ADMIN over it.
    done = subprocess.run(["nsenter", f"--net=/proc/{server_pid}/ns/net", "true"], capture_output=True, text=True)
    out["nsenter"] = {"code": done.returncode, "stderr": done.stderr.strip()}
    print(json.dumps(out))
    """
).replace("{LIST}", LIST)


def _server_port(state: dict[str, Any]) -> int:
    """The port `chroma run` itself listens on (its --port), which the proxy forwards to."""
    args = Path(f"/proc/{state['pid']}/cmdline").read_bytes().split(b"\0")
    return int(args[args.index(b"--port") + 1])


def _token(settings: Settings) -> str | None:
    try:
        return (settings.chroma_path / "token").read_text().strip()
    except FileNotFoundError:
        return None


def _client(url: str, token: str | None) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return http_client(url, headers=headers)


def _raw_get(door: str, path: str, extra: str = "") -> tuple[str, bytes, bool]:
    """Status line, body and whether the server closed the connection, for one request on a new one."""
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(door)
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n{extra}\r\n".encode())
        data, closed = b"", False
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    closed = True
                    break
                data += chunk
        except TimeoutError:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), body, closed


def _on_path(path: Path) -> list[str]:
    """Live processes whose command line names `path` (the server, its proxy), as `pid: command`."""
    return [f"{proc.pid}: {proc.command}" for proc in processes.processes() if processes.names_path(proc.command, path)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, str]]:
    """A fresh HOME's services (as every command starts them) with one collection of the owner's."""
    settings = settings_for(tmp_path_factory.mktemp("chroma-private") / "home")
    try:
        endpoints = services.ensure_services(settings, migrate=False)  # the schema plays no part here
        col = _client(endpoints.chroma_url, _token(settings)).get_or_create_collection(SECRET_COLLECTION)
        col.add(ids=["m1:1"], embeddings=[[0.1, 0.2, 0.3, 0.4]], metadatas=[{"user_id": "owner"}])
        yield settings, endpoints.chroma_url
    finally:
        services.stop_services(settings)


def test_the_token_is_the_owners_alone(served):
    settings, _ = served
    token_file = settings.chroma_path / "token"
    info = token_file.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.geteuid()
    assert len(token_file.read_text().strip()) >= 32
    state = services.chroma_state(settings)
    assert state is not None and "token" not in json.dumps(state).lower()
    # The door: a socket of the owner's, in a directory nobody else may enter.
    door = Path(state["socket"])
    assert door.parent == settings.chroma_path and stat.S_ISSOCK(door.lstat().st_mode)
    assert door.lstat().st_uid == os.geteuid() and stat.S_IMODE(door.lstat().st_mode) & 0o077 == 0
    assert stat.S_IMODE(settings.chroma_path.stat().st_mode) == 0o700
    assert state["url"] == f"unix://{door}"
    # Never on a command line, where every user can read it (ps).
    for pid in (state["pid"], state.get("proxy_pid", state["pid"])):
        assert token_file.read_text().strip().encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.skipif(not AS_ROOT, reason="switching to `nobody` needs root (CI runs as root)")
@pytest.mark.skipif(shutil.which("setpriv") is None or not Path("/usr/bin/python3").exists(), reason="no setpriv")
def test_another_local_user_is_refused_and_the_owner_gets_in(served):
    settings, url = served
    state = services.chroma_state(settings)
    assert state is not None
    seen = run_as_nobody(
        ATTACK,
        state["socket"],
        str(_server_port(state)),
        str(settings.chroma_path / "token"),
        str(state["pid"]),
    )
    # The door is a file in a directory only the owner may enter: no connection, with a token or without.
    for attempt in ("door", "door_with_a_guess"):
        assert "PermissionError" in seen[attempt].get("connect", ""), (attempt, seen[attempt])
    for attempt in ("replace", "bind"):
        assert "PermissionError" in seen[attempt], (attempt, seen[attempt])
    # The server's own port is in a network namespace nobody else is in: nothing listens there on this side.
    assert "ConnectionRefusedError" in seen["server_port"].get("connect", ""), seen["server_port"]
    assert "PermissionError" in seen["token_file"], seen["token_file"]
    refusal = seen["nsenter"]["stderr"].lower()
    assert seen["nsenter"]["code"] != 0 and ("permission denied" in refusal or "not permitted" in refusal), refusal

    # The owner, with the token: the list the others did not get, then a write and a query.
    status, body, _ = _raw_get(state["socket"], LIST, f"Authorization: Bearer {_token(settings)}\r\n")
    assert status.startswith("HTTP/1.1 200") and SECRET_COLLECTION.encode() in body
    col = _client(url, _token(settings)).get_collection(SECRET_COLLECTION)
    col.add(ids=["m2:1"], embeddings=[[0.9, 0.1, 0.0, 0.0]], metadatas=[{"user_id": "owner"}])
    found = col.query(query_embeddings=[[0.9, 0.1, 0.0, 0.0]], n_results=1)
    assert found["ids"] == [["m2:1"]]


# Run by `nobody` with the token it was somehow given, through a door left open by mistake.
OPEN_DOOR = textwrap.dedent(
    """
    import json, socket, sys
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(sys.argv[1])
    head = f"GET {LIST} HTTP/1.1\\r\\nHost: localhost\\r\\nAuthorization: Bearer {sys.argv[2]}\\r\\n\\r\\n"
    sock.sendall(head.encode())
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except OSError:
        pass
    print(json.dumps(data.decode(errors="replace")))
    """
).replace("{LIST}", LIST)


@pytest.mark.skipif(not AS_ROOT, reason="switching to `nobody` needs root (CI runs as root)")
def test_a_door_left_open_by_mistake_still_lets_no_one_else_in(served):
    """HOME/chroma opened to all (a careless chmod): another user who even holds the token is
    refused by the door, which asks the kernel who is calling (SO_PEERCRED); and the owner's own
    clients send nothing, token included, to a socket in a directory others could have written to."""
    settings, url = served
    state = services.chroma_state(settings)
    assert state is not None
    door, chroma = Path(state["socket"]), settings.chroma_path
    modes = {path: stat.S_IMODE(path.lstat().st_mode) for path in (chroma, door)}
    try:
        chroma.chmod(0o777)
        door.chmod(0o777)
        answer = run_as_nobody(OPEN_DOOR, str(door), str(_token(settings)))
        assert answer.startswith("HTTP/1.1 401") and SECRET_COLLECTION not in answer, answer
        with pytest.raises(PermissionError, match="only uid"):
            unix_http.connect_path(door)
        assert services.chroma_heartbeat(url) is False
        with pytest.raises(services.ServiceError, match="only uid"):
            VectorStore(embedder=HashingEmbedder(dimension=4), url=url).client()
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
    assert services.chroma_heartbeat(url) is True


def test_the_same_user_without_the_token_is_refused_too(served):
    settings, url = served
    state = services.chroma_state(settings)
    assert state is not None
    status, body, closed = _raw_get(state["socket"], LIST)
    assert status.startswith("HTTP/1.1 401") and closed and SECRET_COLLECTION.encode() not in body
    status, _, closed = _raw_get(state["socket"], "/api/v2/heartbeat", "x-chroma-token: not-the-token\r\n")
    assert status.startswith("HTTP/1.1 401") and closed
    with pytest.raises(Exception, match=r"(?i)token|auth"):
        _client(url, None).list_collections()
    # Either header the proxy documents lets the owner in.
    status, body, _ = _raw_get(state["socket"], LIST, f"x-chroma-token: {_token(settings)}\r\n")
    assert status.startswith("HTTP/1.1 200") and SECRET_COLLECTION.encode() in body


def test_a_process_given_only_the_url_uses_the_token(served, tmp_path):
    """MEMORY_PIPELINES_CHROMA_URL naming this user's embedded server (another HOME, as the tests'
    CLI runs do): the token is found; MEMORY_PIPELINES_CHROMA_TOKEN, when set, is what is sent."""
    _, url = served
    code = textwrap.dedent(
        f"""
        import json
        from memory_pipelines.lib.stores.embedding import HashingEmbedder
        from memory_pipelines.lib.infra.services import chroma_heartbeat
        from memory_pipelines.lib.stores.chroma.index import VectorStore
        store = VectorStore(embedder=HashingEmbedder(dimension=4), url={url!r})
        names = [c.name for c in store.client().list_collections()]
        print(json.dumps({{"names": names, "heartbeat": chroma_heartbeat({url!r})}}))
        """
    )
    env = {**os.environ, "MEMORY_PIPELINES_HOME": str(tmp_path / "other-home"), "MEMORY_PIPELINES_CHROMA_URL": url}
    env.pop("MEMORY_PIPELINES_CHROMA_TOKEN", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"names": [SECRET_COLLECTION], "heartbeat": True}
    env["MEMORY_PIPELINES_CHROMA_TOKEN"] = "a-token-of-another-server"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and "AuthError" in done.stderr, done.stderr[-2000:]


def test_stop_ends_the_proxy_and_the_server_and_either_ending_ends_the_other(tmp_path):
    settings = settings_for(tmp_path / "home")
    path = settings.chroma_path
    try:
        url = services.ensure_chroma(settings)
        first = services.chroma_state(settings)
        assert first is not None and first["isolation"] in ("netns", "userns+netns")
        proxy, server = int(first["proxy_pid"]), int(first["pid"])
        # One session of their own; the server leads its own group, which an earlier version's stop signals.
        assert os.getsid(server) == os.getsid(proxy) == proxy and os.getpgid(server) == server
        assert len(_on_path(path)) == 2, _on_path(path)
        # A killed proxy (no cleanup of its own) takes its server along: PR_SET_PDEATHSIG.
        os.kill(proxy, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while services.pid_alive(server) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not services.pid_alive(server)
        again = services.ensure_chroma(settings)
        second = services.chroma_state(settings)
        assert second is not None and again == url and second["pid"] != server  # the same door, a new pair
        assert services.chroma_heartbeat(again) and services.chroma_headers(again)
        # The server's group alone signalled (what a `stop` of an earlier version does): its proxy ends too.
        os.killpg(int(second["pid"]), signal.SIGTERM)
        deadline = time.monotonic() + 30
        while services.pid_alive(int(second["proxy_pid"])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not services.pid_alive(int(second["proxy_pid"])) and not services.pid_alive(int(second["pid"]))
        services.ensure_chroma(settings)
        second = services.chroma_state(settings)
        assert second is not None and services.pid_alive(second["proxy_pid"])
        stopped = services.stop_chroma(settings)
        assert stopped["stopped"] is True and stopped["pid"] == second["pid"]
        assert not services.pid_alive(second["pid"]) and not services.pid_alive(second["proxy_pid"])
        assert _on_path(path) == [] and services.chroma_state(settings) is None

        # A server an earlier version left (no proxy, open to all) is replaced, not reused.
        from tests.support.servers import free_port

        port = free_port()
        legacy = subprocess.Popen(
            services.chroma_run_command(path, port, command=[str(services.chroma_binary())]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        old_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not services.chroma_heartbeat(old_url, token="unused") and time.monotonic() < deadline:
            time.sleep(0.1)
        (path / "server.json").write_text(json.dumps({"pid": legacy.pid, "port": port, "url": old_url}))
        third_url = services.ensure_chroma(settings)
        assert legacy.wait(30) is not None and third_url != old_url
        assert "proxy_pid" in (services.chroma_state(settings) or {})

        # A pair behind an earlier version's door on a TCP port is replaced by one behind the socket.
        third = services.chroma_state(settings)
        assert third is not None
        (path / "server.json").write_text(json.dumps({**third, "url": "http://127.0.0.1:9", "port": 9}))
        assert services.ensure_chroma(settings) == third_url
        fourth = services.chroma_state(settings)
        assert fourth is not None and fourth["proxy_pid"] != third["proxy_pid"]
        assert not services.pid_alive(third["proxy_pid"]) and not services.pid_alive(third["pid"])
    finally:
        services.stop_chroma(settings)
    assert _on_path(path) == []


NO_NAMESPACES = textwrap.dedent(
    """
    import json, sys
    # This user namespace may make no more namespaces: a kernel with user namespaces off, for the proxy.
    for kind in ("net", "user"):
        with open(f"/proc/sys/user/max_{kind}_namespaces", "w") as fh:
            fh.write("0")
    from memory_pipelines.lib.infra import services
    from memory_pipelines.lib.infra.errors import ServiceError
    from memory_pipelines.lib.infra.settings import Settings

    out = {}
    refused = Settings.from_env({"MEMORY_PIPELINES_HOME": sys.argv[1], "MEMORY_PIPELINES_CHROMA_ISOLATION": "netns"})
    try:
        services.ensure_chroma(refused)
        out["refused"] = None
    except ServiceError as exc:
        out["refused"] = exc.message
    out["refused_state"] = services.chroma_state(refused)
    # The default (auto) starts without the namespace, still behind the token, and says so.
    opted_out = Settings.from_env({"MEMORY_PIPELINES_HOME": sys.argv[2]})
    try:
        url = services.ensure_chroma(opted_out)
        out["isolation"] = services.chroma_state(opted_out)["isolation"]
        out["with_token"] = services.chroma_heartbeat(url)
        out["without_token"] = services.chroma_heartbeat(url, token="not-the-token")
    finally:
        out["stopped"] = services.stop_chroma(opted_out)["stopped"]
    print(json.dumps(out))
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1)")
def test_without_namespaces_netns_refuses_and_auto_starts_behind_the_token(tmp_path):
    """A system where no namespace can be made (simulated: a user namespace whose limits are 0):
    MEMORY_PIPELINES_CHROMA_ISOLATION=netns gets a clear ServiceError naming the setting; the default
    (auto) starts the server without the namespace, still behind the token."""
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a user namespace here: {probe.stderr.decode().strip()}")
    refused_home, opted_home = tmp_path / "refused", tmp_path / "opted-out"
    try:
        done = subprocess.run(
            [
                "unshare",
                "--user",
                "--map-root-user",
                sys.executable,
                "-c",
                NO_NAMESPACES,
                str(refused_home),
                str(opted_home),
            ],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout.splitlines()[-1])
        assert out["refused"] is not None and "MEMORY_PIPELINES_CHROMA_ISOLATION=auto" in out["refused"], out
        assert "network namespace" in out["refused"] and out["refused_state"] is None, out
        assert out["isolation"] == "none" and out["with_token"] is True and out["without_token"] is False, out
        assert out["stopped"] is True
    finally:
        for home in (refused_home, opted_home):
            services.stop_chroma(settings_for(home))
    assert _on_path(refused_home) == [] and _on_path(opted_home) == []
