"""CPU-seconds each test module spent, printed at the end of a run, to choose what to make cheaper.

On two cores the suite is bound by its CPU work (docs/development.md), so wall time per module says
little: a module waiting on a sensor costs nothing, one starting Dagster processes costs much. This
counts, per test, the CPU of the worker process and of the children it has waited for (a command
run to its end, a server stopped and reaped); a process left to someone else to reap is not counted,
so the figures are a floor. A child counts when it is reaped: a server one test started and a later
test in the same worker reaped lands on the later test's module, so a small module can show a
server's whole life (docs/development.md). Workers send theirs to the controller through xdist's
`workeroutput`.
"""

from __future__ import annotations

import json
import resource

from tests.support.durations import module_of

# Lines printed: the costliest modules, enough to see where the CPU goes.
SHOWN = 15


def cpu_seconds() -> float:
    """This process's CPU and that of its children waited for, user and system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuByModule:
    """Adds up each test's CPU-seconds under its module."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, nodeid: str, seconds: float) -> None:
        module = module_of(nodeid)
        self.seconds[module] = self.seconds.get(module, 0.0) + seconds

    def dumps(self) -> str:
        return json.dumps(dict(self.seconds))

    def merge(self, dumped: str) -> None:
        for module, seconds in json.loads(dumped).items():
            self.seconds[module] = self.seconds.get(module, 0.0) + float(seconds)

    def lines(self) -> list[str]:
        total = sum(self.seconds.values())
        costliest = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:SHOWN]
        shown = [f"{seconds:8.1f} s  {module}" for module, seconds in costliest]
        return [*shown, f"{total:8.1f} s  all {len(self.seconds)} modules"]
