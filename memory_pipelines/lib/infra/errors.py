"""Errors raised by the memory store; each names the field it is about."""

from __future__ import annotations

from memory_pipelines.lib.results import MemoryWrite

__all__ = [
    "ConflictError",
    "MemoryPipelinesError",
    "NotFoundError",
    "PartialWriteError",
    "PermissionDeniedError",
    "ServiceError",
    "ValidationError",
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
