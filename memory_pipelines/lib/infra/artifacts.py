"""Temporary files and directories a step makes beside what it keeps (backup and restore scratch, a
file written whole under another name then renamed into place): each is announced before it exists
and can be told from work in progress by anyone, whatever killed its maker.

The announcement is a lock file beside it, `.<name>.artifact`, that its maker creates and holds
locked (flock, exclusive) for as long as the artifact lives, and writes the artifact's owner into (a
tenant id, or "" for none). The kernel releases the lock when the maker dies, by SIGKILL, the OOM
killer or a crash as well as by an exception, so an artifact whose lock can be taken is a leftover:
`sweep` removes it, then its lock file. `live` names the artifacts whose makers still run.

Order, so no sweep ever removes live work: the maker creates the lock file (O_EXCL) and locks it,
checks the path still names that file (a sweep may have unlinked it in between: then it starts
again), and only then makes the artifact. It removes the artifact before the lock file, so an
artifact never outlives its announcement. A sweeper locks the file, checks the path still names it,
removes the artifact and unlinks the lock file before releasing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

from memory_pipelines.lib.infra.owner_only import FILE_MODE, private_dir

__all__ = [
    "SUFFIX",
    "artifact",
    "live",
    "remove_unannounced",
    "sweep",
]

SUFFIX = ".artifact"


def _lock_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{SUFFIX}")


def _artifact_of(lock: Path) -> Path:
    return lock.with_name(lock.name[1 : -len(SUFFIX)])


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def artifact(parent: Path, prefix: str, *, owner: str = "", directory: bool = False) -> Iterator[Path]:
    """A new path `parent/<prefix><random>` (made a 0700 directory with `directory`, else left for the
    caller to write), announced as above; removed with its announcement when the block ends."""
    private_dir(parent)
    while True:
        path = parent / f"{prefix}{secrets.token_hex(8)}"
        lock = _lock_path(path)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _same_file(fd, lock):
            break
        os.close(fd)  # a sweep took it for a leftover between the two steps: start again
    try:
        os.pwrite(fd, owner.encode("utf-8"), 0)
        if directory:
            path.mkdir(mode=0o700)
        yield path
    finally:
        _remove(path)
        lock.unlink(missing_ok=True)
        os.close(fd)


def _locks(parent: Path, *, tree: bool = False, skip: tuple[Path, ...] = ()) -> list[Path]:
    """The announcements in `parent` (with `tree`, in every directory under it but those of `skip`)."""
    found = []
    for directory, subdirectories, names in os.walk(parent) if tree else [(str(parent), [], _names(parent))]:
        subdirectories[:] = [d for d in subdirectories if Path(directory, d) not in skip]
        found += [Path(directory, n) for n in names if n.startswith(".") and n.endswith(SUFFIX)]
    return sorted(found)


def _names(parent: Path) -> list[str]:
    try:
        return os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return []


def sweep(parent: Path, *, tree: bool = False, skip: tuple[Path, ...] = ()) -> list[Path]:
    """Remove every artifact in `parent` (with `tree`, anywhere under it but in `skip`) whose maker is
    gone, with its announcement; returns them."""
    removed = []
    for lock in _locks(parent, tree=tree, skip=skip):
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            continue  # its maker or another sweep removed it meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its maker runs
            if not _same_file(fd, lock):
                continue
            path = _artifact_of(lock)
            existed = path.exists() or path.is_symlink()
            _remove(path)
            lock.unlink(missing_ok=True)
            if existed:  # else its maker died before making it, or is about to start again (see above)
                removed.append(path)
        finally:
            os.close(fd)
    return removed


def remove_unannounced(parent: Path, patterns: tuple[str, ...]) -> list[Path]:
    """Remove what older releases made in `parent` unannounced, by glob `patterns` (whatever runs: no
    process of this release makes them; one of ours matching a pattern has its announcement)."""
    removed = []
    for pattern in patterns:
        for path in sorted(parent.glob(pattern)) if parent.is_dir() else []:
            if not _lock_path(path).exists():
                _remove(path)
                removed.append(path)
    return removed


def live(parent: Path, *, owner: str | None = None, tree: bool = False, skip: tuple[Path, ...] = ()) -> list[Path]:
    """The artifacts in `parent` (with `tree`, anywhere under it but in `skip`) whose makers still run:
    of `owner` only, when given (one announced without an owner counts for every owner)."""
    found = []
    for lock in _locks(parent, tree=tree, skip=skip):
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                continue  # nobody holds it: a leftover, not live
            except BlockingIOError:
                pass
            named = os.pread(fd, 4096, 0).decode("utf-8", "replace")
            if owner is None or named in ("", owner):
                found.append(_artifact_of(lock))
        finally:
            os.close(fd)
    return found
