"""Delivering the outbox: each notice once per channel, claimed before it is sent, recorded after.

The claim commits `attempts + 1` and a lease (`next_attempt_at` moved past the send) before a byte
leaves, so concurrent deliverers (a sensor's run, the CLI, a demo) never send one notice at the
same time, and a process killed between sending and recording leaves a claim that expires: the
notice goes out once more, with the same idempotency key, and the recipient drops it. A failed
send records its error (never content: a notice holds none) and waits, doubling, before the next.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import psycopg
from psycopg.rows import dict_row

from memory_pipelines.lib.infra import faults
from memory_pipelines.lib.notify.channels import Channel
from memory_pipelines.lib.notify.notice import notice_of

__all__ = [
    "BATCH",
    "LEASE_SECONDS",
    "Transactional",
    "backoff",
    "deliver",
    "due",
    "notifications",
]

# A claimed notice is not tried again by anyone for this long: longer than any one send (an SMTP send is
# at most 8 steps of 15 s each, channels.TIMEOUT_SECONDS).
LEASE_SECONDS = 300
BACKOFF_FIRST_SECONDS = 30
BACKOFF_MAX_SECONDS = 3600
BATCH = 100
# A channel's first delivery also sends the notices queued this long before it was configured.
BACKLOG_SECONDS = 86400


class Transactional(Protocol):
    def transaction(self) -> AbstractContextManager[psycopg.Connection]: ...


def backoff(attempts: int) -> timedelta:
    """Wait after the `attempts`-th failed try: 30 s, 1 min, 2 min, ... at most an hour."""
    return timedelta(seconds=min(BACKOFF_FIRST_SECONDS * 2 ** max(attempts - 1, 0), BACKOFF_MAX_SECONDS))


def deliver(
    *, db: Transactional, channels: list[Channel], events: tuple[str, ...], now: datetime | None = None
) -> dict[str, Any]:
    """Send every due notice on every channel once; what was delivered, what failed, what is left.

    `now` is the time this call starts at (tests move it); each row's claim, lease and retry time
    count from it plus the time this call has taken so far."""
    started, began = now or datetime.now(UTC), time.monotonic()

    def clock() -> datetime:
        return started + timedelta(seconds=time.monotonic() - began)

    by_name = {channel.name: channel for channel in channels}
    delivered: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    for row in _due_rows(db, list(by_name), events, started):
        attempt = _claim(db, row, clock())
        if attempt is None:
            continue  # another deliverer claimed it since the read, or it was delivered
        notice = notice_of(row)
        entry = {
            "channel": row["channel"],
            "job_id": row["job_id"],
            "event": row["kind"],
            "idempotency_key": notice.idempotency_key,
            "attempt": attempt,
        }
        try:
            by_name[row["channel"]].send(notice=notice)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
            retry = clock() + backoff(attempt)
            _record_failure(db, row, attempt, error, retry)
            failed.append({**entry, "error": error, "next_attempt_at": retry.isoformat()})
            continue
        faults.point("notify.sent")
        _record_delivery(db, row, list(by_name), clock())
        delivered.append(entry)
    with db.transaction() as conn:
        pending = _count_pending(conn, list(by_name))
    return {"channels": list(by_name), "delivered": delivered, "failed": failed, "pending": pending}


def due(*, db: Transactional, channels: list[Channel], events: tuple[str, ...], now: datetime | None = None) -> int:
    """How many (notice, channel) deliveries `deliver` would try now."""
    now = now or datetime.now(UTC)
    names = [channel.name for channel in channels]
    with db.transaction() as conn:
        _register(conn, names, now)
        row = conn.execute(
            "SELECT count(*) FROM control.outbox o CROSS JOIN unnest(%s::text[]) AS c(channel)"
            " JOIN control.notify_channels n ON n.channel = c.channel AND o.created_at >= n.since"
            " LEFT JOIN control.outbox_deliveries d ON d.seq = o.seq AND d.channel = c.channel"
            " WHERE o.kind = ANY(%s)"
            " AND (d.seq IS NULL OR (d.delivered_at IS NULL AND d.next_attempt_at <= %s))",
            (names, list(events), now),
        ).fetchone()
    return int(row[0]) if row else 0


def _register(conn: psycopg.Connection, names: list[str], now: datetime) -> None:
    # A channel configured today is sent the last day and what comes next, not the whole history.
    conn.execute(
        "INSERT INTO control.notify_channels (channel, since) SELECT c, %s FROM unnest(%s::text[]) AS c"
        " ON CONFLICT (channel) DO NOTHING",
        (now - timedelta(seconds=BACKLOG_SECONDS), names),
    )


def _due_rows(db: Transactional, names: list[str], events: tuple[str, ...], now: datetime) -> list[dict[str, Any]]:
    """Each channel's undelivered notices whose time has come (a delivery row made for a new one)."""
    with db.transaction() as conn:
        _register(conn, names, now)
        # Per channel: a channel added later gets its own rows, whatever the others delivered.
        conn.execute(
            "INSERT INTO control.outbox_deliveries (seq, channel, next_attempt_at)"
            " SELECT o.seq, c.channel, o.created_at FROM control.outbox o"
            " JOIN control.notify_channels c ON o.created_at >= c.since"
            " WHERE c.channel = ANY(%s) AND o.kind = ANY(%s)"
            " ON CONFLICT (seq, channel) DO NOTHING",
            (names, list(events)),
        )
        with conn.cursor(row_factory=dict_row) as cur:
            return cur.execute(
                "SELECT d.seq, d.channel, d.attempts, o.job_id, o.tenant_id, o.kind, o.payload,"
                " j.scope AS job_scope, j.created_at AS job_created_at, j.completed_at AS job_completed_at,"
                " j.erased_at AS job_erased_at"
                " FROM control.outbox_deliveries d JOIN control.outbox o ON o.seq = d.seq"
                " LEFT JOIN control.deletion_jobs j ON j.job_id = o.job_id"
                " WHERE d.delivered_at IS NULL AND d.channel = ANY(%s) AND o.kind = ANY(%s)"
                " AND d.next_attempt_at <= %s ORDER BY d.seq, d.channel LIMIT %s",
                (names, list(events), now, BATCH),
            ).fetchall()


def _claim(db: Transactional, row: dict[str, Any], now: datetime) -> int | None:
    """Take one delivery for a lease just before sending it: its attempt number, or None when another
    deliverer holds it or it is done. One row at a time, so a slow server never outlives a claim."""
    with db.transaction() as conn:
        claimed = conn.execute(
            "UPDATE control.outbox_deliveries SET attempts = attempts + 1, next_attempt_at = %s"
            " WHERE seq = %s AND channel = %s AND delivered_at IS NULL AND next_attempt_at <= %s"
            " RETURNING attempts",
            (now + timedelta(seconds=LEASE_SECONDS), row["seq"], row["channel"], now),
        ).fetchone()
    return None if claimed is None else int(claimed[0])


def _record_failure(db: Transactional, row: dict[str, Any], attempt: int, error: str, retry: datetime) -> None:
    with db.transaction() as conn:
        conn.execute(
            "UPDATE control.outbox_deliveries SET last_error = %s, next_attempt_at = %s"
            " WHERE seq = %s AND channel = %s AND delivered_at IS NULL AND attempts = %s",
            (error, retry, row["seq"], row["channel"], attempt),
        )


def _record_delivery(db: Transactional, row: dict[str, Any], names: list[str], now: datetime) -> None:
    with db.transaction() as conn:
        # Recorded whoever holds the claim now: the notice did leave (under the same key either way).
        conn.execute(
            "UPDATE control.outbox_deliveries SET delivered_at = %s, last_error = NULL"
            " WHERE seq = %s AND channel = %s AND delivered_at IS NULL",
            (now, row["seq"], row["channel"]),
        )
        conn.execute(
            "UPDATE control.outbox o SET delivered_at = %s WHERE o.seq = %s AND o.delivered_at IS NULL"
            " AND NOT EXISTS (SELECT 1 FROM control.outbox_deliveries d"
            " WHERE d.seq = o.seq AND d.channel = ANY(%s) AND d.delivered_at IS NULL)",
            (now, row["seq"], names),
        )


def _count_pending(conn: psycopg.Connection, names: list[str]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM control.outbox_deliveries WHERE delivered_at IS NULL AND channel = ANY(%s)", (names,)
    ).fetchone()
    return int(row[0]) if row else 0


def notifications(db: Transactional, *, job_id: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """The newest notices (or one job's) with each channel's delivery state: ids, times, errors."""
    with db.transaction() as conn, conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            "SELECT o.seq, o.job_id, o.tenant_id, o.kind, o.created_at, o.delivered_at,"
            " coalesce(jsonb_agg(jsonb_build_object('channel', d.channel, 'attempts', d.attempts,"
            " 'delivered_at', d.delivered_at, 'next_attempt_at', d.next_attempt_at, 'last_error', d.last_error)"
            " ORDER BY d.channel) FILTER (WHERE d.seq IS NOT NULL), '[]') AS deliveries"
            " FROM control.outbox o LEFT JOIN control.outbox_deliveries d ON d.seq = o.seq"
            " WHERE (%s::text IS NULL OR o.job_id = %s)"
            " GROUP BY o.seq ORDER BY o.seq DESC LIMIT %s",
            (job_id, job_id, limit),
        ).fetchall()
    return [
        {
            "job_id": r["job_id"],
            "tenant_id": r["tenant_id"],
            "event": r["kind"],
            "queued_at": r["created_at"].isoformat(),
            "delivered_at": None if r["delivered_at"] is None else r["delivered_at"].isoformat(),
            "deliveries": r["deliveries"],
        }
        for r in rows
    ]
