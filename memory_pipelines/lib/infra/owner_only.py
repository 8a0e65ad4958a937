"""Everything under HOME is its owner's alone, whatever the umask of the process that writes it.

Our own commands (the CLI, and every process it starts: Dagster's daemon, code servers and run
workers, the Chroma server) run with umask 077. Code that may run inside a host application
(`MemoryPlatform`, the Dagster resources) leaves the host's umask alone: it makes HOME's directories
0700 and its files 0600 itself. HOME and HOME/pg stay traversable (0711) when PostgreSQL runs as a
service user of its own (as root), which must reach its data directory through them; neither can be
listed by anyone else.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "OWNER_ONLY_UMASK",
    "TRAVERSABLE_MODE",
    "narrow",
    "private_dir",
    "private_file",
    "replace_private_file",
    "restrict_umask",
    "traversable_dir",
]

OWNER_ONLY_UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600
TRAVERSABLE_MODE = 0o711


def restrict_umask() -> int:
    """Make this process (and its children) create owner-only files; returns the previous umask."""
    return os.umask(OWNER_ONLY_UMASK)


def private_dir(path: Path, *, mode: int = DIR_MODE) -> Path:
    """`path` as a directory, each level this call creates owner-only (mkdir's `parents` would give
    the levels above the last the umask's mode); an existing directory of ours is narrowed to `mode`."""
    missing = []
    level = path
    while not level.exists():
        missing.append(level)
        level = level.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass
    narrow(path, mode)
    return path


def private_file(path: Path) -> Path:
    """Narrow a file we wrote to owner-only (0600); returns it."""
    narrow(path, FILE_MODE)
    return path


def replace_private_file(path: Path, text: str) -> Path:
    """Write `text` to `path` (0600) by renaming a whole file over it: a process reading it meanwhile
    sees the old content or the new, never a truncated file."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return path


def _ours(info: os.stat_result) -> bool:
    # A shared directory (sticky, like /tmp given as HOME) is never ours to narrow, even as root.
    return info.st_uid == os.geteuid() and not info.st_mode & stat.S_ISVTX


def narrow(path: Path, mode: int) -> None:
    """Take from `path` (when it is ours) every permission bit `mode` does not grant."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return
    current = info.st_mode & 0o777
    if _ours(info) and current & ~mode:
        os.chmod(path, current & mode)


def traversable_dir(path: Path, *, others_traverse: bool) -> Path:
    """A directory on the way to a service user's data: 0711 when another user (PostgreSQL's service
    user) must pass through it, else 0700. Never listable by anyone else."""
    private_dir(path, mode=TRAVERSABLE_MODE if others_traverse else DIR_MODE)
    if others_traverse and _ours(path.stat()):
        os.chmod(path, TRAVERSABLE_MODE)
    return path
