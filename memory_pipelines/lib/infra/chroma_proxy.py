"""The only way in to the embedded Chroma server: a door only HOME's owner can open, in front of a
server nobody can reach.

Chroma 1.x's server has no authentication of its own, and a port on 127.0.0.1 is open to every local
user (and free for any of them to take once its owner lets go of it). So `services._start_chroma` runs
this file as a program (standard library only, `python -I`), in a session of its own, and it:

1. listens on the Unix socket SOCKET_FILE inside Chroma's data directory (HOME/chroma, 0700): no other
   user can connect to it, replace it or put anything in its place; the socket is bound under a
   temporary name and renamed into place, so its path is always either the old door or the new;
2. moves itself into a new network namespace (`unshare(CLONE_NEWNET)` as root; otherwise inside a user
   namespace of its own, CLONE_NEWUSER too, mapping only its own uid and gid) and brings its loopback up;
3. starts `chroma run` there, on 127.0.0.1 of that namespace, which holds no other process;
4. forwards, byte for byte and keep-alive included, every connection from its own uid (SO_PEERCRED)
   whose first request carries the HOME's token (`Authorization: Bearer <token>` or
   `x-chroma-token: <token>`; the token is the file TOKEN_FILE, 0600, beside Chroma's data) to that
   server; any other gets 401 and is closed.

The token is a second lock on a door that only the owner can reach: it never travels over a socket
another uid could own.

Once Chroma answers, one JSON line on `--ready-fd` says `{"socket", "server_pid", "isolation"}`, or
`{"error", "detail"}` when it cannot start (exit code EXIT_ISOLATION: no namespace could be made).
A SIGTERM ends Chroma, then this process; Chroma's exit ends this process; this process's death
sends Chroma a SIGTERM (PR_SET_PDEATHSIG). Both are in one session; Chroma leads a process group
of its own, so a process that signals only its group (an earlier version's `stop`) ends the pair too.
On the way out the door's socket file is removed, if it is still this door's.

`--isolation=none` skips steps 2 and 3's namespace: Chroma then listens on a port of the machine's
loopback that any local user can reach without the token (MEMORY_PIPELINES_CHROMA_ISOLATION=none).
`auto` (the default) is `netns` where a namespace can be made and `none` where it cannot (a
container without CAP_SYS_ADMIN, user namespaces off), reported as `unisolated` with the reason;
`netns` refuses to start there instead.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import errno
import fcntl
import hmac
import itertools
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

__all__ = [
    "EXIT_ISOLATION",
    "EXIT_SERVER",
    "ISOLATIONS",
    "REFUSAL",
    "SOCKET_FILE",
    "TOKEN_FILE",
    "TOKEN_HEADER",
    "Door",
    "IsolationError",
    "answers",
    "authorized",
    "bind_door",
    "isolate",
    "main",
    "open_door",
    "presented_tokens",
    "start_server",
]

TOKEN_FILE = "token"
SOCKET_FILE = "door.sock"
TOKEN_HEADER = "x-chroma-token"
ISOLATIONS = ("auto", "netns", "none")
EXIT_ISOLATION = 3  # no network namespace could be made
EXIT_SERVER = 4  # Chroma exited or never answered
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_PR_SET_PDEATHSIG = 1
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH14x"  # struct ifreq: the interface name, then ifr_flags
_HEAD_LIMIT = 64 * 1024  # a request head longer than this is refused
_HEAD_SECONDS = 10.0  # a client gets this long, in all, to send its first request head
# Connections that have not yet shown the token, at most: past it the oldest that has not sent a whole
# request head is dropped. A client of ours sends its head within a millisecond of connecting.
_MAX_PENDING = 256
# accept() failing for want of descriptors or memory: the door sheds, it does not close.
_SHED_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
# Connections the kernel holds before accept. Past it a Unix socket's connect fails at once (EAGAIN)
# and our clients try again (unix_http: for BUSY_SECONDS); a longer queue only makes a client wait
# behind a flood's connections (measured: 4096 held a recall 32 s behind 2,000 of them).
_BACKLOG = 128
_CHUNK = 256 * 1024
_STOP_SECONDS = 15.0  # Chroma's time to end on SIGTERM before SIGKILL (services waits 20 s for the group)
_REFUSED_BODY = json.dumps(
    {"error": "AuthError", "message": "this Chroma server needs its HOME's token (Authorization: Bearer <token>)"}
).encode()
REFUSAL = (
    b"HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Bearer\r\nContent-Type: application/json\r\n"
    + f"Content-Length: {len(_REFUSED_BODY)}\r\nConnection: close\r\n\r\n".encode()
    + _REFUSED_BODY
)


class IsolationError(Exception):
    """No network namespace of its own could be made for the server."""


class _Stop(Exception):
    """Raised in the main thread by SIGTERM, SIGINT or SIGHUP."""


def _log(message: str) -> None:
    sys.stderr.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} chroma_proxy[{os.getpid()}]: {message}\n")
    sys.stderr.flush()


def presented_tokens(head: bytes) -> list[bytes]:
    """The tokens a request head offers: `Authorization: Bearer X` and `x-chroma-token: X` values."""
    found = []
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        name, value = name.strip().lower(), value.strip()
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            found.append(value[7:].strip())
        elif name == TOKEN_HEADER.encode():
            found.append(value)
    return found


def authorized(head: bytes, token: bytes) -> bool:
    """`head` (a request line and headers) carries `token`; compared in constant time."""
    return any(hmac.compare_digest(offered, token) for offered in presented_tokens(head))


# ---------------------------------------------------------------------------------------------
# Isolation


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def isolate() -> str:
    """Move this process (single-threaded, before any socket but the public one) into a network
    namespace of its own with its loopback up; returns how ("netns" or "userns+netns").

    Tried first in a forked child: a user namespace can be made and then refuse its id maps (one
    nested in another), and a process cannot leave a namespace it entered, so a failure here must
    leave this process where it was (`auto` then serves from the machine's loopback)."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe and its exit code
        os.close(read_end)
        code, message = 0, b""
        try:
            _isolate()
        except BaseException as exc:
            code, message = 1, str(exc).encode()
        os.write(write_end, message[:4000])
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        reason = pipe.read().decode(errors="replace")
    _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise IsolationError(reason or "a network namespace could not be made here")
    return _isolate()


def _isolate() -> str:
    try:
        unshare = ctypes.CDLL(None, use_errno=True).unshare
    except (OSError, AttributeError) as exc:
        raise IsolationError(f"this system has no unshare(2): {exc}") from exc
    before = os.readlink("/proc/self/ns/net")
    how = "netns"
    if unshare(_CLONE_NEWNET) != 0:
        first = os.strerror(ctypes.get_errno())
        if unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
            raise IsolationError(
                f"unshare(CLONE_NEWNET): {first}; unshare(CLONE_NEWUSER|CLONE_NEWNET): "
                f"{os.strerror(ctypes.get_errno())}"
            )
        how = "userns+netns"
        uid, gid = os.geteuid(), os.getegid()
        try:
            # Our own ids inside, nothing else: Chroma's files stay ours, and it gains no other user's rights.
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        except OSError as exc:
            raise IsolationError(f"a user namespace was made but its id maps were refused: {exc}") from exc
    if os.readlink("/proc/self/ns/net") == before:
        raise IsolationError("unshare returned but the network namespace is unchanged")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            flags = struct.unpack(_IFREQ, fcntl.ioctl(sock, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
            fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))
    except OSError as exc:
        raise IsolationError(f"cannot bring up the loopback of the new network namespace: {exc}") from exc
    return how


# ---------------------------------------------------------------------------------------------
# The Chroma server


def _inner_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(command: list[str], path: str, port: int) -> subprocess.Popen[bytes]:
    """`chroma run` (`command` runs Chroma's CLI) on 127.0.0.1:`port` of this process's namespace; it
    gets SIGTERM when we die."""
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def bound_to_parent() -> None:  # runs in the child between fork and exec
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # we died before the prctl took effect
            os._exit(1)

    return subprocess.Popen(
        [*command, "run", "--path", path, "--host", "127.0.0.1", "--port", str(port)],
        stdin=subprocess.DEVNULL,
        close_fds=True,
        process_group=0,
        preexec_fn=bound_to_parent,
    )


def answers(port: int, timeout: float = 1.0) -> bool:
    """Chroma's heartbeat answers 200 on 127.0.0.1:`port` (of this namespace)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"GET /api/v2/heartbeat HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            status = sock.recv(64)
    except OSError:
        return False
    return status.startswith(b"HTTP/1.") and status[8:13] == b" 200 "


def _await_server(server: subprocess.Popen[bytes], port: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if answers(port):
            return True
        if server.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def _end(server: subprocess.Popen[bytes]) -> None:
    if server.poll() is not None:
        return
    server.terminate()
    try:
        server.wait(_STOP_SECONDS)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


# ---------------------------------------------------------------------------------------------
# The door


class Door:
    """Accepts on `listener`; a connection from this process's uid whose first request head carries
    `token` is spliced to 127.0.0.1:`upstream_port` of this process's namespace, any other is refused."""

    def __init__(self, listener: socket.socket, *, upstream_port: int, token: bytes) -> None:
        self.listener = listener
        self.upstream_port = upstream_port
        self.token = token
        self._refused = 0
        self._reported = 0.0
        self._lock = threading.Lock()
        self._pending: collections.OrderedDict[socket.socket, None] = collections.OrderedDict()

    def serve(self) -> None:
        """Accept until the listener is shut; one thread per connection. Out of descriptors, threads or
        memory, it drops the oldest connections still without the token and goes on accepting."""
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError as exc:
                if exc.errno in _SHED_ERRNOS:
                    self._shed(16)
                    continue
                if exc.errno in (errno.EINTR, errno.ECONNABORTED, errno.EPROTO):
                    continue
                return  # the listener was shut: the program is ending
            self._admit(client)
            try:
                threading.Thread(target=self._handle, args=(client,), daemon=True).start()
            except RuntimeError:  # no thread to be had: this one goes, the next may find one
                self._settle(client)
                client.close()
                self._shed(16)

    def _admit(self, client: socket.socket) -> None:
        with self._lock:
            self._pending[client] = None
            over = len(self._pending) - _MAX_PENDING
        if over > 0:
            self._shed(over)

    def _shed(self, count: int) -> None:
        """End the `count` oldest connections still without the token that have not sent a whole
        request head (their threads then close them). One that has is a client's, waiting only for
        its thread to read it (a busy machine): a flood's sends a byte now and then, never a head."""
        with self._lock:
            waiting = list(self._pending)
        idle = list(itertools.islice((sock for sock in waiting if not _head_arrived(sock)), count))
        with self._lock:  # only those still waiting: a thread may have read its head meanwhile
            idle = [sock for sock in idle if self._pending.pop(sock, False) is None]
        for sock in idle:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if not idle:
            time.sleep(0.05)  # every descriptor is a client's: wait for one to end

    def _settle(self, client: socket.socket) -> None:
        with self._lock:
            self._pending.pop(client, None)

    def _handle(self, client: socket.socket) -> None:
        with client:
            try:
                owner = _from_owner(client)
                head = self._read_head(client) if owner else None
            finally:
                self._settle(client)
            if not owner:
                self._refuse(client)
                return
            if head is None:
                return
            if not authorized(head[: head.find(b"\r\n\r\n")], self.token):
                self._refuse(client)
                return
            upstream = self._connect_upstream()
            if upstream is None:
                return  # the server is gone or going: the client sees the connection close
            with upstream:
                client.settimeout(None)
                upstream.settimeout(None)
                upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # requests are small: no Nagle wait
                back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
                back.start()
                _pump(client, upstream, head)
                back.join()

    def _connect_upstream(self) -> socket.socket | None:
        """A connection to the server for an authorized request, or None when the server is gone.

        Out of descriptors (a flood holds them all), waiting connections without a head are shed
        until one is free: the owner's request, already read, goes before the flood's."""
        deadline = time.monotonic() + _HEAD_SECONDS
        while True:
            try:
                return socket.create_connection(("127.0.0.1", self.upstream_port), timeout=_HEAD_SECONDS)
            except OSError as exc:
                if exc.errno not in _SHED_ERRNOS or time.monotonic() > deadline:
                    return None
                self._shed(16)

    def _read_head(self, client: socket.socket) -> bytes | None:
        """The bytes received up to and including the first request's blank line (maybe some body
        after it), or None when the client sent no complete head in time (refused if it sent too much)."""
        deadline = time.monotonic() + _HEAD_SECONDS
        head = b""
        try:
            while b"\r\n\r\n" not in head:
                if len(head) > _HEAD_LIMIT:
                    self._refuse(client)
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None  # a byte now and then buys no more time
                client.settimeout(left)
                chunk = client.recv(65536)
                if not chunk:
                    return None
                head += chunk
        except OSError:
            return None
        return head

    def _refuse(self, client: socket.socket) -> None:
        try:
            client.sendall(REFUSAL)
            client.shutdown(socket.SHUT_WR)
            client.settimeout(1.0)
            # Read what the client still sends before closing: a close with unread data resets the
            # connection, and the client could lose the 401 before it reads it.
            for _ in range(16):
                if not client.recv(65536):
                    break
        except OSError:
            pass
        with self._lock:
            self._refused += 1
            now = time.monotonic()
            if now - self._reported >= 10.0:
                _log(f"refused {self._refused} connection(s) without the token so far")
                self._reported = now


def _head_arrived(sock: socket.socket) -> bool:
    """`sock` holds a whole request head, unread (MSG_PEEK: its thread still reads it as it came)."""
    try:
        return b"\r\n\r\n" in sock.recv(_HEAD_LIMIT, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return False


def _from_owner(client: socket.socket) -> bool:
    """A Unix socket's peer runs as this process's uid (the kernel says so: SO_PEERCRED); a TCP
    client (tests of the door alone) has the token to show instead."""
    if client.family != socket.AF_UNIX:
        return True
    try:
        _, uid, _ = struct.unpack("3i", client.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return False
    return bool(uid == os.geteuid())


def _pump(src: socket.socket, dst: socket.socket, first: bytes = b"") -> None:
    """Copy `src` to `dst` until `src` ends (then half-close `dst`) or either fails (then end both)."""
    try:
        if first:
            dst.sendall(first)
        while True:
            data = src.recv(_CHUNK)
            if not data:
                dst.shutdown(socket.SHUT_WR)
                return
            dst.sendall(data)
    except OSError:
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# The program


def bind_door(directory: str) -> tuple[socket.socket, str]:
    """Listen on a socket file of its own name (owner-only) in `directory`, which becomes this
    process's working directory (relative names fit sun_path however deep HOME is); returns the
    socket and that name, for open_door once the server answers."""
    os.chdir(directory)
    for name in os.listdir("."):
        if name.startswith(f"{SOCKET_FILE}."):  # a killed door's (one door starts at a time, under HOME's lock)
            _unlink(name)
    temporary = f"{SOCKET_FILE}.{os.getpid()}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(temporary)
        os.chmod(temporary, 0o600)
        listener.listen(_BACKLOG)
    except BaseException:
        listener.close()
        _unlink(temporary)
        raise
    return listener, temporary


def open_door(temporary: str) -> int:
    """Rename the bound socket over SOCKET_FILE: a client finds the old door or the new one at the
    path, never nothing and never a file another user made. Returns the file's inode."""
    inode = os.stat(temporary).st_ino
    os.rename(temporary, SOCKET_FILE)
    return inode


def _unlink(name: str) -> None:
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass


def _close_door(listener: socket.socket, temporary: str, inode: int | None) -> None:
    """Stop listening and remove the door's file if it is still this door's (a newer one may stand there)."""
    _unlink(temporary)
    try:
        if inode is not None and os.stat(SOCKET_FILE).st_ino == inode:
            os.unlink(SOCKET_FILE)
    except OSError:
        pass
    try:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
    except OSError:
        pass
    listener.close()


def _report(fd: int | None, message: dict[str, object]) -> None:
    if fd is None:
        return
    try:
        os.write(fd, (json.dumps(message) + "\n").encode())
        os.close(fd)
    except OSError:
        pass  # the process that started us is gone: the state file is what others read


def _command(text: str) -> list[str]:
    command = json.loads(text)
    if not (isinstance(command, list) and command and all(isinstance(part, str) for part in command)):
        raise ValueError("--command must be a JSON list of strings")
    return command


def _stop(signum: int, frame: FrameType | None) -> None:
    raise _Stop


def main(argv: list[str] | None = None) -> int:
    """Run the door and the server until either ends (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dir", required=True, help="Chroma's data directory (HOME/chroma), holding TOKEN_FILE")
    parser.add_argument("--command", required=True, type=_command, help="what runs Chroma's CLI, a JSON list")
    parser.add_argument("--isolation", choices=ISOLATIONS, default="auto")
    parser.add_argument("--ready-fd", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    ready: int | None = args.ready_fd
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _stop)
    try:
        token = (Path(args.dir) / TOKEN_FILE).read_bytes().strip()
        if len(token) < 16:
            raise OSError(f"{Path(args.dir) / TOKEN_FILE} holds no usable token")
        unisolated = ""
        try:
            isolation = isolate() if args.isolation != "none" else "none"
        except IsolationError as exc:
            if args.isolation == "netns":
                raise
            isolation, unisolated = "none", str(exc)  # auto: the door still guards the server's files
        listener, temporary = bind_door(args.dir)  # a path socket: the same file in every network namespace
    except IsolationError as exc:
        _report(ready, {"error": "isolation", "detail": str(exc)})
        return EXIT_ISOLATION
    except OSError as exc:
        _report(ready, {"error": "start", "detail": str(exc)})
        return EXIT_SERVER
    except _Stop:
        return 0
    server, inode = None, None
    try:
        inner = _inner_port()
        server = start_server(args.command, args.dir, inner)
        if not _await_server(server, inner, deadline):
            code = server.poll()
            detail = f"exited with code {code}" if code is not None else f"did not answer within {args.timeout:.0f}s"
            _report(ready, {"error": "server", "detail": detail})
            return EXIT_SERVER
        door = Door(listener, upstream_port=inner, token=token)
        threading.Thread(target=door.serve, daemon=True).start()
        inode = open_door(temporary)
        door_path = str(Path(args.dir) / SOCKET_FILE)
        _report(
            ready, {"socket": door_path, "server_pid": server.pid, "isolation": isolation, "unisolated": unisolated}
        )
        _log(f"chroma server pid {server.pid} behind {door_path} (isolation: {isolation})")
        code = server.wait()
        _log(f"chroma server exited with code {code}")
        return EXIT_SERVER
    except _Stop:
        return 0
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)  # a second signal must not cut the cleanup short
        _close_door(listener, temporary, inode)
        if server is not None:
            _end(server)


if __name__ == "__main__":
    sys.exit(main())
