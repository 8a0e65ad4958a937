"""PostgreSQL's write-ahead log after a physical erasure: the segments that held the erased rows go.

Every row ever written is in the WAL (an INSERT logs the whole tuple; the first change of a page
after a checkpoint logs the whole page, dead tuples included). A checkpoint makes old segments
unneeded, and the server then recycles them: renamed to a future segment's name, their bytes kept
until overwritten. The embedded server runs with `wal_recycle = off` (lib/infra/services.py), so unneeded
segments are unlinked instead; `purge` switches to a new segment until the current one is younger
than every segment that existed when it started (recycled future segments included), then
checkpoints, so none of them is needed any more, and none is left. A server whose files are not
on this machine (MEMORY_PIPELINES_PG_URL) is left alone: its operator configures it (docs/operating.md, Production).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from memory_pipelines.lib.stores.adapter import data_directory

__all__ = [
    "ARCHIVE_WAIT_SECONDS",
    "MAX_SWITCHES",
    "NOT_SCANNED",
    "WalPurge",
    "files",
    "is_segment",
    "purge",
    "segments",
    "wal_directory",
]

_SEGMENT = re.compile(r"[0-9A-F]{24}")
NOT_SCANNED = "postgres_wal"  # named in a proof's notScanned when pg_wal is not on this machine
# A server with max_wal_size = 1 GB keeps at most ~64 recycled 16 MB segments; a bound above that.
MAX_SWITCHES = 512
# How long a purge waits for the WAL archiver (when archiving is on) before it checkpoints anyway.
ARCHIVE_WAIT_SECONDS = 60.0


@dataclass
class WalPurge:
    """What `purge` did: segments present before it, those removed, switches made, those left."""

    directory: Path | None
    reason: str = ""
    segments_before: int = 0
    segments_removed: int = 0
    switches: int = 0
    left: list[str] = field(default_factory=list)  # segments of before still present (expected: none)

    @property
    def purged(self) -> bool:
        return self.directory is not None and not self.left

    def report(self) -> dict[str, Any]:
        """For the proof: counts only (segment names say nothing, but nor do they help a reader)."""
        out: dict[str, Any] = {
            "purged": self.purged,
            "segmentsBefore": self.segments_before,
            "segmentsRemoved": self.segments_removed,
            "switches": self.switches,
            "segmentsLeft": len(self.left),
        }
        if self.reason:
            out["reason"] = self.reason
        return out


def is_segment(name: str) -> bool:
    """A WAL segment file's name (24 hex digits), not a history, backup label or partial file's."""
    return _SEGMENT.fullmatch(name) is not None


def segments(directory: Path) -> list[str]:
    """The WAL segment files of `directory` (pg_wal), by name."""
    try:
        return sorted(p.name for p in directory.iterdir() if is_segment(p.name))
    except FileNotFoundError:
        return []


def files(directory: Path | None) -> list[Path]:
    """Every file under pg_wal (segments, archive status, WAL summaries): what a byte scan reads."""
    if directory is None or not directory.is_dir():
        return []
    return sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink())


def wal_directory(conn: psycopg.Connection) -> Path | None:
    """pg_wal of the server when its files are on this machine (the embedded server), else None."""
    data_dir = data_directory(conn)
    return None if data_dir is None else data_dir / "pg_wal"


def _current(conn: psycopg.Connection) -> str:
    row = conn.execute("SELECT pg_walfile_name(pg_current_wal_insert_lsn())").fetchone()
    assert row is not None
    return str(row[0])


def _no_recycling(conn: psycopg.Connection) -> None:
    """wal_recycle off, for a server started before memory_pipelines set it (lib/infra/services.py)."""
    row = conn.execute("SELECT setting FROM pg_catalog.pg_settings WHERE name = 'wal_recycle'").fetchone()
    if row is not None and row[0] != "off":
        conn.execute("ALTER SYSTEM SET wal_recycle = off")
        conn.execute("SELECT pg_reload_conf()")
        time.sleep(0.2)  # the checkpointer reads the new setting at its next wake-up


def _archived(conn: psycopg.Connection, segment: str, timeout: float = ARCHIVE_WAIT_SECONDS) -> None:
    """With WAL archiving on (an operator's choice), a segment stays until the archiver has copied it:
    wait (bounded) until it has copied `segment` and every one before it, so the checkpoint can
    remove them. The archive's copies are the operator's to bound (docs/operating.md, Production)."""
    if not segment:
        return
    row = conn.execute("SELECT setting FROM pg_catalog.pg_settings WHERE name = 'archive_mode'").fetchone()
    if row is None or row[0] == "off":
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = conn.execute(
            "SELECT coalesce(last_archived_wal >= %s, false) FROM pg_stat_archiver", (segment,)
        ).fetchone()
        if done and done[0]:
            return
        time.sleep(0.1)


def purge(conninfo: str) -> WalPurge:
    """Switch past every segment present now, then checkpoint: the checkpoint's redo point lies past
    each of those segments, which may hold rows erased before this call, so they are unneeded and
    unlinked (not recycled)."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        directory = wal_directory(conn)
        if directory is None:
            return WalPurge(None, reason="PostgreSQL's files are not on this machine (external server)")
        _no_recycling(conn)
        before = segments(directory)
        newest = max(before, default="")
        switches = 0
        while True:
            # A record first: a switch with nothing written since the last one does nothing, and the
            # insert position is then inside a segment, whose name pg_walfile_name gives exactly.
            conn.execute("SELECT pg_logical_emit_message(false, 'memory_pipelines', 'erasure')")
            if _current(conn) > newest or switches >= MAX_SWITCHES:
                break
            conn.execute("SELECT pg_switch_wal()")
            switches += 1
        _archived(conn, newest)
        conn.execute("CHECKPOINT")
        after = set(segments(directory))
    left = sorted(name for name in before if name in after)
    return WalPurge(
        directory,
        segments_before=len(before),
        segments_removed=len(before) - len(left),
        switches=switches,
        left=left,
        reason="" if not left else "segments from before the erasure are still needed by the server",
    )
