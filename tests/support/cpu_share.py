"""A CPU share of its own for a test that times the owner's work beside an attacker's
(tests/integration/test_chroma_door.py).

The test's process, so every child it starts (the owner's commands, the flood), and the processes of
its HOME (the door, Chroma, PostgreSQL and the backends it forks) go into a cgroup whose weight
outranks everything else on the machine. Among themselves they compete for the cores as on a machine
of their own; the other xdist workers' tests, which have nothing to do with the door, are left out
of the figures. Where no cgroup `cpu` controller is writable (not root, a container without one),
nothing moves and the figures carry the machine's load, as they did before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from memory_pipelines.lib.infra import processes

__all__ = ["own_cpu_share"]

CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
# The largest weight each version accepts: the group takes whatever CPU it asks for.
V1_SHARES = ("cpu.shares", "262144")
V2_WEIGHT = ("cpu.weight", "10000")


def _hierarchy() -> tuple[Path, tuple[str, str], int] | None:
    """The cpu controller's root, the weight file and value, and the field of /proc/PID/cgroup that
    names a process's group in it: the v1 `cpu` hierarchy, else v2's when it offers `cpu`."""
    if (CGROUP_V1_CPU / V1_SHARES[0]).exists():
        return CGROUP_V1_CPU, V1_SHARES, 1
    controllers = CGROUP_V2 / "cgroup.subtree_control"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return CGROUP_V2, V2_WEIGHT, 2
    return None


def _group_of(pid: int, version: int) -> str | None:
    """The process's group in the hierarchy, as a path from its root ("/" for the root)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if (version == 1 and "cpu" in controllers.split(",")) or (version == 2 and controllers == ""):
            return path
    return None


def _move(pid: int, group: Path) -> bool:
    try:
        (group / "cgroup.procs").write_text(f"{pid}\n")
    except OSError:  # ended meanwhile, or a kernel thread
        return False
    return True


def _servers_of(home: Path) -> list[int]:
    """The processes whose command line names `home` (PostgreSQL's postmaster, the door, Chroma), and
    every process under them (the backends the postmaster forked before the move)."""
    table = processes.processes()
    named = [proc for proc in table if processes.names_path(proc.command, home)]
    return sorted({found.pid for proc in named for found in (proc, *processes.descendants(proc.pid, table))})


@contextlib.contextmanager
def own_cpu_share(*, home: Path) -> Iterator[None]:
    """This process and every process of `home` in a CPU group of their own for the block, where
    the machine lets us make one. On leaving, each process still alive in the group goes back where
    it was (one started in the block, to where this process was) and the group is removed."""
    found = _hierarchy()
    if found is None:
        yield
        return
    root, (weight_file, weight), version = found
    group = root / f"memory-pipelines-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / weight_file).write_text(weight)
    except OSError:
        with contextlib.suppress(OSError):
            group.rmdir()
        yield
        return
    was: dict[int, str] = {}
    for pid in (os.getpid(), *_servers_of(home)):
        before = _group_of(pid, version)
        if before is not None and _move(pid, group):
            was[pid] = before
    try:
        yield
    finally:
        ours = was.get(os.getpid(), "/")
        for _ in range(5):  # a PostgreSQL backend may be forked into the group while it empties
            for line in (group / "cgroup.procs").read_text().split():
                _move(int(line), root / was.get(int(line), ours).lstrip("/"))
            with contextlib.suppress(OSError):
                group.rmdir()
                break
