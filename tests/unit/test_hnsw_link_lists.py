"""Where an HNSW segment's link lists end (what the unused-capacity scrub keeps): the fast path that
skips runs of elements without upper levels gives the element-by-element walk's answer, or defers
to it (unaligned sizes, a file shorter than its header says). Pure: made-up files, no engine."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

from memory_pipelines.lib.infra.errors import ServiceError
from memory_pipelines.lib.stores.chroma import hnsw_files


def walk(data: bytes, count: int) -> int | None:
    """The walk the fast path must agree with: each element is a uint32 size and that many bytes."""
    end = 0
    for _ in range(count):
        if end + 4 > len(data):
            return None
        end += 4 + struct.unpack_from("<I", data, end)[0]
    return end if end <= len(data) else None


def lists(rng: random.Random, n: int, *, unaligned: float = 0.0) -> bytes:
    parts = []
    for _ in range(n):
        roll = rng.random()
        size = 0 if roll < 0.7 else 4 * rng.randint(1, 6) if roll >= unaligned + 0.7 else rng.randint(1, 30)
        payload = bytes(rng.choice((0, 0, rng.randint(1, 255))) for _ in range(size))
        parts.append(struct.pack("<I", size) + payload)
    return b"".join(parts)


def test_the_fast_path_agrees_with_the_walk_or_defers_to_it():
    rng = random.Random(23)
    for _ in range(3000):
        n = rng.randint(0, 50)
        data = lists(rng, n, unaligned=rng.choice((0.0, 0.05)))
        if rng.random() < 0.3:
            data = data[: rng.randint(0, len(data))]
        if rng.random() < 0.2:
            data += bytes(rng.randint(0, 12))
        for count in (0, n, max(0, n - 1), n + 1, rng.randint(0, n + 3)):
            fast = hnsw_files._aligned_link_lists_end(data, count)
            assert fast is None or fast == walk(data, count)
            if walk(data, count) is not None and all(
                struct.unpack_from("<I", data, at)[0] % 4 == 0 for at in _starts(data, count)
            ):
                assert fast == walk(data, count)  # aligned and whole: never deferred


def _starts(data: bytes, count: int) -> list[int]:
    starts, end = [], 0
    for _ in range(count):
        starts.append(end)
        end += 4 + struct.unpack_from("<I", data, end)[0]
    return starts


def test_a_file_shorter_than_its_header_says_still_fails_loudly(tmp_path: Path):
    path = tmp_path / "link_lists.bin"
    path.write_bytes(struct.pack("<I", 0) * 3 + struct.pack("<I", 8) + bytes(4))
    assert hnsw_files._link_lists_end(path, 3) == 12
    with pytest.raises(ServiceError, match="shorter"):
        hnsw_files._link_lists_end(path, 4)
    with pytest.raises(ServiceError, match="shorter"):
        hnsw_files._link_lists_end(path, 9)
