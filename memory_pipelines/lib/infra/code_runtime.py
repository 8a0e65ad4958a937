"""The runtime directory of the warm code servers (memory_pipelines/launch/code_server.py): per
server, a record (pid, HOME), its socket, its workspace file, a lock and the directory of its run
workers' fork server and command forker; per HOME, a link to its newest forker; in
/tmp/mp-code-<uid>. Here, not in code_server.py, so `stop` can remove what the servers it ended
leave, without importing Dagster."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from memory_pipelines.lib.infra.processes import read_proc

__all__ = [
    "forker_ready",
    "forker_socket",
    "link_of",
    "runtime_dir",
    "scratch_of",
    "sweep_records",
]


def runtime_dir() -> Path | None:
    """/tmp/mp-code-<uid>, 0700 and ours, or None when it is not (then no warm server)."""
    path = Path(tempfile.gettempdir()) / f"mp-code-{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat()
    if not path.is_dir() or path.is_symlink() or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        return None
    return path


def scratch_of(socket: Path) -> Path:
    """The directory of a server's multiprocessing files (its run workers' fork server's socket)."""
    return socket.with_suffix(".mp")


def link_of(home: Path, runtime: Path) -> Path:
    """The runtime directory's link to the command forker of HOME's newest warm code server."""
    return runtime / f"{hashlib.sha256(os.path.realpath(home).encode()).hexdigest()[:20]}.commands"


def forker_socket(server_socket: Path) -> Path:
    """Where the command forker (launch/warm_commands.py) of the server on `server_socket` listens."""
    return scratch_of(server_socket) / "commands.sock"


def forker_ready(home: Path, runtime: Path, server_socket: Path) -> bool:
    """Whether HOME's link names the command forker of the server on `server_socket`: the forker
    links itself once it listens."""
    own = forker_socket(server_socket)
    try:
        return os.readlink(link_of(home, runtime)) == str(own) and own.exists()
    except OSError:
        return False


def sweep_records(runtime: Path, keep: Path | None = None) -> None:
    """Remove the files of servers that have ended (idle, stopped, or of a HOME deleted since), each
    under its own lock, skipping any another command holds; lock files stay (one may be waited on).
    Also the links to command forkers (launch/warm_commands.py) whose socket has gone with its server."""
    for link in runtime.glob("*.commands"):
        if link.is_symlink() and not link.exists():
            link.unlink(missing_ok=True)
    for record in runtime.glob("*.json"):
        if record == keep:
            continue
        fd = os.open(record.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            pid = int(json.loads(record.read_text())["pid"])
        except (BlockingIOError, ValueError, OSError, KeyError):
            os.close(fd)
            continue  # busy or unreadable: not ours to remove
        try:
            if read_proc(pid) is None:  # gone, or a zombie nobody has collected yet
                shutil.rmtree(scratch_of(record.with_suffix(".sock")), ignore_errors=True)
                for suffix in (".sock", ".yaml", ".json"):
                    record.with_suffix(suffix).unlink(missing_ok=True)
        finally:
            os.close(fd)
