"""The oldest snapshot: a rewrite keeps every deleted row that an open transaction may still see.

VACUUM FULL copies "recently dead" tuples along with live ones: a row deleted after some session
took its snapshot stays in the new file (and in the WAL that logs it) for as long as that snapshot
lives. So before an erasure rewrites anything it marks a transaction id after every deletion it
erases (and after its own key rotation) and waits until no session of the database, prepared
transaction or replication slot holds a snapshot older than it. Then no row it erases is visible to
anyone, and the rewrite drops them all. A snapshot that outlives the wait is named (process id,
application, age; never a query) and the erasure refuses before rewriting, to be tried again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import psycopg

__all__ = [
    "Holder",
    "Horizon",
    "wait_past",
]

# Sessions of this database (or of none: a standby's feedback) whose snapshot or transaction began
# before the mark; age() orders 32-bit xids across wraparound.
_HOLDERS = """
SELECT 'session ' || pid::text, coalesce(nullif(application_name, ''), backend_type, ''),
       coalesce(extract(epoch FROM now() - xact_start), 0)::float8
  FROM pg_catalog.pg_stat_activity
 WHERE pid <> pg_backend_pid() AND (datname = current_database() OR datname IS NULL)
   AND (age(backend_xmin) > age(%(mark)s::xid) OR age(backend_xid) > age(%(mark)s::xid))
UNION ALL
SELECT 'prepared transaction', gid, extract(epoch FROM now() - prepared)::float8
  FROM pg_catalog.pg_prepared_xacts
 WHERE database = current_database() AND age(transaction) > age(%(mark)s::xid)
UNION ALL
SELECT 'replication slot', slot_name::text, 0::float8
  FROM pg_catalog.pg_replication_slots
 WHERE (database = current_database() OR database IS NULL) AND age(xmin) > age(%(mark)s::xid)
 ORDER BY 3 DESC
"""


@dataclass(frozen=True)
class Holder:
    """Something that keeps a snapshot older than the mark: what it is, its name, seconds open."""

    kind: str
    name: str
    seconds: float

    def label(self) -> str:
        return f"{self.kind} ({self.name or 'unnamed'}, open {self.seconds:.0f} s) holds an older snapshot"


@dataclass(frozen=True)
class Horizon:
    """How the wait went: seconds waited, the most holders seen at once, those left at the deadline."""

    waited: float
    held_by: int
    holders: tuple[Holder, ...]

    def report(self) -> dict[str, float | int]:
        return {"waitedSeconds": round(self.waited, 3), "olderSnapshots": self.held_by}


def wait_past(conninfo: str, *, timeout: float, poll: float = 0.1) -> Horizon:
    """Mark a transaction id now and wait up to `timeout` seconds until nothing holds a snapshot
    older than it. `holders` is empty when the wait succeeded."""
    started = time.monotonic()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_xact_id()::xid::text").fetchone()
        assert row is not None
        mark = str(row[0])
        most = 0
        while True:
            holders = tuple(Holder(str(k), str(n), float(s)) for k, n, s in conn.execute(_HOLDERS, {"mark": mark}))
            most = max(most, len(holders))
            if not holders or time.monotonic() - started >= timeout:
                return Horizon(waited=time.monotonic() - started, held_by=most, holders=holders)
            time.sleep(poll)
