"""Named points of the lifecycle operations where a crash test kills the process.

MEMORY_PIPELINES_CRASH_AT names one point, `<name>`, `<name>#<n>` (its n-th passage in the
process, from 1), either followed by `@group`. Reaching it sends SIGKILL to the process itself: no
`finally`, no atexit handler, no flush runs, as when the OOM killer or a power cut ends it. With
`@group`, to its whole process group: a command started in a session of its own dies with its own
code server and run workers, as when the host that ran them is lost. Unset, which it always is
outside the crash tests (tests/support/crashes.py), a point costs one environment lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

from memory_pipelines.lib.infra.errors import ValidationError

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
    spec, _, scope = wanted.partition("@")
    target, _, nth = spec.partition("#")
    if target != name:
        return
    if not (nth or "1").isdigit() or int(nth or 1) < 1 or scope not in ("", "group"):
        raise ValidationError(ENV_CRASH_AT, f"{wanted!r} is not NAME, NAME#N or either with @group (N from 1)")
    _passages[name] += 1
    if _passages[name] >= int(nth or 1):
        if scope == "group":
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
