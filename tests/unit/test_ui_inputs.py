"""Pure inputs of what the demo and the UI restore show: the month the demo evaluates, backup ids."""

from __future__ import annotations

from datetime import date

import pytest

from memory_pipelines.demo import last_completed_month
from memory_pipelines.lib.backups.catalog import check_backup_id
from memory_pipelines.lib.infra.errors import ValidationError


def test_the_demo_evaluates_the_month_that_ended():
    assert last_completed_month(date(2026, 11, 30)) == date(2026, 10, 1)
    assert last_completed_month(date(2027, 1, 1)) == date(2026, 12, 1)
    assert last_completed_month(date(2026, 2, 28)) == date(2026, 1, 1)
    assert last_completed_month(date(2026, 1, 15)) is None  # the evaluation's months start in 2026-01


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "backup_id: is required"),
        ("../../etc/passwd", "backup_id: malformed backup id '../../etc/passwd'"),
        ("b_20260101T000000_DEADBEEF", "backup_id: malformed backup id"),
        ("b_20260101T000000_deadbeef0", "backup_id: malformed backup id"),
        (None, "backup_id: is required"),
    ],
)
def test_backup_ids_are_checked_naming_the_field(value, message):
    with pytest.raises(ValidationError) as caught:
        check_backup_id(value)
    assert str(caught.value).startswith(message) and caught.value.field == "backup_id"


def test_a_well_formed_backup_id_passes():
    assert check_backup_id("b_20261130T013000_1a2b3c4d") == "b_20261130T013000_1a2b3c4d"
