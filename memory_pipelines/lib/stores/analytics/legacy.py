"""Older installs' analytics directories, named by raw tenant ids: read while they are there, then converted.

`root/memories/tenant_id=T/` holds either buckets without the `tenant_id` column
(`bucket=NN/part.parquet`) or, from before the buckets, one file (`memories.parquet`). The first
write after the upgrade (or `refresh_views`) converts every one of them under the writer lock; the
module docstring of store.py says in which order, and why each reader sees one whole copy throughout.
"""

from __future__ import annotations

import os
import shutil
from contextlib import suppress
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from memory_pipelines.lib.infra.owner_only import private_dir
from memory_pipelines.lib.infra.paths import tenant_hash
from memory_pipelines.lib.stores.analytics.files import (
    BUCKET_FILE,
    BUCKETS,
    LEGACY_FILE,
    OLD_TENANT_KEY,
    RETIRED_DIR,
    SCHEMA,
    _with_tenant,
)
from memory_pipelines.lib.stores.analytics.views import AnalyticsViews

__all__ = [
    "LegacyLayout",
]


class LegacyLayout(AnalyticsViews):
    """Reading and converting the directories of installs from before the hashed names."""

    def _read_old(
        self, directory: Path, tenant_id: str, *, buckets: set[int] | None = None, columns: list[str] | None = None
    ) -> pa.Table | None:
        """The rows of an old directory (its one file while there, else its buckets), each given the
        `tenant_id` its directory names; None once it is gone, or when it loses a file between the
        listing and the open: only its conversion takes files from it, and that renames the whole
        directory away after the new copy is complete, so the caller reads the new copy instead."""
        wanted = None if columns is None else [c for c in columns if c != "tenant_id"]

        def finish(table: pa.Table) -> pa.Table:
            table = _with_tenant(table, tenant_id)
            return table.select(columns) if columns is not None else table

        try:
            fh = open(directory / LEGACY_FILE, "rb")
        except (FileNotFoundError, NotADirectoryError):
            pass
        else:
            with fh:
                return finish(pq.ParquetFile(fh).read(columns=wanted))
        found: dict[int, Path] = {}
        try:
            for path in directory.glob(f"bucket=*/{BUCKET_FILE}"):
                number = path.parent.name.removeprefix("bucket=")
                if number.isdigit() and int(number) < BUCKETS:
                    found[int(number)] = path
        except FileNotFoundError:
            return None  # renamed away as the listing began
        if not found and not directory.is_dir():
            return None  # renamed away before the listing
        old_schema = pa.schema([f for f in SCHEMA if f.name != "tenant_id"])
        empty = old_schema.empty_table()
        tables = [empty.select(wanted) if wanted is not None else empty]
        for bucket, path in sorted(found.items()):
            if buckets is not None and bucket not in buckets:
                continue
            try:
                fh = open(path, "rb")
            except FileNotFoundError:
                return None
            with fh:
                table = pq.ParquetFile(fh).read(columns=wanted)
            tables.append(table.drop_columns([c for c in table.column_names if c == "tenant_id"]))
        return finish(pa.concat_tables(tables))

    def _upgrade_locked(self) -> None:
        """Under writer_lock: convert every tenant still under its raw id (see the module
        docstring of store.py). A no-op, two stats, once they are all converted."""
        retired = self.root / RETIRED_DIR
        if retired.exists():
            shutil.rmtree(retired)  # what a conversion that died left renamed aside: converted already
        if not self.old_data_dir.is_dir():
            return
        old = sorted(d for d in self.old_data_dir.glob(f"{OLD_TENANT_KEY}=*") if d.is_dir())
        if not old:
            with suppress(OSError):
                self.old_data_dir.rmdir()  # gone once empty; anything else left in it is not ours
            return
        for directory in old:
            tenant_id = directory.name.removeprefix(f"{OLD_TENANT_KEY}=")
            table = self._read_old(directory, tenant_id)
            # Nothing else writes old directories: one that vanished meanwhile held no rows.
            self._replace_partition_locked(tenant_id, SCHEMA.empty_table() if table is None else table)
        self._write_view(self._has_data())
        private_dir(retired)
        for directory in old:
            # One rename takes the whole old copy away at once (a reader mid-read loses a file and
            # turns to the new copy), then its files go: unlinked, as every removal here does.
            aside = retired / tenant_hash(directory.name.removeprefix(f"{OLD_TENANT_KEY}="))
            os.replace(directory, aside)
            shutil.rmtree(aside)
        retired.rmdir()
        with suppress(OSError):
            self.old_data_dir.rmdir()  # gone once empty; anything else left in it is not ours
