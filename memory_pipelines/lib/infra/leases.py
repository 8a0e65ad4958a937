"""A run worker's lease: a session advisory lock on the Dagster instance's database, keyed by the run
id, held by the process that orchestrates the run for as long as it does.

PostgreSQL drops a session's locks when its connection ends, so a worker ended by SIGKILL, the OOM
killer or a lost host loses its lease with it, whichever host it ran on. A run that took its lease
and is still STARTED without one has no worker left: anyone may mark it failed. Over TCP the server
notices a vanished peer through its keepalives (`tcp_keepalives_idle` and friends on the server);
over a Unix socket, at once.

Reading holders goes through `pg_locks` and never takes the lock, so a check cannot delay a worker
taking its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import psycopg

__all__ = [
    "LEASE_CLASS",
    "held",
    "holders",
    "libpq_url",
]

# The two-key form of the advisory locks: a key space apart from the one-key (bigint) locks of
# memories/ordering.py, so a lease never waits on, nor blocks, a tenant's locks.
LEASE_CLASS = 0x6D70_6C65  # "mple"


def libpq_url(sqlalchemy_url: str) -> str:
    """psycopg speaks libpq's URL; SQLAlchemy's names its driver after the scheme."""
    scheme, sep, rest = sqlalchemy_url.partition("://")
    return f"{scheme.split('+', 1)[0]}{sep}{rest}"


@contextmanager
def held(conninfo: str, run_id: str) -> Iterator[None]:
    """The run's lease, on a connection of its own, until the block ends or the process does."""
    with psycopg.connect(conninfo, autocommit=True, application_name="memory-pipelines run lease") as conn:
        conn.execute("SELECT pg_advisory_lock(%s, hashtext(%s))", (LEASE_CLASS, run_id))
        yield


def holders(conninfo: str, run_ids: Iterable[str]) -> set[str]:
    """Those of `run_ids` whose lease some session holds now."""
    wanted = sorted(set(run_ids))
    if not wanted:
        return set()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT r.run_id FROM unnest(%s::text[]) AS r(run_id)"
            " WHERE EXISTS (SELECT 1 FROM pg_locks l"
            "  WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2"
            "  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            "  AND l.classid = %s::int4::oid AND l.objid = hashtext(r.run_id)::oid)",
            (wanted, LEASE_CLASS),
        ).fetchall()
    return {row[0] for row in rows}
