"""Vector index in Chroma: one collection per tenant, embeddings + ids + scope metadata, never documents.

Record id `memory_id:version`. Only current versions are indexed; a superseded version's vector is
removed when its successor is indexed. Works with a Chroma server (`chroma run`) through
HttpClient: by default the one `ensure_services` runs on HOME/chroma, whose files we also know
(`path`) so an erasure can remove their bytes. The embedded PersistentClient (path only) is not
process-safe and stays a library option for unit tests.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from memory_pipelines.lib.infra.errors import MemoryPipelinesError, ServiceError
from memory_pipelines.lib.infra.paths import tenant_hash
from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.memories import ordering
from memory_pipelines.lib.memories.store import CurrentVersion, MemoryStore
from memory_pipelines.lib.stores import lineage
from memory_pipelines.lib.stores.vectors.embedding import Embedder
from memory_pipelines.lib.stores.vectors.hnsw_files import clear_unused_capacity, unused_capacity_holds_data

log = logging.getLogger(__name__)

STORE = "chroma"
EMBED_CHUNK = 512
T = TypeVar("T")

# One embedded client per path for the whole process. Chroma caches a loaded HNSW index per
# client system, and a stale copy held by a second client would write erased vectors back into
# the index files at its next persist (measured: see VectorStore.erase).
_EMBEDDED: dict[str, Any] = {}
_EMBEDDED_LOCK = threading.RLock()
# Collection metadata key counting erasures; another process that loaded the index before an
# erasure sees the count change and reloads from disk (see VectorStore._fresh).
ERASURES = "erasures"
_SEEN: dict[tuple[str, str], int] = {}
_REBUILD_PAGE = 5000  # vectors a get() carries
_REBUILD_STEP = 500  # vectors a rebuild copies at a time: short bursts on the server
_STAGING = "-rebuild"  # suffix of the collection a rebuild fills before it takes the tenant's name
_SWEEP_WAIT = 5.0  # seconds an erasure's sweep waits for another tenant's collection lock
_QUERY_BATCH = 256  # query vectors in one Chroma call (a server refuses ~10,000: "Payload too large")
# Tenant collection locks this thread holds (see VectorStore._tenant_lock): taken once per thread.
_HELD = threading.local()


def _embedded_client(path: Path) -> Any:
    with _EMBEDDED_LOCK:
        key = str(path.resolve())
        if key not in _EMBEDDED:
            import chromadb
            from chromadb.config import Settings as ChromaSettings

            path.mkdir(parents=True, exist_ok=True)
            _EMBEDDED[key] = chromadb.PersistentClient(path=key, settings=ChromaSettings(anonymized_telemetry=False))
        return _EMBEDDED[key]


F = TypeVar("F", bound=Callable[..., Any])


def _serialized(method: F) -> F:
    """Embedded Chroma: one operation at a time per process, so an erasure's reload of the index
    never races another thread holding a collection of the old one. A server needs no such lock."""

    @functools.wraps(method)
    def wrapper(self: VectorStore, *args: Any, **kwargs: Any) -> Any:
        if self.url is not None:
            return method(self, *args, **kwargs)
        with _EMBEDDED_LOCK:
            return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _reopen_embedded() -> None:
    """Drop every loaded index in this process; the next call loads them from disk afresh."""
    from chromadb.api.shared_system_client import SharedSystemClient

    with _EMBEDDED_LOCK:
        for client in _EMBEDDED.values():
            # Stop the old system so no stale index survives in memory (clearing the cache alone
            # leaves it running for whoever still holds one of its collections).
            try:
                client._system.stop()
            except Exception:  # a system that cannot stop is being dropped anyway
                pass
        SharedSystemClient.clear_system_cache()
        _EMBEDDED.clear()
        _SEEN.clear()


def collection_name(tenant_id: str) -> str:
    # Chroma names allow fewer characters than tenant ids; a digest is always valid and stable
    # (the same one names the tenant's analytics directory).
    return "mem-" + tenant_hash(tenant_id)


def read_pages(col: Any, *, include: list[str], ids: Sequence[str] | None = None) -> dict[str, list[Any]]:
    """`col.get` in pages of _REBUILD_PAGE: one get() past ~32,000 vectors (or ids) fails in Chroma
    with "too many SQL variables". Returns ids and the included fields, concatenated."""
    out: dict[str, list[Any]] = {"ids": [], **{field: [] for field in include}}
    offset = 0
    while True:
        if ids is not None:
            part = list(ids[offset : offset + _REBUILD_PAGE])
            if not part:
                break
            page = col.get(ids=part, include=include)
        else:
            page = col.get(include=include, limit=_REBUILD_PAGE, offset=offset)
            if not page["ids"]:
                break
        out["ids"] += list(page["ids"])
        for field in include:
            out[field] += list(page[field] if page[field] is not None else [])
        offset += _REBUILD_PAGE
    return out


def _source(record_id: str) -> tuple[str, int]:
    memory_id, _, version = record_id.rpartition(":")
    return memory_id, int(version)


def metadata_of(cv: CurrentVersion) -> dict[str, Any]:
    return {
        "memory_id": cv.memory_id,
        "version": cv.version,
        "user_id": cv.user_id,
        "team_id": cv.team_id or "",
        "shareable": cv.shareable,
        "category": cv.category,
        "epoch": cv.epoch,
    }


class VectorStore:
    """Tenant collections in Chroma, synced from the memory store with lineage.

    `url` alone: a Chroma server whose files are not ours. `url` and `path`: a server keeping its
    files in `path` (ours, under HOME), so erasures also clear them. `path` alone: the embedded
    PersistentClient (one process only; unit tests)."""

    def __init__(self, *, embedder: Embedder, path: Path | None = None, url: str | None = None) -> None:
        if path is None and url is None:
            raise ValueError("give url (Chroma server, with path when its files are local) or path (embedded)")
        self.embedder = embedder
        self.path = path
        self.url = url
        self._client: Any = None
        self._lock = threading.Lock()

    @property
    def location(self) -> str:
        return self.url or str(self.path)

    @property
    def embedded(self) -> bool:
        return self.url is None

    @contextmanager
    def _tenant_lock(self, tenant_id: str, *, exclusive: bool) -> Iterator[None]:
        """Across processes, for a server whose files are ours (url and path): an erasure rebuilds
        the tenant's collection (a new one under the same name) exclusively, while writes and
        reads of it share the lock, so none writes into or reads the collection being replaced.

        Always taken last, after any PostgreSQL lock, and never held while waiting for one.
        Reentrant per thread. Without a local path (an external server, maybe shared by many
        machines) there is no lock: writes still reopen the collection by name first (_current),
        but an erasure there can race another process's sync or query."""
        with self._collection_lock(collection_name(tenant_id), exclusive=exclusive):
            yield

    @contextmanager
    def _collection_lock(self, name: str, *, exclusive: bool, timeout: float | None = None) -> Iterator[bool]:
        """The lock of collection `name` (see _tenant_lock); yields whether it is held: always
        without `timeout`, else False when another process kept it for `timeout` seconds."""
        if self.url is None or self.path is None:
            yield True
            return
        held: set[str] = getattr(_HELD, "names", None) or set()
        _HELD.names = held
        key = f"{self.path}|{name}"
        if key in held:
            yield True
            return
        lock_dir = self.path / ".locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        with open(lock_dir / f"{name}.lock", "a+") as fh:
            mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            if timeout is None:
                fcntl.flock(fh.fileno(), mode)
            else:
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        fcntl.flock(fh.fileno(), mode | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            yield False
                            return
                        time.sleep(0.05)
            held.add(key)
            try:
                yield True
            finally:
                held.discard(key)
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    def _holds(self, tenant_id: str) -> bool:
        return f"{self.path}|{collection_name(tenant_id)}" in (getattr(_HELD, "names", None) or set())

    def scrub(self, tenant_id: str) -> int:
        """Clear the unused index capacity of the tenant's collection when any holds data; bytes zeroed.

        Runs after our writes: the first write to a collection (and the first after a server
        restart, to one never persisted) makes the server write its files from malloc'd memory,
        which may hold any tenant's vectors, forgotten ones included (see clear_unused_capacity).
        The check reads a few headers; only a collection with such bytes takes the tenant's lock
        exclusively, for milliseconds. A thread already holding the lock (shared, maybe) skips."""
        if self.path is None or self._holds(tenant_id):
            return 0
        if not any(unused_capacity_holds_data(segment) for segment in self.segments(tenant_id)):
            return 0
        zeroed = 0
        with self._tenant_lock(tenant_id, exclusive=True):
            for segment in self.segments(tenant_id):
                try:
                    zeroed += clear_unused_capacity(segment)
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
            with self._collection_lock(base, exclusive=True, timeout=_SWEEP_WAIT) as locked:
                if not locked:
                    busy.append(str(name))
                    continue
                try:
                    clear_unused_capacity(segment)
                except ServiceError as exc:  # another tenant's index: reported, never this erasure's failure
                    log.warning("could not clear unused capacity of %s: %s", segment, exc)
                    busy.append(str(name))
        if busy:
            log.warning("unused index capacity left to clear in %d busy collection(s): %s", len(busy), busy[:5])
        return busy

    def _current(self, tenant_id: str, col: Any) -> Any:
        """A server's collection as it is now (an erasure elsewhere may have replaced the one we hold)."""
        if self.url is None:
            return col
        client = self.client()
        return self._call("opening the collection", lambda: client.get_collection(name=collection_name(tenant_id)))

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except MemoryPipelinesError:
            raise
        except Exception as exc:  # chromadb raises many types; all mean the vector store failed us
            raise ServiceError("chroma", f"{what} failed against {self.location}: {type(exc).__name__}: {exc}") from exc

    def client(self) -> Any:
        if self.url is None:
            assert self.path is not None
            return _embedded_client(self.path)
        with self._lock:
            if self._client is None:
                import chromadb
                from chromadb.config import Settings as ChromaSettings

                from memory_pipelines.lib.infra.services import chroma_headers

                assert self.url is not None
                parts = urlsplit(self.url)
                # The token of HOME's own server (its proxy refuses requests without it), or
                # MEMORY_PIPELINES_CHROMA_TOKEN for an external one.
                headers = chroma_headers(self.url)
                self._client = self._call(
                    "connecting",
                    lambda: chromadb.HttpClient(
                        host=parts.hostname or "localhost",
                        port=parts.port or (443 if parts.scheme == "https" else 8000),
                        ssl=parts.scheme == "https",
                        headers=headers,
                        settings=ChromaSettings(anonymized_telemetry=False),
                    ),
                )
            return self._client

    @_serialized
    def collection(self, tenant_id: str) -> Any:
        def open_it() -> Any:
            client = self.client()
            return self._call(
                "opening the collection",
                lambda: client.get_or_create_collection(
                    name=collection_name(tenant_id),
                    metadata={"tenant_id": tenant_id, "hnsw:space": "cosine", "embedding_model": self.embedder.name},
                    embedding_function=None,
                ),
            )

        return self._fresh(open_it)

    def _fresh(self, open_it: Callable[[], Any]) -> Any:
        """The collection, reloaded from disk first if another process erased vectors since we loaded it."""
        col = open_it()
        if self.url is not None or self.path is None or col is None:
            return col
        key = (str(self.path.resolve()), col.name)
        generation = int((col.metadata or {}).get(ERASURES, 0))
        with _EMBEDDED_LOCK:
            seen = _SEEN.setdefault(key, generation)
            if seen == generation:
                return col
            _reopen_embedded()
            _SEEN[key] = generation
        return open_it()

    @_serialized
    def reset(self, *, store: MemoryStore, tenant_id: str) -> None:
        """Drop the tenant's collection and its lineage; the next sync re-embeds everything."""
        client = self.client()
        name = collection_name(tenant_id)
        with self._tenant_lock(tenant_id, exclusive=True):
            existing = self._call("listing collections", lambda: [c.name for c in client.list_collections()])
            if name in existing:
                self._call("deleting the collection", lambda: client.delete_collection(name=name))
        with store.transaction() as conn:
            conn.execute("DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s", (tenant_id, STORE))

    @_serialized
    def existing(self, tenant_id: str) -> Any | None:
        """The tenant's collection if it exists; reads must never create one (a forgotten tenant stays gone)."""
        name = collection_name(tenant_id)

        def open_it() -> Any:
            from chromadb.errors import NotFoundError as CollectionMissing

            client = self.client()
            # One call: listing collections first cost 0.1 s a read on a server holding many tenants.
            try:
                return self._call("opening the collection", lambda: client.get_collection(name=name))
            except ServiceError as exc:
                if isinstance(exc.__cause__, CollectionMissing):
                    return None
                raise

        return self._fresh(open_it)

    @_serialized
    def drop(self, tenant_id: str) -> bool:
        """Delete the tenant's collection (its files go with it); True when one existed."""
        client = self.client()
        name = collection_name(tenant_id)
        with self._tenant_lock(tenant_id, exclusive=True):
            existing = self._call("listing collections", lambda: [c.name for c in client.list_collections()])
            if name not in existing:
                return False
            self._call("deleting the collection", lambda: client.delete_collection(name=name))
            if self.url is not None and self.path is not None:
                remove_orphan_segments(self.path)  # a server leaves the deleted collection's files
        return True

    @_serialized
    def rebuild(self, tenant_id: str) -> int:
        """Copy the remaining vectors into a fresh collection: deleted vectors leave the HNSW files."""
        with self._tenant_lock(tenant_id, exclusive=True):
            copied = self._rebuild(tenant_id)
            self._clear(tenant_id)
            return copied

    def _clear(self, tenant_id: str) -> int:
        """Clear the unused capacity of the tenant's collection; the caller holds its lock exclusively."""
        return sum(clear_unused_capacity(segment) for segment in self.segments(tenant_id))

    def _rebuild(self, tenant_id: str) -> int:
        """Copy the live vectors, a page at a time, into a new collection that then takes the name.

        Pages keep memory flat and each get() under SQLite's variable limit (one get() of a tenant
        past ~32,000 vectors fails with "too many SQL variables"). A run that dies midway leaves the
        old collection whole and a partial copy, which the next rebuild drops first."""
        client = self.client()
        name = collection_name(tenant_id)
        staging = name + _STAGING
        col = self.collection(tenant_id)
        metadata = dict(col.metadata or {})
        metadata[ERASURES] = int(metadata.get(ERASURES, 0)) + 1  # other embedded clients reload
        names = self._call("listing collections", lambda: [c.name for c in client.list_collections()])
        if staging in names:
            self._call("deleting a partial rebuild", lambda: client.delete_collection(name=staging))
        fresh = self._call(
            "creating the rebuilt collection",
            lambda: client.create_collection(name=staging, metadata=metadata, embedding_function=None),
        )
        copied = 0
        while True:
            started = time.monotonic()
            page = self._call(
                "reading vectors",
                lambda: col.get(include=["embeddings", "metadatas"], limit=_REBUILD_STEP, offset=copied),  # noqa: B023
            )
            if not page["ids"]:
                break
            self._call(
                "restoring vectors",
                lambda: fresh.add(ids=page["ids"], embeddings=page["embeddings"], metadatas=page["metadatas"]),  # noqa: B023
            )
            copied += len(page["ids"])
            # Background work on a shared server: as long idle as busy, so other tenants' queries
            # find it free half the time (the erasure has hours; a recall has milliseconds).
            time.sleep(time.monotonic() - started)
        self._call("deleting the old collection", lambda: client.delete_collection(name=name))
        self._call("renaming the rebuilt collection", lambda: fresh.modify(name=name))
        return copied

    @_serialized
    def vectors_of(self, tenant_id: str, record_ids: Sequence[str]) -> dict[str, Any]:
        """Stored vectors of the given records; records without one are left out."""
        with self._tenant_lock(tenant_id, exclusive=False):
            col = self.existing(tenant_id)
            if col is None or not record_ids:
                return {}
            got = self._call("reading vectors", lambda: read_pages(col, ids=list(record_ids), include=["embeddings"]))
        return dict(zip(got["ids"], got["embeddings"], strict=True))

    @_serialized
    def delete(self, tenant_id: str, record_ids: Sequence[str]) -> int:
        """Delete vectors through Chroma's API; returns how many were present.

        Chroma only flags them: no query or get returns them again, but their bytes stay in the
        index files until `erase_physically` rewrites the tenant's collection.
        """
        with self._tenant_lock(tenant_id, exclusive=False):
            col, present = self._present(tenant_id, record_ids)
            if not present:
                return 0
            step = int(self._call("reading the batch limit", self.client().get_max_batch_size))
            for start in range(0, len(present), step):
                part = present[start : start + step]
                self._call("deleting vectors", lambda: col.delete(ids=part))  # noqa: B023
        self.scrub(tenant_id)
        return len(present)

    @_serialized
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
        with self._tenant_lock(tenant_id, exclusive=True):
            if self.existing(tenant_id) is not None:
                self._rebuild(tenant_id)
            # The server wrote the new index's whole capacity from malloc'd memory: clear what no
            # element owns while our writers of the tenant are held off (see clear_unused_capacity).
            self._clear(tenant_id)
            remove_orphan_segments(self.path)
            vacuum_sqlite(self.path / "chroma.sqlite3")
            if self.url is None:
                _reopen_embedded()
            files = self.files(tenant_id)
        if self.url is not None and not getattr(_HELD, "names", None):  # waits on others' locks: hold none
            self._scrub_others(tenant_id)
        return sum(f.stat().st_size for f in files if f.exists()), files

    def live_windows(self, tenant_id: str) -> tuple[set[bytes], int]:
        """Windows of vectors still live in the files an erasure scans (the tenant's collection, and
        every vector in the shared SQLite log), and log rows of collections that no longer exist."""
        from memory_pipelines.lib.stores.bytescan import vector_windows, windows_of_raw

        live: set[bytes] = set()
        with self._tenant_lock(tenant_id, exclusive=False):
            col = self.existing(tenant_id)
            if col is not None:
                got = self._call("reading vectors", lambda: read_pages(col, include=["embeddings"]))
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

    def _present(self, tenant_id: str, record_ids: Sequence[str]) -> tuple[Any, list[str]]:
        """The tenant's collection and which of `record_ids` it still holds (none without a collection)."""
        col: Any = self.existing(tenant_id)
        if col is None or not record_ids:
            return col, []
        return col, list(self._call("reading ids", lambda: read_pages(col, ids=list(record_ids), include=[])["ids"]))

    @_serialized
    def ids(self, tenant_id: str) -> set[str]:
        with self._tenant_lock(tenant_id, exclusive=False):
            col = self.collection(tenant_id)
            return set(self._call("listing ids", lambda: read_pages(col, include=[])["ids"]))

    @_serialized
    def sync(self, *, store: MemoryStore, tenant_id: str, progress: Progress = no_progress) -> dict[str, int]:
        """Embed current versions that are missing, remove vectors of versions no longer current;
        `progress` hears of every embedded batch (versions done of those to embed)."""
        current = {cv.record_id: cv for cv in store.current_versions(tenant_id=tenant_id)}
        col = self.collection(tenant_id)
        if (col.metadata or {}).get("embedding_model") != self.embedder.name:
            # Vectors of two models are not comparable: a model change re-embeds the tenant.
            self.reset(store=store, tenant_id=tenant_id)
            col = self.collection(tenant_id)
        existing = self.ids(tenant_id)
        stale = sorted(existing - set(current))
        new = [cv for record_id, cv in current.items() if record_id not in existing]
        # Sequential on purpose: overlapping upserts with embedding made both slower on 2 cores
        # (ONNX already uses every core); measured with benchmarks/ingest.py.
        for start in range(0, len(new), EMBED_CHUNK):
            # A version deleted (or its key shredded) since we listed it is simply not embedded.
            texts = store.open_texts(
                tenant_id=tenant_id,
                sources=[cv.source for cv in new[start : start + EMBED_CHUNK]],
                skip_unreadable=True,
            )
            chunk = [cv for cv in new[start : start + EMBED_CHUNK] if cv.source in texts]
            if not chunk:
                continue
            vectors = self.embedder.embed([texts[cv.source] for cv in chunk])
            del texts
            self._write_chunk(store, tenant_id, col, chunk, vectors)
            self.scrub(tenant_id)
            progress(min(start + EMBED_CHUNK, len(new)), len(new), "embeddings")
        removed = 0
        if stale:
            with store.transaction() as conn:
                # A version whose deletion was accepted is the forget cascade's to erase physically:
                # a plain delete here would only flag it and drop the lineage the cascade follows.
                hidden = ordering.guard_build(
                    conn, tenant_id, [_source(record_id) for record_id in stale], missing_is_hidden=False
                )
                removable = [record_id for record_id in stale if _source(record_id) not in hidden]
                if removable:
                    with self._tenant_lock(tenant_id, exclusive=False):
                        live = self._current(tenant_id, col)
                        self._call("deleting vectors", lambda: live.delete(ids=removable))
                    lineage.remove_records(conn, tenant_id=tenant_id, store=STORE, record_ids=removable)
                removed = len(removable)
            self.scrub(tenant_id)
        return {"records": len(current), "embedded": len(new), "removed": removed}

    def _write_chunk(
        self, store: MemoryStore, tenant_id: str, col: Any, chunk: list[CurrentVersion], vectors: Any
    ) -> None:
        """Lineage, then the vectors, each committed under the gate lock with a fresh check of the sources.

        Lineage first: a vector is never in Chroma without its edge (a crash leaves an edge without
        a vector, which the next sync fills). The upsert happens while the lock is held, so a
        deletion accepted after our check waits for it, and its cascade finds the vector.
        """
        import numpy as np

        vectors = np.asarray(vectors)
        sources = [(cv.memory_id, cv.version, cv.epoch) for cv in chunk]
        with store.transaction() as conn:
            hidden = ordering.guard_build(conn, tenant_id, sources)
            lineage.insert_edges(
                conn,
                tenant_id=tenant_id,
                store=STORE,
                records=[(cv.record_id, cv.source) for cv in chunk if cv.source not in hidden],
            )
        with store.transaction() as conn:
            hidden |= ordering.guard_build(conn, tenant_id, sources)
            keep = [n for n, cv in enumerate(chunk) if cv.source not in hidden]
            if not keep:
                return
            with self._tenant_lock(tenant_id, exclusive=False):
                live = self._current(tenant_id, col)
                self._call(
                    "upserting vectors",
                    lambda: live.upsert(
                        ids=[chunk[n].record_id for n in keep],
                        embeddings=vectors[keep] if len(keep) < len(chunk) else vectors,
                        metadatas=[metadata_of(chunk[n]) for n in keep],
                    ),
                )

    def query(
        self, *, tenant_id: str, text: str, limit: int, where: dict[str, Any] | None
    ) -> list[tuple[tuple[str, int], float]]:
        """(memory_id, version) and cosine similarity of the nearest vectors, best first."""
        if self.existing(tenant_id) is None:
            return []
        vector = self.embedder.embed([text])
        with self._tenant_lock(tenant_id, exclusive=False):
            col = self.existing(tenant_id)
            if col is None:
                return []
            count = self._call("counting", col.count)
            if count == 0:
                return []
            result = self._call(
                "querying",
                lambda: col.query(
                    query_embeddings=vector,
                    n_results=min(limit, count),
                    where=where,
                    include=["metadatas", "distances"],
                ),
            )
        out = []
        for meta, distance in zip(result["metadatas"][0], result["distances"][0], strict=True):
            if not meta:
                continue  # a record caught mid-write or mid-erasure by another process: not an answer
            out.append(((str(meta["memory_id"]), int(meta["version"])), 1.0 - float(distance)))
        return out

    def nearest(
        self, *, tenant_id: str, vector: Any, limit: int, where: dict[str, Any] | None = None
    ) -> list[tuple[tuple[str, int], float]]:
        """Like `query`, for a query vector embedded already (recall may ask twice: it embeds once);
        ids and distances only, every hit is confirmed by the memory store anyway. No count first:
        Chroma 1.x answers a limit above it with what there is, and counting 100,000 took 18 ms."""
        with self._tenant_lock(tenant_id, exclusive=False):
            col = self.existing(tenant_id)
            if col is None:
                return []
            result = self._call(
                "querying",
                lambda: col.query(query_embeddings=[vector], n_results=limit, where=where, include=["distances"]),
            )
        return [(_source(i), 1.0 - float(d)) for i, d in zip(result["ids"][0], result["distances"][0], strict=True)]

    @_serialized
    def query_many(self, *, tenant_id: str, texts: list[str], limit: int) -> list[list[tuple[str, int]]]:
        """Nearest (memory_id, version) for many texts: one embedding batch, one Chroma call."""
        if not texts or self.existing(tenant_id) is None:
            return [[] for _ in texts]
        return self.query_vectors(tenant_id=tenant_id, vectors=list(self.embedder.embed(texts)), limit=limit)

    @_serialized
    def query_vectors(self, *, tenant_id: str, vectors: list[Any], limit: int) -> list[list[tuple[str, int]]]:
        """Nearest (memory_id, version) for query vectors already computed, a few hundred a Chroma call."""
        with self._tenant_lock(tenant_id, exclusive=False):
            col = self.existing(tenant_id)
            if col is None or not vectors:
                return [[] for _ in vectors]
            count = self._call("counting", col.count)
            if count == 0:
                return [[] for _ in vectors]
            found: list[list[tuple[str, int]]] = []
            for start in range(0, len(vectors), _QUERY_BATCH):
                part = vectors[start : start + _QUERY_BATCH]
                result = self._call(
                    "querying",
                    lambda: col.query(query_embeddings=part, n_results=min(limit, count), include=[]),  # noqa: B023
                )
                found += [[_source(record_id) for record_id in ids] for ids in result["ids"]]
        return found

    @_serialized
    def check(self, *, store: MemoryStore, tenant_id: str) -> dict[str, int]:
        """Counts that must be zero: documents stored, vectors without lineage, vectors not current."""
        with self._tenant_lock(tenant_id, exclusive=False):
            col = self.collection(tenant_id)
            got = self._call("reading", lambda: read_pages(col, include=["documents"]))
        ids = set(got["ids"])
        documents = sum(1 for doc in (got.get("documents") or []) if doc)
        current = {cv.record_id for cv in store.current_versions(tenant_id=tenant_id)}
        with store.transaction() as conn:
            edges = lineage.records_of_store(conn, tenant_id=tenant_id, store=STORE)
            # Vectors of accepted deletions wait for their cascade, which erases them physically.
            pending = ordering.hidden_sources(
                conn, tenant_id, [_source(i) for i in ids - current], missing_is_hidden=False
            )
        return {
            "records": len(ids),
            "documents": documents,
            "without_lineage": len(ids - set(edges)),
            "not_current": len({i for i in ids - current if _source(i) not in pending}),
        }


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
