"""Resource errors are their own exit code (9), found anywhere in an exception's chain (issue 33)."""

from __future__ import annotations

import errno

import psycopg
import pytest

from memory_pipelines.lib.forget.ledger import DeletionBlocked
from memory_pipelines.lib.infra.errors import ResourceExhaustedError, ValidationError, resource_exhausted


def _raised_from(cause: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as exc:
            raise outer from exc
    except BaseException as caught:
        return caught


@pytest.mark.parametrize(
    ("cause", "said"),
    [
        (
            OSError(errno.ENOSPC, "No space left on device", "/home/x/backups/a.bin"),
            "disk full (/home/x/backups/a.bin)",
        ),
        (OSError(errno.EMFILE, "Too many open files"), "too many open files in this process"),
        (MemoryError(), "out of memory"),
        (psycopg.errors.DiskFull("could not extend file"), "PostgreSQL's disk is full"),
        (psycopg.errors.TooManyConnections("sorry, too many clients"), "PostgreSQL has no connection left"),
    ],
)
def test_a_resource_running_out_is_exit_9_however_deep_it_was_raised(cause: BaseException, said: str) -> None:
    wrapped = _raised_from(cause, DeletionBlocked("freeze", "FREEZE_ERROR", f"{type(cause).__name__}: {cause}"))
    found = resource_exhausted(wrapped)
    assert isinstance(found, ResourceExhaustedError)
    assert (found.exit_code, found.field) == (9, "resources")
    assert found.message.startswith(said) and "run the same command again" in found.message


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOENT, "No such file or directory"),
        ValidationError("tenant", "is empty"),
        psycopg.errors.UniqueViolation("duplicate key"),
        RuntimeError("boom"),
    ],
)
def test_other_errors_are_not_taken_for_a_resource(error: BaseException) -> None:
    assert resource_exhausted(_raised_from(error, RuntimeError("outer"))) is None
