"""HTTP to a server on a Unix domain socket that only this user could have put where it is.

HOME's own Chroma server is reached this way (its door, `lib/infra/chroma_proxy.py`, listens on
HOME/chroma/door.sock). A TCP port on 127.0.0.1 can be taken by any local user the moment its owner
lets go of it, and a client still holding its number then sends its token to whoever took it. A
socket file in a directory that is ours and closed to everyone else cannot be taken: no other user
can create, replace or connect to anything in it. A client checks that before it sends a byte.

A `unix://` URL names the socket by its absolute path: `unix:///home/u/.memory_pipelines/chroma/door.sock`.
The socket's path never changes, so a client outlives any number of restarts of the server behind it.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

__all__ = [
    "BASE_URL",
    "BUSY_SECONDS",
    "CONNECT_RETRIES",
    "SCHEME",
    "UnsafeSocket",
    "check_directory",
    "connect_path",
    "httpx_transport",
    "socket_path",
    "status",
    "unix_url",
]

SCHEME = "unix"
# What an HTTP client puts in its request line and Host header; the socket decides where it goes.
BASE_URL = "http://localhost"
_SUN_PATH = 107  # sockaddr_un's path, less its terminating NUL
CONNECT_RETRIES = 3  # after 0, 0.5 and 1 s (httpcore's backoff): a dead door is told within 1.5 s
# A door whose backlog stays full (EAGAIN: busy, not dead) is tried again for this long: a flood of
# connections on a loaded machine kept it full longer than CONNECT_RETRIES waits.
BUSY_SECONDS = 60.0
_dir_fds: dict[str, int] = {}
_dir_fds_lock = threading.Lock()


class UnsafeSocket(PermissionError):
    """The socket, or its directory, could have been put there or opened by another user."""


def unix_url(path: Path) -> str:
    """The `unix://` URL of the socket at `path` (absolute)."""
    return f"{SCHEME}://{quote(str(path.absolute()))}"


def socket_path(url: str) -> Path | None:
    """The socket a `unix://` URL names, or None for any other URL."""
    parts = urlsplit(url)
    if parts.scheme != SCHEME or not parts.path:
        return None
    return Path(unquote(parts.path))


def check_directory(path: Path) -> None:
    """UnsafeSocket unless `path` is a directory of this user's that nobody else may enter."""
    me = os.geteuid()
    info = os.stat(path)
    if info.st_uid != me or stat.S_IMODE(info.st_mode) & 0o077:
        raise UnsafeSocket(
            f"{path} is not a directory only uid {me} can open "
            f"(owner {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}): nothing of ours goes there"
        )


def _check(path: Path) -> None:
    check_directory(path.parent)
    me, sock = os.geteuid(), os.lstat(path)
    if not stat.S_ISSOCK(sock.st_mode) or sock.st_uid != me:
        raise UnsafeSocket(f"{path} is not a socket of uid {me} (owner {sock.st_uid}): no request goes to it")


def connect_path(path: Path) -> str:
    """A path connect(2) takes for the socket at `path`, once it is shown to be this user's alone
    (UnsafeSocket otherwise; FileNotFoundError when nothing is there).

    A path past sun_path's 107 bytes (a deep test directory) goes through /proc/self/fd/N of its
    directory, held open by this process for the purpose."""
    _check(path)
    if len(os.fsencode(str(path))) <= _SUN_PATH:
        return str(path)
    parent = str(path.parent)
    with _dir_fds_lock:
        fd = _dir_fds.get(parent)
        if fd is not None:
            held, now = os.fstat(fd), os.stat(parent)
            if (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino):  # the directory was made anew
                os.close(fd)
                fd = None
        if fd is None:
            fd = os.open(parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            _dir_fds[parent] = fd
    return f"/proc/self/fd/{fd}/{path.name}"


def status(url: str, request_path: str, *, headers: dict[str, str], timeout: float) -> int | None:
    """The HTTP status of a GET of `request_path` from the server at a `unix://` URL, or None when
    nothing answers there. The request goes out only after connect_path's check."""
    path = socket_path(url)
    if path is None:
        raise ValueError(f"not a {SCHEME}:// URL: {url}")
    lines = [f"GET {request_path} HTTP/1.0", "Host: localhost", *(f"{k}: {v}" for k, v in headers.items())]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(connect_path(path))
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            head = b""
            while b"\r\n" not in head and len(head) < 4096:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                head += chunk
    except OSError:
        return None
    words = head.split(b"\r\n", 1)[0].split()
    return int(words[1]) if len(words) >= 2 and words[0].startswith(b"HTTP/1.") and words[1].isdigit() else None


def httpx_transport(url: str) -> Any | None:
    """An httpx transport to the socket a `unix://` URL names (checked as connect_path does), or
    None for any other URL."""
    path = socket_path(url)
    if path is None:
        return None
    import httpx

    # A full backlog fails a Unix socket's connect at once (EAGAIN) where TCP would wait: try again.
    inner = httpx.HTTPTransport(uds=connect_path(path), retries=CONNECT_RETRIES)

    class BusyDoorTransport(httpx.BaseTransport):
        """`inner`, whose connects that find the backlog full are tried again for BUSY_SECONDS. A
        connect that failed sent nothing, so trying again cannot apply a request twice."""

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            deadline, pause = time.monotonic() + BUSY_SECONDS, 0.1
            while True:
                try:
                    return inner.handle_request(request)
                except httpx.ConnectError as exc:
                    if not _busy(exc) or time.monotonic() + pause > deadline:
                        raise
                time.sleep(pause)
                pause = min(pause * 2, 1.0)

        def close(self) -> None:
            inner.close()

    return BusyDoorTransport()


def _busy(exc: BaseException) -> bool:
    """`exc` was caused by a full backlog (EAGAIN), not by a door that is gone."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno == errno.EAGAIN:
            return True
        seen = seen.__cause__ or seen.__context__
    return "Resource temporarily unavailable" in str(exc)
