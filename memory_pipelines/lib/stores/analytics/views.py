"""The DuckDB database of the analytics root: a `memories` view globbing every tenant's bucket files.

Readers (here or in a notebook) open it read-only. It is never opened read-write in place: a new
file is written aside under the writer lock and renamed over it, so a reader never meets DuckDB's
own file lock, and a writer never fails because a reader holds the file open.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import duckdb

from memory_pipelines.lib.infra.owner_only import private_file
from memory_pipelines.lib.stores.analytics.files import TENANT_KEY, PartitionFiles

__all__ = [
    "AnalyticsViews",
]


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


class AnalyticsViews(PartitionFiles):
    """The view over the bucket files, and read-only connections to it."""

    def _has_data(self) -> bool:
        return any(self.data_dir.glob(f"{TENANT_KEY}=*/bucket=*/*.parquet"))

    def _view_pattern(self) -> str:
        return str(self.data_dir / f"{TENANT_KEY}=*" / "bucket=*" / "*.parquet")

    def connect(self) -> duckdb.DuckDBPyConnection:
        """A read-only DuckDB connection to the views (readers never open the file read-write)."""
        return duckdb.connect(str(self.database), read_only=True)

    def _view_is(self, has_data: bool) -> bool:
        """Whether the database holds the view wanted: over our glob when there is data, none otherwise."""
        try:
            with self.connect() as con:
                row = con.execute("SELECT sql FROM duckdb_views() WHERE view_name = 'memories'").fetchone()
        except duckdb.Error:
            return False  # unreadable, or someone else holds it read-write: written afresh
        if not has_data:
            return row is None
        return row is not None and _literal(self._view_pattern()) in str(row[0])

    def _write_view(self, has_data: bool) -> None:
        # Under writer_lock. A fresh file renamed over the old one: an open reader keeps the old.
        tmp = self.database.with_name(f"{self.database.name}.{os.getpid()}-{threading.get_ident()}.tmp")
        tmp.unlink(missing_ok=True)
        try:
            with duckdb.connect(str(tmp)) as con:
                if has_data:
                    # DDL takes no bound parameters; the path is ours (under HOME, no tenant id in it),
                    # quoted as a literal. `tenant_id` comes from the files, last as it always was;
                    # the path's hash is left out. Types given: left to guess, a hash of digits
                    # only would read as a number.
                    con.execute(
                        f"CREATE VIEW memories AS SELECT * EXCLUDE ({TENANT_KEY}, tenant_id), tenant_id"  # noqa: S608
                        " FROM read_parquet("
                        + _literal(self._view_pattern())
                        + ", hive_partitioning = true"
                        + f", hive_types = {{'{TENANT_KEY}': 'VARCHAR', 'bucket': 'INTEGER'}})"
                    )
            private_file(tmp)
            os.replace(tmp, self.database)
        finally:
            tmp.unlink(missing_ok=True)
            Path(str(tmp) + ".wal").unlink(missing_ok=True)
