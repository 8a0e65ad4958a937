"""The files of a Chroma HNSW segment, read and cleared below the server: what no element owns.

hnswlib (Chroma's fork, in its Rust server) mallocs room for max_elements and, creating a segment's
files, writes that buffer whole, uninitialised slots included; so a long-running server's freed
memory, forgotten vectors among it, can land in any collection's files past the elements its
header counts, and anywhere in length.bin, which holds vectors' lengths only in the "cosine" space
(each persist writes the slots of the elements it added from that memory). These functions find
and zero those bytes; erasure.py decides when, under the collection's lock.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

from memory_pipelines.lib.infra.errors import ServiceError

__all__ = [
    "clear_unused_capacity",
    "unused_capacity_holds_data",
]

# header.bin of Chroma's hnswlib index: int32 format version, then size_t offsetLevel0, max_elements,
# cur_element_count, size_data_per_element, label_offset, offsetData (more fields follow).
_HNSW_HEADER = struct.Struct("<i6Q")
_HNSW_VERSION = 1
_ZEROS = bytes(1 << 20)


def _unowned(segment: Path) -> tuple[bytes, list[tuple[Path, int]]] | None:
    """header.bin's bytes and, for each HNSW file of `segment`, the offset past which no persisted
    element owns its bytes; None before the server has written an index there."""
    header = segment / "header.bin"
    try:
        raw = header.read_bytes()
    except FileNotFoundError:
        return None
    if len(raw) < _HNSW_HEADER.size:
        raise ServiceError("chroma", f"unexpected HNSW header in {segment} ({len(raw)} bytes)")
    version, _, capacity, count, element, label_offset, data_offset = _HNSW_HEADER.unpack_from(raw)
    if version != _HNSW_VERSION or count > capacity or not 0 < data_offset < label_offset < element:
        raise ServiceError("chroma", f"unknown HNSW format in {segment} (version {version}): not touching it")
    return raw, [
        (segment / "data_level0.bin", count * element),
        # A float per element, which hnswlib writes and reads only in the "cosine" space (it keeps
        # each vector's length there); in ours, "ip" (client.py SPACE), every byte is malloc'd memory.
        (segment / "length.bin", 0),
        (segment / "link_lists.bin", _link_lists_end(segment / "link_lists.bin", count)),
    ]


def unused_capacity_holds_data(segment: Path) -> bool:
    """True when some byte of the segment's HNSW files that no element owns is not zero. Reads only,
    so it may run without the tenant's lock as a hint; a file caught mid-write counts as holding data."""
    try:
        found = _unowned(segment)
    except ServiceError:
        return True
    return found is not None and any(_nonzero_from(path, keep) for path, keep in found[1])


def clear_unused_capacity(segment: Path) -> int:
    """Zero every byte of a segment's HNSW files that no persisted element owns; returns bytes zeroed.

    hnswlib mallocs room for max_elements (100 at first) and, creating the files, writes that buffer
    whole, uninitialised slots included: a long-running server's freed memory (vectors it parsed,
    returned or dropped, a deleted collection's among them) lands in data_level0.bin and length.bin
    past the elements header.bin counts, and stays there until persisted elements cover it, which
    a collection under the server's sync threshold (1,000 writes) never reaches. A later persist
    writes whole element slots in data_level0.bin (zeroed by hnswlib before use), but in length.bin
    the slots of the elements it added come from that memory again (our space keeps no lengths):
    length.bin is cleared whole, and the next scrub after a write clears it again.

    Only while no write reaches the collection (the tenant's lock held exclusively): a persist
    between our reading the header and writing zeros would lose its elements on disk. The header
    is read again afterwards, and a change fails loudly. An unknown format is not touched.
    """
    found = _unowned(segment)
    if found is None:
        return 0  # no index written yet (a collection without vectors)
    raw, tails = found
    zeroed = sum(_zero_from(path, keep) for path, keep in tails if _nonzero_from(path, keep))
    if (segment / "header.bin").read_bytes() != raw:
        raise ServiceError("chroma", f"the index in {segment} was written while its unused capacity was cleared")
    return zeroed


def _link_lists_end(path: Path, count: int) -> int:
    """Where the upper-level link lists of the first `count` elements end (each: uint32 size, bytes)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    fast = _aligned_link_lists_end(data, count)
    if fast is not None:
        return fast
    end = 0
    for _ in range(count):
        if end + 4 > len(data):
            raise ServiceError("chroma", f"{path} is shorter than its header's {count} elements")
        end += 4 + struct.unpack_from("<I", data, end)[0]
    if end > len(data):
        raise ServiceError("chroma", f"{path} is shorter than its header's {count} elements")
    return end


def _aligned_link_lists_end(data: bytes, count: int) -> int | None:
    """`_link_lists_end` of `data` when every list's size is a multiple of 4 (hnswlib's always are:
    levels times M + 1 uint32s), else None (the element-by-element walk decides, errors included).

    Most elements have no upper level, a zero size: 4 zero bytes. Those runs are skipped with one
    C-speed search for the next non-zero byte, which is the size of the next element that has
    lists; so the loop runs once per such element (about 1 in M), not once per element (the walk
    took 13 ms of a forget's 70 ms of CPU at 100,000 vectors, after every write)."""
    end, left, length = 0, count, len(data)
    while left:
        found = _NONZERO.search(data, end)
        zeros = left if found is None else min(left, (found.start() - end) // 4)
        end, left = end + 4 * zeros, left - zeros
        if not left:
            break
        if end + 4 > length:
            return None
        size = _U32.unpack_from(data, end)[0]
        if size % 4:
            return None
        end, left = end + 4 + size, left - 1
    return end if end <= length else None


_NONZERO = re.compile(rb"[^\x00]")
_U32 = struct.Struct("<I")


def _nonzero_from(path: Path, keep: int) -> bool:
    try:
        with path.open("rb") as fh:
            fh.seek(keep)
            while chunk := fh.read(len(_ZEROS)):
                if chunk.count(0) != len(chunk):
                    return True
    except FileNotFoundError:
        pass
    return False


def _zero_from(path: Path, keep: int) -> int:
    """Overwrite `path` with zeros from offset `keep` to its end, in place (its size stays: hnswlib
    reads a whole capacity at load); returns the bytes overwritten."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return 0
    if size <= keep:
        return 0
    with path.open("r+b") as fh:
        fh.seek(keep)
        left = size - keep
        while left:
            left -= fh.write(_ZEROS[: min(left, len(_ZEROS))])
        fh.flush()
        os.fsync(fh.fileno())
    return size - keep
