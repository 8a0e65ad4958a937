"""PostgreSQL's copies beyond a tenant's partitions: its statistics, and every file of its data directory.

ANALYZE (ours after bulk writes, autovacuum's on its own) copies up to 101 sampled values of each
column into `pg_statistic`, a catalog no rewrite of the tenant's partitions touches. Migration 0021
keeps every bytea column of ours (ciphertexts, MACs, wrapped keys) out of ANALYZE and gives it
statistics without any value; the erasure does it again for the tenant's partitions (an operator's
ALTER TABLE could have set a target) and rewrites `pg_statistic` so no dead tuple of it keeps an old
sample. Then the byte scan reads every
file of the data directory, catalogs, other databases and logs included, not a list of relations:
a copy nobody listed is found where it lies. Files last written before the tenant existed cannot
hold its data and are not read (their modification time is older than the tenant's creation).

A server whose files are not on this machine, or on which we are not a superuser (a managed
PostgreSQL), is left alone: the proof says so, and cryptographic erasure is what holds there.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg

from memory_pipelines.lib.memories import table_partitions
from memory_pipelines.lib.stores.adapter import data_directory

__all__ = [
    "NOT_SCANNED",
    "DataFiles",
    "clear_statistics",
    "data_files",
]

NOT_SCANNED = "postgres_files"  # named in a proof's notScanned when the data directory is not ours to read
# Clock and timestamp granularity between PostgreSQL's now() and the filesystem's modification times.
_SLACK = timedelta(minutes=1)


@dataclass
class DataFiles:
    """The data directory's files the byte scan reads, and those it may skip (unchanged since before
    the tenant existed)."""

    directory: Path | None
    files: list[Path] = field(default_factory=list)
    older: int = 0

    def report(self) -> dict[str, Any]:
        return {"local": self.directory is not None, "files": len(self.files), "olderThanTenant": self.older}


def clear_statistics(conninfo: str, tenant_id: str) -> dict[str, Any]:
    """No sampled value of a sealed column of the tenant's partitions (or their parents) is left (their
    statistics hold none: `memory.sealed_column_statistics`), and `pg_statistic` is rewritten (VACUUM
    FULL) so none lingers in a dead tuple. Counts only."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        tables = [*table_partitions.PARTITIONED_TABLES, *table_partitions.tenant_partitions(conn, tenant_id).values()]
        row = conn.execute(
            "SELECT coalesce(sum(memory.sealed_column_statistics(t::regclass)), 0) FROM unnest(%s::text[]) AS t",
            (tables,),
        ).fetchone()
        columns = int(row[0]) if row else 0
        # Only a superuser may rewrite a catalog (anyone else's VACUUM skips it with a warning): on a
        # managed server the catalogs are its operator's.
        superuser = conn.execute("SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user").fetchone()
        rewritten = bool(superuser and superuser[0])
        if rewritten:
            conn.execute("VACUUM FULL pg_catalog.pg_statistic")
    return {"sealedColumns": columns, "pgStatisticRewritten": rewritten}


def data_files(conninfo: str, tenant_id: str) -> DataFiles:
    """Every regular file of the server's data directory that may hold the tenant's bytes; none when
    the directory is not on this machine."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        directory = data_directory(conn)
        row = conn.execute("SELECT created_at FROM memory.tenants WHERE tenant_id = %s", (tenant_id,)).fetchone()
    if directory is None:
        return DataFiles(None)
    since = None if row is None else (row[0] - _SLACK).timestamp()
    found = DataFiles(directory)
    for root, _, names in os.walk(directory):
        for name in names:
            path = Path(root) / name
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue  # removed while we listed
            if not stat.S_ISREG(info.st_mode):
                continue
            if since is not None and info.st_mtime < since:
                found.older += 1
                continue
            found.files.append(path)
    found.files.sort()
    return found
