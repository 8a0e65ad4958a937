"""Deleting vectors so that their bytes leave every file: the HNSW segments and Chroma's SQLite.

Chroma's delete only flags a vector; `erase_physically` rewrites the tenant's collection, removes
the segment directories a server leaves behind, and vacuums the SQLite log. A server writes an
index's unused capacity from malloc'd memory, which may hold any tenant's vectors: `scrub` clears it
after our writes, and an erasure sweeps every other collection too (hnsw_files.py has the format).
Also here: the files a byte scan of the tenant must read, and what is still live in them.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from memory_pipelines.lib.infra import faults
from memory_pipelines.lib.infra.errors import ServiceError
from memory_pipelines.lib.stores.chroma.client import (
    ERASURES,
    SPACE,
    ChromaCollections,
    read_pages,
    reopen_embedded,
    serialized,
)
from memory_pipelines.lib.stores.chroma.hnsw_files import clear_unused_capacity, unused_capacity_holds_data
from memory_pipelines.lib.stores.chroma.locks import collection_name, holds_any

__all__ = [
    "VectorErasure",
    "log",
    "remove_orphan_segments",
    "vacuum_sqlite",
]

log = logging.getLogger(__name__)

_REBUILD_STEP = 500  # vectors a rebuild copies at a time: short bursts on the server
_DELETE_REQUEST = 500  # ids a delete request carries at most: see VectorErasure._delete_in
_STAGING = "-rebuild"  # suffix of the collection a rebuild fills before it takes the tenant's name
_SWEEP_WAIT = 5.0  # seconds an erasure's sweep waits for another tenant's collection lock


class VectorErasure:
    """Deletion, physical erasure and byte-scan support of the tenant collections.

    `clear`: zeroes what no element owns in a segment's index files and returns the bytes zeroed
    (clear_unused_capacity unless a caller, such as a benchmark of the old erasure, replaces it)."""

    def __init__(self, collections: ChromaCollections, *, clear: Callable[[Path], int] = clear_unused_capacity) -> None:
        self.collections = collections
        self.locks = collections.locks
        self.path = collections.path
        self.url = collections.url
        self._clear_unused_capacity = clear

    def scrub(self, tenant_id: str) -> int:
        """Clear the unused index capacity of the tenant's collection when any holds data; bytes zeroed.

        Runs after our writes: the first write to a collection (and the first after a server
        restart, to one never persisted) makes the server write its files from malloc'd memory,
        which may hold any tenant's vectors, forgotten ones included (see clear_unused_capacity).
        The check reads a few headers; only a collection with such bytes takes the tenant's lock
        exclusively, for milliseconds. A thread already holding the lock (shared, maybe) skips."""
        if self.path is None or self.locks.holds(tenant_id):
            return 0
        if not any(unused_capacity_holds_data(segment) for segment in self.segments(tenant_id)):
            return 0
        zeroed = 0
        with self.locks.tenant_lock(tenant_id, exclusive=True):
            for segment in self.segments(tenant_id):
                try:
                    zeroed += self._clear_unused_capacity(segment)
                except ServiceError as exc:  # hygiene after a write: the erasure is what fails loudly
                    log.warning("could not clear unused capacity of %s: %s", segment, exc)
        return zeroed

    def _scrub_others(self, tenant_id: str) -> list[str]:
        """Clear the unused capacity of every other tenant's collection; returns those left busy.

        An erasure's sweep: a collection whose files the server wrote while this tenant's vectors
        were in its memory may hold some (benchmarks/erasure_loop.py found them in 5 of 50 new
        collections), and a scrub after writes does not reach a collection whose files a server
        restart re-created on a read. Each collection is taken alone under its own lock, waiting
        at most _SWEEP_WAIT seconds (the caller holds no tenant lock, so two sweeps never wait on
        each other); one still busy then is named, and its next writer's scrub or sweep clears it."""
        assert self.path is not None
        with sqlite3.connect(str(self.path / "chroma.sqlite3"), timeout=30) as db:
            rows = db.execute(
                "SELECT c.name, s.id FROM segments s JOIN collections c ON s.collection = c.id"
            ).fetchall()
        own = collection_name(tenant_id)
        busy = []
        for name, segment_id in rows:
            base = str(name).removesuffix(_STAGING)  # a rebuild in progress holds its tenant's lock
            segment = self.path / str(segment_id)
            if base == own or not base.startswith("mem-") or not unused_capacity_holds_data(segment):
                continue
            with self.locks.collection_lock(base, exclusive=True, timeout=_SWEEP_WAIT) as locked:
                if not locked:
                    busy.append(str(name))
                    continue
                try:
                    self._clear_unused_capacity(segment)
                except ServiceError as exc:  # another tenant's index: reported, never this erasure's failure
                    log.warning("could not clear unused capacity of %s: %s", segment, exc)
                    busy.append(str(name))
        if busy:
            log.warning("unused index capacity left to clear in %d busy collection(s): %s", len(busy), busy[:5])
        return busy

    @serialized
    def drop(self, tenant_id: str) -> bool:
        """Delete the tenant's collection (its files go with it); True when one existed."""
        client = self.collections.client()
        name = collection_name(tenant_id)
        with self.locks.tenant_lock(tenant_id, exclusive=True):
            existing = self.collections.call("listing collections", lambda: [c.name for c in client.list_collections()])
            staged = self._drop_staging(tenant_id, existing)
            found = name in existing
            if found:
                self.collections.call("deleting the collection", lambda: client.delete_collection(name=name))
            if (found or staged) and self.url is not None and self.path is not None:
                remove_orphan_segments(self.path)  # a server leaves the deleted collection's files
        return found

    def _drop_staging(self, tenant_id: str, names: list[str] | None = None) -> bool:
        """Delete the tenant's rebuild collection, if a rebuild left one; the caller holds the tenant's
        lock exclusively, so no rebuild runs and one found is a dead rebuild's. True when one was.

        A rebuild killed before it deleted the old collection leaves a partial copy; one killed between
        that and the rename leaves the whole copy and no collection under the tenant's name. Either
        is dropped, never renamed into place: a forget accepted since then found no vector under the
        tenant's name and deleted none, so the copy may hold what it forgot. The next sync embeds the
        tenant's current versions again. `names`: the collections, when the caller listed them already."""
        client = self.collections.client()
        staging = collection_name(tenant_id) + _STAGING
        if names is None:
            names = self.collections.call("listing collections", lambda: [c.name for c in client.list_collections()])
        if staging not in names:
            return False
        self.collections.call("deleting a dead rebuild", lambda: client.delete_collection(name=staging))
        return True

    @serialized
    def rebuild(self, tenant_id: str) -> int:
        """Copy the remaining vectors into a fresh collection: deleted vectors leave the HNSW files."""
        with self.locks.tenant_lock(tenant_id, exclusive=True):
            copied = self.rebuild_under_lock(tenant_id)
            self._clear(tenant_id)
            return copied

    def _clear(self, tenant_id: str) -> int:
        """Clear the unused capacity of the tenant's collection; the caller holds its lock exclusively."""
        return sum(self._clear_unused_capacity(segment) for segment in self.segments(tenant_id))

    def rebuild_under_lock(self, tenant_id: str) -> int:
        """Copy the live vectors, a page at a time, into a new collection that then takes the name;
        the caller holds the tenant's lock exclusively. Returns how many were copied.

        Pages keep memory flat and each get() under SQLite's variable limit (one get() of a tenant
        past ~32,000 vectors fails with "too many SQL variables"). A run that dies midway leaves a
        copy under the staging name, which the next rebuild, erasure or drop removes (_drop_staging)."""
        client = self.collections.client()
        name = collection_name(tenant_id)
        staging = name + _STAGING
        col = self.collections.collection(tenant_id)
        metadata = dict(col.metadata or {})
        metadata[ERASURES] = int(metadata.get(ERASURES, 0)) + 1  # other embedded clients reload
        metadata["hnsw:space"] = SPACE  # a collection made under "cosine" keeps one byte form from here on
        self._drop_staging(tenant_id)
        fresh = self.collections.call(
            "creating the rebuilt collection",
            lambda: client.create_collection(name=staging, metadata=metadata, embedding_function=None),
        )
        copied = 0
        while True:
            started = time.monotonic()
            page = self.collections.call(
                "reading vectors",
                lambda: col.get(include=["embeddings", "metadatas"], limit=_REBUILD_STEP, offset=copied),  # noqa: B023
            )
            if not page["ids"]:
                break
            self.collections.call(
                "restoring vectors",
                lambda: fresh.add(ids=page["ids"], embeddings=page["embeddings"], metadatas=page["metadatas"]),  # noqa: B023
            )
            copied += len(page["ids"])
            # Background work on a shared server: as long idle as busy, so other tenants' queries
            # find it free half the time (the erasure has hours; a recall has milliseconds).
            time.sleep(time.monotonic() - started)
        faults.point("vectors.rebuild.copied")
        self.collections.call("deleting the old collection", lambda: client.delete_collection(name=name))
        faults.point("vectors.rebuild.old_deleted")
        self.collections.call("renaming the rebuilt collection", lambda: fresh.modify(name=name))
        return copied

    def vectors_of(self, tenant_id: str, record_ids: Sequence[str]) -> dict[str, Any]:
        """Stored vectors of the given records; records without one are left out."""
        return self.stored(tenant_id, record_ids) or {}

    @serialized
    def stored(self, tenant_id: str, record_ids: Sequence[str]) -> dict[str, Any] | None:
        """Stored vectors of the given records (those without one left out) from one opening of the
        collection and one get per page; None when the tenant has no collection."""
        with self.locks.tenant_lock(tenant_id, exclusive=False):
            col = self.collections.existing(tenant_id)
            if col is None:
                return None
            if not record_ids:
                return {}
            got = self.collections.call(
                "reading vectors", lambda: read_pages(col, ids=list(record_ids), include=["embeddings"])
            )
        return dict(zip(got["ids"], got["embeddings"], strict=True))

    @serialized
    def delete(self, tenant_id: str, record_ids: Sequence[str]) -> int:
        """Delete vectors through Chroma's API; returns how many were present.

        Chroma only flags them: no query or get returns them again, but their bytes stay in the
        index files until `erase_physically` rewrites the tenant's collection.
        """
        with self.locks.tenant_lock(tenant_id, exclusive=False):
            col, present = self._present(tenant_id, record_ids)
            if not present:
                return 0
            self._delete_in(col, present)
        self.scrub(tenant_id)
        return len(present)

    @serialized
    def discard(self, tenant_id: str, record_ids: Sequence[str]) -> None:
        """`delete` without reading which ids are present first (Chroma ignores absent ones) and
        without a count: one request fewer, for a caller that verifies afterwards."""
        with self.locks.tenant_lock(tenant_id, exclusive=False):
            col = self.collections.existing(tenant_id)
            if col is None or not record_ids:
                return
            self._delete_in(col, record_ids)
        self.scrub(tenant_id)

    def _delete_in(self, col: Any, record_ids: Sequence[str]) -> None:
        """Delete `record_ids` from the opened collection, _DELETE_REQUEST ids a call at most.

        One request of a forget run's 5,000-8,000 ids held other tenants' queries on the shared
        server for up to 2 s on a loaded machine; in requests of 500 their p99 went from 540 to
        131 ms and the deletes took no longer in all (benchmarks/forget_stream.py, docs/performance.md)."""
        step = min(
            _DELETE_REQUEST,
            int(self.collections.call("reading the batch limit", self.collections.client().get_max_batch_size)),
        )
        for start in range(0, len(record_ids), step):
            part = list(record_ids[start : start + step])
            self.collections.call("deleting vectors", lambda: col.delete(ids=part))  # noqa: B023

    def _present(self, tenant_id: str, record_ids: Sequence[str]) -> tuple[Any, list[str]]:
        """The tenant's collection and which of `record_ids` it still holds (none without a collection)."""
        col: Any = self.collections.existing(tenant_id)
        if col is None or not record_ids:
            return col, []
        return col, list(
            self.collections.call("reading ids", lambda: read_pages(col, ids=list(record_ids), include=[])["ids"])
        )

    @serialized
    def erase_physically(self, tenant_id: str) -> tuple[int, list[Path]]:
        """Rewrite the tenant's collection so deleted vectors leave every file; (bytes written, files).

        The remaining vectors are copied into a fresh collection whose unused index capacity is
        then zeroed, the old one's segment files are removed (a server leaves them behind), and the
        SQLite log is vacuumed (its free pages keep deleted rows); then, out of the tenant's lock,
        every other collection's unused capacity is cleared too (_scrub_others). The files returned
        are what a byte scan must read: the tenant's segments and the SQLite database. Without a
        local path (an external server) nothing can be rewritten or scanned here: (0, []).
        """
        if self.path is None:
            return 0, []
        with self.locks.tenant_lock(tenant_id, exclusive=True):
            if self.collections.existing(tenant_id) is not None:
                self.rebuild_under_lock(tenant_id)  # drops a dead rebuild's collection first
            else:
                self._drop_staging(tenant_id)
            # The server wrote the new index's whole capacity from malloc'd memory: clear what no
            # element owns while our writers of the tenant are held off (see clear_unused_capacity).
            self._clear(tenant_id)
            remove_orphan_segments(self.path)
            vacuum_sqlite(self.path / "chroma.sqlite3")
            if self.url is None:
                reopen_embedded()
            files = self.files(tenant_id)
        if self.url is not None and not holds_any():  # waits on others' locks: hold none
            self._scrub_others(tenant_id)
        return sum(f.stat().st_size for f in files if f.exists()), files

    def live_windows(self, tenant_id: str) -> tuple[set[bytes], int]:
        """Windows of vectors still live in the files an erasure scans (the tenant's collection, and
        every vector in the shared SQLite log), and log rows of collections that no longer exist."""
        from memory_pipelines.lib.stores.bytescan import vector_windows, windows_of_raw

        live: set[bytes] = set()
        with self.locks.tenant_lock(tenant_id, exclusive=False):
            col = self.collections.existing(tenant_id)
            if col is not None:
                got = self.collections.call("reading vectors", lambda: read_pages(col, include=["embeddings"]))
                live = {w for vector in got["embeddings"] for w in vector_windows(vector)}
        orphans = 0
        if self.path is not None and (self.path / "chroma.sqlite3").exists():
            with sqlite3.connect(str(self.path / "chroma.sqlite3"), timeout=30) as db:
                for (blob,) in db.execute("SELECT vector FROM embeddings_queue WHERE vector IS NOT NULL"):
                    live |= set(windows_of_raw(blob))
                row = db.execute(
                    "SELECT count(*) FROM embeddings_queue q WHERE NOT EXISTS (SELECT 1 FROM collections c"
                    " WHERE q.topic = 'persistent://default/default/' || c.id)"
                ).fetchone()
                orphans = int(row[0]) if row else 0
        return live, orphans

    def foreign_segments(self, tenant_id: str) -> list[Path]:
        """Segment directories of every other collection: their elements are other tenants' vectors
        (their unused capacity is cleared by `_scrub_others`), so a byte scan of this tenant's erasure
        leaves them out (an identical text elsewhere embeds to an identical vector)."""
        if self.path is None or not (self.path / "chroma.sqlite3").exists():
            return []
        own = collection_name(tenant_id)
        with sqlite3.connect(str(self.path / "chroma.sqlite3"), timeout=30) as db:
            rows = db.execute(
                "SELECT c.name, s.id FROM segments s JOIN collections c ON s.collection = c.id"
            ).fetchall()
        return [self.path / str(s) for name, s in rows if str(name).removesuffix(_STAGING) != own]

    def segments(self, tenant_id: str) -> list[Path]:
        """Directories of the tenant's collection's segments (those a server has written files into)."""
        if self.path is None or not (self.path / "chroma.sqlite3").exists():
            return []
        with sqlite3.connect(str(self.path / "chroma.sqlite3"), timeout=30) as db:
            ids = [
                str(row[0])
                for row in db.execute(
                    "SELECT s.id FROM segments s JOIN collections c ON s.collection = c.id WHERE c.name = ?",
                    (collection_name(tenant_id),),
                )
            ]
        return [self.path / segment for segment in ids if (self.path / segment).is_dir()]

    def files(self, tenant_id: str) -> list[Path]:
        """The files holding the tenant's vectors: its collection's segment directories and SQLite."""
        if self.path is None or not (self.path / "chroma.sqlite3").exists():
            return []
        files = [f for f in self.path.glob("chroma.sqlite3*") if f.is_file()]
        for segment in self.segments(tenant_id):
            files += [f for f in segment.rglob("*") if f.is_file()]
        return files


def remove_orphan_segments(path: Path) -> list[str]:
    """Remove segment directories under a Chroma data `path` that no segment row names any more.

    A Chroma server keeps a deleted collection's HNSW files (measured with chromadb 1.5.9: after
    delete_collection the old directory stays, erased vectors included). Directories are listed
    before the rows are read, so a collection created meanwhile is never taken for an orphan."""
    import shutil
    import uuid

    if not (path / "chroma.sqlite3").exists():
        return []
    candidates = []
    for child in path.iterdir():
        try:
            uuid.UUID(child.name)
        except ValueError:
            continue
        if child.is_dir():
            candidates.append(child)
    if not candidates:
        return []
    with sqlite3.connect(str(path / "chroma.sqlite3"), timeout=30) as db:
        live = {str(row[0]) for row in db.execute("SELECT id FROM segments")}
    removed = []
    for child in candidates:
        if child.name not in live:
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
    return removed


def vacuum_sqlite(path: Path) -> None:
    """Chroma's SQLite keeps deleted rows (and its purged write log, vectors included) in free pages."""
    if not path.exists():
        return
    for attempt in range(5):
        try:
            with sqlite3.connect(str(path), timeout=10) as db:
                db.execute("VACUUM")
            return
        except sqlite3.OperationalError:
            time.sleep(0.2 * (attempt + 1))
    raise ServiceError("chroma", f"could not vacuum {path}: the database stays busy")
