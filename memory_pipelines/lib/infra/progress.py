"""Progress of long library operations, without Dagster: a callback the hot loops call freely.

A `Progress` is called as `progress(done, total, what)` (`total` None when unknown). The library
calls it after every unit of work (an embedding batch, a scanned file, a backup chunk); whoever
passes it decides what to show. `throttled` turns a line sink (such as a Dagster `context.log.info`)
into a Progress that writes `progress: WHAT DONE/TOTAL` at most every few seconds or 10%, which
the CLI reads back from the run's event log (`parse`) to draw its progress bar.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Protocol

__all__ = [
    "ENV_VERBOSE",
    "PREFIX",
    "Progress",
    "Throttled",
    "line",
    "no_progress",
    "parse",
    "throttled",
]

PREFIX = "progress: "
# Set to 1 by `memory-pipelines --verbose`: Dagster's event log and warnings go to stderr as they are.
ENV_VERBOSE = "MEMORY_PIPELINES_VERBOSE"
_LINE = re.compile(r"^progress: (?P<what>.+?) (?P<done>\d+)/(?P<total>\d+|\?)$")


class Progress(Protocol):
    """Called after each unit of work: `done` so far of `total` (None when not known), `what` is done."""

    def __call__(self, done: int, total: int | None, what: str) -> None: ...


def no_progress(done: int, total: int | None, what: str) -> None:
    """The default: report nothing."""


def line(done: int, total: int | None, what: str) -> str:
    """`progress: WHAT DONE/TOTAL` (`?` for an unknown total): counts and names, never content."""
    return f"{PREFIX}{what} {done}/{'?' if total is None else total}"


def parse(message: str) -> tuple[str, int, int | None] | None:
    """(what, done, total) from a `line`, or None for any other message."""
    match = _LINE.match(message.strip())
    if match is None:
        return None
    total = match["total"]
    return match["what"], int(match["done"]), None if total == "?" else int(total)


class Throttled:
    """A Progress that writes `line`s to `sink`: the first call of each `what`, its last (done ==
    total), and otherwise only once `seconds` have passed or another `step` of the total is done.

    The check is a clock read and two comparisons, so a loop may call it for every item.
    """

    def __init__(
        self,
        sink: Callable[[str], object],
        *,
        seconds: float = 3.0,
        step: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sink = sink
        self.seconds = seconds
        self.step = step
        self.clock = clock
        self._last: dict[str, tuple[float, int]] = {}  # what -> (time, done) of the last line written

    def __call__(self, done: int, total: int | None, what: str) -> None:
        now = self.clock()
        last = self._last.get(what)
        if last is not None and not (total is not None and done >= total):
            at, then = last
            if now - at < self.seconds and (total is None or done - then < self.step * total):
                return
            if done == then:  # nothing new to say
                return
        elif last is not None and last[1] == done:
            return  # the final line was written already
        self._last[what] = (now, done)
        self.sink(line(done, total, what))


def throttled(sink: Callable[[str], object], *, seconds: float = 3.0, step: float = 0.1) -> Throttled:
    """A rate-limited Progress writing `line`s to `sink`, e.g. `progress=throttled(context.log.info)`."""
    return Throttled(sink, seconds=seconds, step=step)
