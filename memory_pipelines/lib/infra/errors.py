"""Errors raised by the memory store; each names the field it is about."""

from __future__ import annotations

import errno

from memory_pipelines.lib.results import MemoryWrite

__all__ = [
    "ConflictError",
    "MemoryPipelinesError",
    "NotFoundError",
    "PartialWriteError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "ServiceError",
    "ValidationError",
    "exhausted",
    "names_exhaustion",
    "resource_exhausted",
]


class MemoryPipelinesError(Exception):
    """Base class for every error the API reports to its callers."""

    exit_code = 1

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ValidationError(MemoryPipelinesError):
    """Input is malformed; nothing was written."""

    exit_code = 2


class NotFoundError(MemoryPipelinesError):
    """The named tenant, memory, team or version does not exist (for this caller)."""

    exit_code = 3


class PermissionDeniedError(MemoryPipelinesError):
    """The caller may not read or write what it asked for."""

    exit_code = 4


class ConflictError(MemoryPipelinesError):
    """The request contradicts the current state (e.g. rollback of a single version)."""

    exit_code = 5


class ServiceError(MemoryPipelinesError):
    """An engine (PostgreSQL, KMS) could not be reached or refused to serve."""

    exit_code = 6


class ResourceExhaustedError(MemoryPipelinesError):
    """The machine ran out of something (disk, memory, file descriptors, connections): nothing acknowledged
    is lost, and the same command can run again once it is freed."""

    exit_code = 9


# What each exhausted resource is called, by errno and by PostgreSQL SQLSTATE (class 53, with the name
# psycopg gives its error class, which is all a failed run's serialized error keeps).
_ERRNOS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.ENOMEM: "out of memory",
    errno.EMFILE: "too many open files in this process",
    errno.ENFILE: "too many open files on this machine",
}
_SQLSTATES = {
    "53100": ("DiskFull", "PostgreSQL's disk is full"),
    "53200": ("OutOfMemory", "PostgreSQL is out of memory"),
    "53300": ("TooManyConnections", "PostgreSQL has no connection left"),
    "53400": ("ConfigurationLimitExceeded", "PostgreSQL reached a configured limit"),
}
_EXHAUSTED_CLASSES = frozenset({name for name, _ in _SQLSTATES.values()} | {"MemoryError", "ResourceExhaustedError"})


def exhausted(field: str, what: str) -> ResourceExhaustedError:
    """The error for `what` ran out, with what the caller can do about it."""
    return ResourceExhaustedError(
        field, f"{what}; nothing acknowledged was lost: free it and run the same command again"
    )


def resource_exhausted(exc: BaseException) -> ResourceExhaustedError | None:
    """`exc` as a ResourceExhaustedError when it, or an exception it was raised from or during, says a
    resource ran out (an OSError's errno, a PostgreSQL error of class 53, MemoryError); else None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ResourceExhaustedError):
            return current
        what = None
        if isinstance(current, MemoryError):
            what = "out of memory"
        elif isinstance(current, OSError) and current.errno in _ERRNOS:
            what = _ERRNOS[current.errno] + (f" ({current.filename})" if current.filename else "")
        elif str(getattr(current, "sqlstate", "") or "") in _SQLSTATES:
            what = _SQLSTATES[str(getattr(current, "sqlstate", ""))][1]
        if what is not None:
            return exhausted("resources", what)
        current = current.__cause__ or current.__context__
    return None


def names_exhaustion(class_name: str, message: str) -> bool:
    """Whether an error known only by its class name and message (a failed run's, serialized) is one
    `resource_exhausted` finds: the same classes, the same errnos."""
    return class_name in _EXHAUSTED_CLASSES or any(f"[Errno {number}]" in message for number in _ERRNOS)


class PartialWriteError(MemoryPipelinesError):
    """A bulk write stopped part way: `written` (results as dicts, in item order) was committed, the
    items after it were not. Writing the same items again is safe: stored ones come back unchanged."""

    def __init__(self, cause: MemoryPipelinesError, *, written: list[MemoryWrite], total: int) -> None:
        super().__init__(
            cause.field,
            f"{cause.message} (the first {len(written)} of {total} items were written before this; the rest"
            " were not, and writing the same items again returns those unchanged)",
        )
        self.exit_code = cause.exit_code
        self.cause = cause
        self.written = written
