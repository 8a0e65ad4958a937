"""Errors raised by the memory store; each names the field it is about."""

from __future__ import annotations


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
