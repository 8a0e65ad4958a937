"""HTTP over a Unix socket only its owner could have put there (lib/infra/unix_http.py), on real
sockets in temporary directories."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from memory_pipelines.lib.infra import services, unix_http


@pytest.fixture
def door(tmp_path: Path) -> Iterator[Path]:
    """A private directory holding a socket that answers every request with 204, and a token file."""
    directory = tmp_path / ("d" * 90) / "chroma"  # deep: past sun_path's 107 bytes
    directory.mkdir(parents=True, mode=0o700)
    (directory / services.CHROMA_TOKEN).write_text("a-token-of-this-door\n")
    path = directory / "door.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    parent = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:  # through the directory's descriptor: the path itself is too long for sun_path
        server.bind(f"/proc/self/fd/{parent}/{path.name}")
    finally:
        os.close(parent)
    server.listen(8)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.0 204 No Content\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        server.close()
        thread.join(5)


def test_a_url_names_its_socket_and_nothing_else_is_one(tmp_path):
    path = tmp_path / "a b" / "door.sock"
    assert unix_http.socket_path(unix_http.unix_url(path)) == path
    assert unix_http.socket_path("http://127.0.0.1:8000") is None
    assert unix_http.httpx_transport("https://chroma.example") is None


def test_a_deep_door_answers_and_a_dead_or_open_one_gets_nothing(door):
    url = unix_http.unix_url(door)
    assert len(os.fsencode(str(door))) > 107
    assert unix_http.status(url, "/api/v2/heartbeat", headers={}, timeout=5) == 204
    door.parent.chmod(0o755)  # others may enter: nothing is sent
    try:
        with pytest.raises(unix_http.UnsafeSocket, match="only uid"):
            unix_http.connect_path(door)
        assert unix_http.status(url, "/api/v2/heartbeat", headers={}, timeout=5) is None
    finally:
        door.parent.chmod(0o700)
    assert unix_http.status(unix_http.unix_url(door.parent / "none.sock"), "/", headers={}, timeout=5) is None


def test_the_token_beside_a_door_is_found_while_its_server_is_down(door, monkeypatch):
    """A process given only the door's URL finds the token even while the pair restarts (no socket),
    or it would keep a client without the token, refused for the rest of its life."""
    monkeypatch.delenv("MEMORY_PIPELINES_CHROMA_TOKEN", raising=False)
    gone = door.parent / "restarting.sock"
    assert services.chroma_headers(unix_http.unix_url(gone)) == {"Authorization": "Bearer a-token-of-this-door"}
    door.parent.chmod(0o711)
    try:
        assert services.chroma_headers(unix_http.unix_url(door.parent / "other.sock")) == {}
    finally:
        door.parent.chmod(0o700)


def test_a_busy_door_is_waited_for_and_a_gone_one_is_not(tmp_path):
    """A full backlog (EAGAIN) is a busy door: the request waits for it, longer than CONNECT_RETRIES'
    1.5 s, and is sent once. A socket nobody listens on is refused at once: no waiting."""
    import time

    import httpx

    directory = tmp_path / "chroma"
    directory.mkdir(mode=0o700)
    path = directory / "door.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(0)
    fillers = []
    while True:  # fill the backlog until a connect fails with EAGAIN
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        filler.setblocking(False)
        try:
            filler.connect(str(path))
        except BlockingIOError:
            filler.close()
            break
        fillers.append(filler)
    requests: list[bytes] = []

    def serve_later() -> None:
        time.sleep(2.5)
        for filler in fillers:
            filler.close()
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                head = conn.recv(65536)
                if head:
                    requests.append(head)
                    conn.sendall(b"HTTP/1.0 204 No Content\r\n\r\n")

    thread = threading.Thread(target=serve_later, daemon=True)
    thread.start()
    started = time.monotonic()
    with httpx.Client(transport=unix_http.httpx_transport(unix_http.unix_url(path)), base_url=unix_http.BASE_URL) as c:
        assert c.get("/api/v2/heartbeat").status_code == 204
    assert time.monotonic() - started > 2.0 and len(requests) == 1
    server.shutdown(socket.SHUT_RDWR)  # wakes the accept
    server.close()
    thread.join(5)
    # Gone: a socket file nothing listens on is refused, and told within CONNECT_RETRIES' backoff.
    gone = directory / "gone.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(gone))
    started = time.monotonic()
    with httpx.Client(transport=unix_http.httpx_transport(unix_http.unix_url(gone)), base_url=unix_http.BASE_URL) as c:
        with pytest.raises(httpx.ConnectError):
            c.get("/api/v2/heartbeat")
    assert time.monotonic() - started < 5.0
    dead.close()
