"""Named points of the lifecycle operations where a crash test kills the process.

MEMORY_PIPELINES_CRASH_AT names one point, `<name>` or `<name>#<n>` (its n-th passage in the
process, from 1). Reaching it sends SIGKILL to the process itself: no `finally`, no atexit handler,
no flush runs, as when the OOM killer or a power cut ends it. Unset, which it always is outside the
crash tests (tests/support/crashes.py), a point costs one environment lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

__all__ = [
    "ENV_CRASH_AT",
    "point",
]

ENV_CRASH_AT = "MEMORY_PIPELINES_CRASH_AT"
_passages: Counter[str] = Counter()


def point(name: str) -> None:
    """A place where a crash test may end this process (see the module docstring)."""
    wanted = os.environ.get(ENV_CRASH_AT)
    if not wanted:
        return
    target, _, nth = wanted.partition("#")
    if target != name:
        return
    _passages[name] += 1
    if _passages[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
