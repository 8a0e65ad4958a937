"""What the platform holds about a subject besides their memories, for their export (GDPR Art. 15/20):
their opt-outs, their deletion jobs and the agent runs that read their memories. Ids, states and times
only. All of it but the do-not-sell opt-out goes with the subject's SUBJECT forget: the primary
store's cascade drops their summary mode, its completion clears the MEMORY jobs' author, the SUBJECT
job is listed only while open, and runs are listed by what they read under the subject's current
epoch. The opt-out stays (`lib/memories/consent.py`: nothing but the subject undoes an opt-out; it
covers whatever is written under that id later).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

from memory_pipelines.lib.stores.summaries.store import DEFAULT_MODE

__all__ = [
    "held_about",
]


def _iso(value: Any) -> str | None:
    return None if value is None else value.isoformat()


def held_about(conn: psycopg.Connection, *, tenant_id: str, subject: str) -> dict[str, Any]:
    """`consent`, `deletion_jobs` and `agent_runs` of the subject in the tenant (empty when none)."""
    with conn.cursor(row_factory=dict_row) as cur:
        consent = cur.execute(
            "SELECT s.do_not_sell, m.mode FROM memory.subjects s LEFT JOIN derived.summary_modes m"
            " ON m.tenant_id = s.tenant_id AND m.user_id = s.user_id WHERE s.tenant_id = %s AND s.user_id = %s",
            (tenant_id, subject),
        ).fetchone()
        jobs = cur.execute(
            "SELECT job_id, scope, memory_id, version, state, basis, created_at, deadline, completed_at, erased_at"
            " FROM control.deletion_jobs WHERE tenant_id = %s"
            " AND (author_id = %s OR (scope = 'SUBJECT' AND subject_id = %s AND state <> 'COMPLETE'))"
            " ORDER BY created_at, job_id",
            (tenant_id, subject, subject),
        ).fetchall()
        runs = cur.execute(
            "SELECT l.run_id, min(l.created_at) AS opened_at, max(l.closed_at) AS closed_at,"
            " min(f.read_at) AS first_read_at, max(f.read_at) AS last_read_at,"
            " count(DISTINCT (f.memory_id, f.version)) AS versions_read,"
            " coalesce(array_agg(DISTINCT p.sink) FILTER (WHERE p.sink IS NOT NULL), '{}') AS sinks"
            " FROM control.lease_fences f JOIN control.leases l ON l.lease_id = f.lease_id"
            " JOIN memory.subjects s ON s.tenant_id = f.tenant_id AND s.user_id = f.author_id AND s.epoch = f.epoch"
            " LEFT JOIN control.permits p ON p.lease_id = l.lease_id"
            " WHERE f.tenant_id = %s AND f.author_id = %s GROUP BY l.run_id ORDER BY min(f.read_at), l.run_id",
            (tenant_id, subject),
        ).fetchall()
    return {
        "consent": {
            # Each memory's own flag is on its row in `memories`.
            "do_not_sell": bool(consent and consent["do_not_sell"]),
            "summary_mode": (consent or {}).get("mode") or DEFAULT_MODE,
            "summary_mode_chosen": bool(consent and consent["mode"]),
        },
        "deletion_jobs": [
            {
                "job_id": j["job_id"],
                "scope": {"type": j["scope"], "memory_id": j["memory_id"], "version": j["version"]},
                "state": j["state"],
                "basis": j["basis"],
                "requested_at": _iso(j["created_at"]),
                "deadline": _iso(j["deadline"]),
                "completed_at": _iso(j["completed_at"]),
                "erased_at": _iso(j["erased_at"]),
            }
            for j in jobs
        ],
        "agent_runs": [
            {
                "run_id": r["run_id"],
                "opened_at": _iso(r["opened_at"]),
                "closed_at": _iso(r["closed_at"]),
                "first_read_at": _iso(r["first_read_at"]),
                "last_read_at": _iso(r["last_read_at"]),
                "versions_read": int(r["versions_read"]),
                "sinks": sorted(r["sinks"]),
            }
            for r in runs
        ],
    }
