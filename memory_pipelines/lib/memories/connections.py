"""The memory store's connections: a pool of idle connections shared by the store's threads, and
`transaction()`, which runs one transaction on a pooled connection (nested calls in a thread join it
as a savepoint). Every other part of the store holds one `Connections` and works through `transaction()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from memory_pipelines.lib.infra.errors import ServiceError

__all__ = [
    "IDLE_PING_SECONDS",
    "POOL_IDLE",
    "Connections",
]

# Idle connections a store keeps for its threads; more threads open more, closed when given back.
POOL_IDLE = 8
# A connection idle this long gets one cheap ping before use: the server may have dropped it.
IDLE_PING_SECONDS = 1.0


class Connections:
    """The store's connection pool and transactions, shared by every other part of `MemoryStore`."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self._idle: list[tuple[psycopg.Connection, float]] = []  # (connection, when it was given back)
        self._idle_lock = threading.Lock()
        self._local = threading.local()

    def connect(self) -> psycopg.Connection:
        """A new connection of its own, outside the pool (the caller closes it)."""
        try:
            conn = psycopg.connect(self.conninfo, autocommit=True)
            # Per-tenant partitions (lib/memories/table_partitions.py): a custom plan prunes to one tenant's partition
            # at plan time, while a generic plan (psycopg's prepared statements after 5 runs, and the
            # foreign keys' and plpgsql's cached plans, which psycopg's prepare_threshold never reaches)
            # locks every tenant's partition at executor start and so waits for any tenant's compaction.
            conn.execute("SET plan_cache_mode = force_custom_plan")
            return conn
        except psycopg.OperationalError as exc:
            raise ServiceError("postgres", f"cannot connect to the memory database: {exc}") from exc

    def _take(self) -> psycopg.Connection:
        """An idle connection that still answers, or a new one."""
        while True:
            with self._idle_lock:
                if not self._idle:
                    break
                conn, since = self._idle.pop()
            if conn.closed or conn.broken:
                continue
            if time.monotonic() - since < IDLE_PING_SECONDS:
                return conn
            try:
                conn.execute("SELECT 1")
                return conn
            except psycopg.Error:
                conn.close()
        return self.connect()

    def _give_back(self, conn: psycopg.Connection) -> None:
        if conn.closed or conn.broken or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            conn.close()
            return
        with self._idle_lock:
            if len(self._idle) < POOL_IDLE:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()

    @contextmanager
    def transaction(self) -> Iterator[psycopg.Connection]:
        """One transaction on a connection of the store's pool; threads work in parallel, each on its own.

        Nested in the same thread (a transaction opened while one is open), it joins the open one as
        a savepoint: a second connection could wait on locks the first holds."""
        held: psycopg.Connection | None = getattr(self._local, "conn", None)
        if held is not None:
            with held.transaction():
                yield held
            return
        conn = self._take()
        self._local.conn = conn
        try:
            with conn.transaction():
                yield conn
        except psycopg.OperationalError as exc:
            conn.close()
            self.close()  # a server restart or terminated backends: the idle ones are gone too
            raise ServiceError("postgres", f"lost the connection to the memory database: {exc}") from exc
        finally:
            self._local.conn = None
            self._give_back(conn)

    def close(self) -> None:
        """Close the idle connections; the store stays usable (it opens new ones when asked)."""
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()
