"""The attacker's reading of a WAL segment (tests/support/attacker.py): a value whose record crosses an
8 KiB page is split by the next page's header, so only the record stream holds it whole."""

from __future__ import annotations

import os
from pathlib import Path

from memory_pipelines.lib.forget import wal
from tests.support.attacker import find_exact, wal_stream

PAGE = 8192


def _header(*, long: bool) -> bytes:
    info = 0x0002 if long else 0x0001  # XLP_LONG_HEADER; XLP_FIRST_IS_CONTRECORD on a continued page
    return (0xD118).to_bytes(2, "little") + info.to_bytes(2, "little") + bytes((40 if long else 24) - 4)


def _segment(value: bytes) -> bytes:
    """Two pages: the value begins 10 bytes before the first page ends and goes on after the second's header."""
    first = _header(long=True) + os.urandom(PAGE - 40 - 10) + value[:10]
    second = _header(long=False) + value[10:] + os.urandom(PAGE - 24 - len(value) + 10)
    return first + second


def test_a_value_split_by_a_page_header_is_whole_in_the_stream(tmp_path: Path) -> None:
    value = os.urandom(80)
    segment = _segment(value)
    assert len(segment) == 2 * PAGE and value not in segment  # the control: split in the raw file
    assert value in wal_stream(segment) and len(wal_stream(segment)) == 2 * PAGE - 40 - 24
    path = tmp_path / "000000010000000000000003"
    path.write_bytes(segment)
    assert wal.is_segment(path.name)
    assert find_exact([path], {"value": value}) == {"value": [str(path)]}


def test_other_files_are_read_as_they_are(tmp_path: Path) -> None:
    value = os.urandom(80)
    segment = _segment(value)
    other = tmp_path / "relation.bin"  # same bytes, not a segment's name: not stitched
    other.write_bytes(segment)
    assert not wal.is_segment(other.name)
    assert find_exact([other], {"value": value}) == {}
    plain = tmp_path / "plain.bin"
    plain.write_bytes(b"x" * 100 + value)
    assert find_exact([plain], {"value": value}) == {"value": [str(plain)]}
