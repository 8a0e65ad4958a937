"""What a restore does inside PostgreSQL: the journals replayed where nothing forgotten can stay behind.

A backup may hold rows the deletion journal has forgotten since (a subject's epoch, tombstones, a
whole memory, a destroyed key). Deleting them after loading them would leave their ciphertext in the
tenant's heap files as dead tuples, and in WAL, with no erasure to come. So a restore loads the
backup into TEMPORARY tables (not WAL-logged; their files are unlinked when the restore's transaction
ends), removes there every row the journal forgot, applies the consent journal, and only then copies
what survives into the tenant's real tables. The same rules then run on the real tables as a safety
net (expected to remove nothing) and as the verification (expected to count nothing).

Why nothing forgotten reaches a real table: the restore's transaction holds the tenant's gate lock
exclusively from the load to its commit, and every journal writer (a deletion's acceptance, a
retention sweep) takes that lock in the transaction that journals; key destructions follow their own
journalled acceptance (`keys shred`) or run under the forget lock the restore holds (the cascade).
Should the safety net still remove a row (a journal entry written some other way), fingerprints of
its bytes are kept for the jobs it belongs to, and those jobs go back to `physical: PENDING`: through
`JobRecords`, since only the deletion ledger writes a job's row (lib/forget/ledger.py, a layer above).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import psycopg
import pyarrow as pa
from psycopg import sql

from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.memories import consent, table_partitions
from memory_pipelines.lib.memories.store import repair_heads
from memory_pipelines.lib.stores import bytescan, registry

__all__ = [
    "BATCH_ROWS",
    "OWED_STORE",
    "STAGING_PREFIX",
    "Columns",
    "JobRecords",
    "Owed",
    "analyze_published",
    "filter_staged",
    "owe_erasure",
    "publish",
    "replay",
    "stage",
    "staged",
    "verify",
]

Columns = list[tuple[str, pa.DataType]]
STAGING_PREFIX = "restore_"
BATCH_ROWS = 20_000
# Fingerprints of rows the safety net removed are kept under this store name (not a registry store).
OWED_STORE = "restore"

_PG_TYPES = {
    pa.string(): "text",
    pa.bool_(): "boolean",
    pa.int32(): "integer",
    pa.float64(): "double precision",
    pa.binary(): "bytea",
    pa.timestamp("us", tz="UTC"): "timestamptz",
}


def staged(name: str) -> sql.Composable:
    """The temporary table a backup's `name` table is loaded into (this session's, pg_temp)."""
    return sql.Identifier("pg_temp", STAGING_PREFIX + name)


def _real(qualified: str) -> sql.Composable:
    return sql.Identifier(*qualified.split("."))


def _names(columns: Columns) -> sql.Composable:
    return sql.SQL(", ").join(sql.Identifier(c) for c in ["tenant_id", *(c for c, _ in columns)])


def stage(
    conn: psycopg.Connection,
    tenant_id: str,
    name: str,
    columns: Columns,
    data: pa.Table,
    progress: Progress = no_progress,
    done: int = 0,
    total: int | None = None,
) -> int:
    """COPY one table of the backup into its temporary table (dropped at commit at the latest)."""
    definition = sql.SQL(", ").join(
        sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(t))
        for c, t in [("tenant_id", "text"), *((c, _PG_TYPES[d]) for c, d in columns)]
    )
    conn.execute(
        sql.SQL("CREATE TEMPORARY TABLE {} ({}) ON COMMIT DROP").format(
            sql.Identifier(STAGING_PREFIX + name), definition
        )
    )
    copy = sql.SQL("COPY {} ({}) FROM STDIN").format(staged(name), _names(columns))
    with conn.cursor() as cur, cur.copy(copy) as writer:
        for batch in data.to_batches(BATCH_ROWS):
            cols = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
            for row in zip(*cols, strict=True):
                writer.write_row((tenant_id, *row))
            done += batch.num_rows
            progress(done, total, "restore rows")
    # Temporary tables are never analyzed by autovacuum: the rules' joins plan on real counts. Never
    # the binary columns: ANALYZE keeps sample values in pg_statistic, a real (WAL-logged) table, and
    # these rows include what the journal is about to drop.
    keys = [c for c, d in columns if d != pa.binary()]
    conn.execute(
        sql.SQL("ANALYZE {} ({})").format(staged(name), sql.SQL(", ").join(map(sql.Identifier, ["tenant_id", *keys])))
    )
    return done


def filter_staged(
    conn: psycopg.Connection, tenant_id: str, *, since: str | None
) -> tuple[dict[str, int], dict[str, Any]]:
    """Apply both journals to the staged rows: remove what the deletion journal forgot, then replay the
    consent entries the backup's snapshot `since` did not see. Returns rows removed and consent changes."""
    removed: dict[str, int] = {}
    for reason in _FORGOTTEN:
        removed[reason] = conn.execute(_forgotten_query(reason, staging=True), {"t": tenant_id}).rowcount
    removed["empty_memories"] = conn.execute(
        sql.SQL("DELETE FROM {} m WHERE NOT EXISTS (SELECT 1 FROM {} v WHERE v.memory_id = m.memory_id)").format(
            staged("memories"), staged("memory_versions")
        )
    ).rowcount
    changes = consent.replay(
        conn,
        tenant_id,
        since=since,
        memories=f"pg_temp.{STAGING_PREFIX}memories",
        teams=f"pg_temp.{STAGING_PREFIX}teams",
        team_members=f"pg_temp.{STAGING_PREFIX}team_members",
    )
    # After the consent replay: a membership it gave back to a subject forgotten since goes again.
    removed["team_members"] = conn.execute(_members_of_forgotten(staged("team_members")), {"t": tenant_id}).rowcount
    return removed, changes


def publish(conn: psycopg.Connection, tenant_id: str, tables: Iterable[tuple[str, str, Columns]]) -> None:
    """Copy what survived the journals from each temporary table into the real one, then drop it
    (its files are unlinked at commit; it was never WAL-logged)."""
    for name, qualified, columns in tables:
        conn.execute(
            sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} WHERE tenant_id = %s").format(
                _real(qualified), _names(columns), _names(columns), staged(name)
            ),
            (tenant_id,),
        )
        conn.execute(sql.SQL("DROP TABLE {}").format(staged(name)))


# The published rows are analyzed for the safety net's plans: the version rows' keys and the shared
# heads tables, never a binary column (ANALYZE keeps sample values in pg_statistic, which is WAL-logged
# and which no erasure rewrites).
_ANALYZED_VERSION_COLUMNS = ("tenant_id", "memory_id", "version", "key_id", "created_at", "superseded_at")
_ANALYZED_SHARED = ("memory.memories", "memory.subjects", "memory.team_members")


def analyze_published(conn: psycopg.Connection, tenant_id: str) -> None:
    """ANALYZE what the restore published, so the safety net and every later query plan on its rows."""
    part = table_partitions.tenant_partitions(conn, tenant_id).get("memory.memory_versions")
    if part is not None:
        row = conn.execute(
            "SELECT n.nspname, c.relname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n"
            " ON n.oid = c.relnamespace WHERE c.oid = %s::regclass",
            (part,),
        ).fetchone()
        assert row is not None
        conn.execute(
            sql.SQL("ANALYZE {} ({})").format(
                sql.Identifier(row[0], row[1]), sql.SQL(", ").join(map(sql.Identifier, _ANALYZED_VERSION_COLUMNS))
            )
        )
    for table in _ANALYZED_SHARED:
        conn.execute(sql.SQL("ANALYZE {}").format(_real(table)))


Owed = dict[str | None, set[int]]


class JobRecords(Protocol):
    """The write a restore makes to a deletion job's row; the deletion ledger (lib/forget/ledger.py)
    implements it, as only it writes those rows."""

    def reopen_erasure(
        self,
        conn: psycopg.Connection,
        job_id: str,
        *,
        targets: dict[str, Any],
        proof: dict[str, Any],
        deadline: datetime,
    ) -> None:
        """The COMPLETE job's physical erasure owed again by `deadline`, with `targets` and `proof` saying so."""


def replay(
    conn: psycopg.Connection, tenant_id: str, base: int, progress: Progress = no_progress
) -> tuple[dict[str, int], dict[str, int], Owed]:
    """The safety net on the real tables, after the survivors were published: every rule again (expected
    to remove nothing), heads repaired, PostgreSQL copies of versions the restore dropped removed.
    Returns (rows the rules removed, other counts, fingerprints owed per job: None when no job is known)."""
    after: dict[str, int] = {}
    owed: Owed = {}
    steps = len(_FORGOTTEN) + 3
    for reason in _FORGOTTEN:
        rows = conn.execute(_forgotten_query(reason, staging=False), {"t": tenant_id}).fetchall()
        after[reason] = len(rows)
        for job_id, text_ct, query_ct in rows:
            windows = bytescan.windows(text_ct) + bytescan.windows(query_ct)
            owed.setdefault(job_id, set()).update(bytescan.fingerprints(windows, base))
        progress(len(after), steps, "restore replay")
    # Heads whose current version went (by the staged rules or here) point at their newest one left.
    after["empty_memories"] = repair_heads(conn, tenant_id=tenant_id)
    after["team_members"] = conn.execute(_members_of_forgotten(_real("memory.team_members")), {"t": tenant_id}).rowcount
    other = _drop_copies_of_dropped_versions(conn, tenant_id)
    progress(len(_FORGOTTEN) + 2, steps, "restore replay")
    # Edges to versions the restored rows no longer hold that are left describe copies outside
    # PostgreSQL (vectors); they stay, so the rebuild after this restore, or a
    # forget before it, finds and removes those copies.
    row = conn.execute(
        "SELECT count(*) FROM derived.lineage l WHERE l.tenant_id = %s AND NOT EXISTS (SELECT 1 FROM"
        " memory.memory_versions v WHERE v.tenant_id = l.tenant_id AND v.memory_id = l.source_memory_id"
        " AND v.version = l.source_version)",
        (tenant_id,),
    ).fetchone()
    other["derived_edges_left_for_rebuild"] = int(row[0]) if row else 0
    progress(steps, steps, "restore replay")
    return after, other, owed


def verify(conn: psycopg.Connection, tenant_id: str) -> dict[str, int]:
    """Rows of forgotten scopes in the real tables; all must be zero before reads reopen."""
    counts = {}
    for reason in _FORGOTTEN:
        row = conn.execute(_forgotten_query(reason, staging=False, count=True), {"t": tenant_id}).fetchone()
        counts[reason] = int(row[0]) if row else 0
    return counts


def owe_erasure(
    conn: psycopg.Connection, tenant_id: str, restore_id: str, owed: Owed, *, erasure_hours: int, jobs: JobRecords
) -> dict[str, Any]:
    """Keep the fingerprints of rows the safety net removed from real tables, and put the jobs they
    belong to (every COMPLETE job of the tenant when none is known) back to `physical: PENDING` through
    `jobs`, so the erasure sensor runs the tenant's erasure and its byte scan looks for them."""
    complete = [
        r[0]
        for r in conn.execute(
            "SELECT job_id FROM control.deletion_jobs WHERE tenant_id = %s AND state = 'COMPLETE' ORDER BY job_id",
            (tenant_id,),
        )
    ]
    known = {
        r[0]
        for r in conn.execute(
            "SELECT job_id FROM control.deletion_jobs WHERE tenant_id = %s AND job_id = ANY(%s)",
            (tenant_id, [j for j in owed if j is not None]),
        )
    }
    per_job: dict[str, set[int]] = {}
    for job_id, fingerprints in owed.items():
        for target in [job_id] if job_id is not None and job_id in known else complete:
            per_job.setdefault(target, set()).update(fingerprints)
    deadline = datetime.now(UTC) + timedelta(hours=erasure_hours)
    for job_id, fingerprints in sorted(per_job.items()):
        conn.execute(
            "INSERT INTO control.erasure_fingerprints (job_id, store, fingerprint) SELECT %s, %s, unnest(%s::bigint[])"
            " ON CONFLICT DO NOTHING",
            (job_id, OWED_STORE, sorted(fingerprints - {0})),
        )
        _back_to_pending(conn, jobs, job_id, tenant_id, restore_id, deadline)
    return {"jobs": sorted(per_job), "fingerprints": len(set().union(*per_job.values())) if per_job else 0}


def _back_to_pending(
    conn: psycopg.Connection, jobs: JobRecords, job_id: str, tenant_id: str, restore_id: str, deadline: datetime
) -> None:
    row = conn.execute(
        "SELECT targets, proof, erased_at FROM control.deletion_jobs WHERE job_id = %s AND state = 'COMPLETE'"
        " FOR UPDATE",
        (job_id,),
    ).fetchone()
    if row is None:
        return  # not complete yet: its completion makes it PENDING, and the erasure scans these too
    targets, proof, erased_at = dict(row[0] or {}), dict(row[1] or {}), row[2]
    if erased_at is None:
        return  # already pending: the coming erasure scans these fingerprints with its own
    targets["physical"] = f"PENDING:{deadline.isoformat()}"
    proof["targets"] = targets
    # The earlier erasure no longer describes the files: the certificate shows PENDING until the next.
    earlier = proof.pop("erasure", None)
    if earlier:
        proof.setdefault("erasuresBefore", []).append(earlier)
    # The keys stay destroyed (a restore brings back no key); the files hold restored copies again.
    for entry in (proof.get("guarantees") or {}).values():
        entry["physical"] = "PENDING"
    proof.setdefault("erasureOwedByRestores", []).append(restore_id)
    jobs.reopen_erasure(conn, job_id, targets=targets, proof=proof, deadline=deadline)
    conn.execute(
        "INSERT INTO control.audit (job_id, tenant_id, event, state, detail) VALUES (%s, %s, 'erasure_owed',"
        " 'COMPLETE', %s)",
        (job_id, tenant_id, json.dumps({"restoreId": restore_id})),
    )


# Rows the journal says must not exist: (other tables, condition on memory_versions v, the job it
# belongs to). One copy of the rules, run on the staged rows (DELETE), on the real rows (DELETE ...
# RETURNING, the safety net) and as the verification (count). Each binds %(t)s, the tenant; an epoch
# forgets what its subject wrote before it; a version whose key was destroyed, or whose key is
# unknown to the key store, can never be read again.
_FORGOTTEN: dict[str, tuple[str, str, str]] = {
    "subject_epochs": (
        "{memories} m, control.journal j",
        "v.tenant_id = %(t)s AND m.tenant_id = v.tenant_id AND m.memory_id = v.memory_id"
        " AND j.tenant_id = %(t)s AND j.kind = 'SUBJECT_EPOCH' AND j.subject_id = m.user_id"
        " AND v.created_at < j.created_at",
        "j.job_id",
    ),
    "tombstones": (
        "control.tombstones t",
        "v.tenant_id = %(t)s AND t.tenant_id = %(t)s AND t.memory_id = v.memory_id AND t.version = v.version",
        "t.job_id",
    ),
    "forgotten_memories": (
        "control.journal j",
        "v.tenant_id = %(t)s AND j.tenant_id = %(t)s AND j.kind = 'MEMORY_FORGOTTEN' AND j.memory_id = v.memory_id"
        " AND v.created_at < j.created_at",
        "j.job_id",
    ),
    "destroyed_keys": (
        "",
        # Both key lists are read once, for the tenant (bound, not correlated with v: a correlated
        # journal lookup ran once per version, 1.7 s of a 20,000-version restore).
        "v.tenant_id = %(t)s AND ((NOT EXISTS (SELECT 1 FROM keystore.version_keys k WHERE k.tenant_id = %(t)s"
        " AND k.key_id = v.key_id) AND NOT EXISTS (SELECT 1 FROM keystore.subject_keys k WHERE k.tenant_id = %(t)s"
        " AND k.key_id = v.key_id) AND NOT EXISTS (SELECT 1 FROM keystore.retired_keys k WHERE k.tenant_id = %(t)s"
        " AND k.key_id = v.key_id)) OR v.key_id IN (SELECT j.key_id FROM control.journal j"
        " WHERE j.tenant_id = %(t)s AND j.kind = 'KEY_DESTROYED'))",
        "(SELECT min(d.job_id) FROM control.journal d WHERE d.tenant_id = v.tenant_id AND d.kind = 'KEY_DESTROYED'"
        " AND d.key_id = v.key_id)",
    ),
}


def _forgotten_query(reason: str, *, staging: bool, count: bool = False) -> sql.Composed:
    tables, condition, job = _FORGOTTEN[reason]
    versions = staged("memory_versions") if staging else _real("memory.memory_versions")
    memories = staged("memories") if staging else _real("memory.memories")
    others = sql.SQL(tables).format(memories=memories) if tables else None
    if count:
        template = "SELECT count(*) FROM {} v{} WHERE {}"
        joined = sql.SQL(", ") + others if others else sql.SQL("")
        return sql.SQL(template).format(versions, joined, sql.SQL(condition))
    using = sql.SQL(" USING ") + others if others else sql.SQL("")
    returning: sql.Composable = sql.SQL("")
    if not staging:  # the safety net: what it removes, with the job it belongs to, is fingerprinted
        returning = sql.SQL(" RETURNING {}, v.text_ct, v.original_query_ct").format(sql.SQL(job))
    return sql.SQL("DELETE FROM {} v{} WHERE {}{}").format(versions, using, sql.SQL(condition), returning)


def _members_of_forgotten(team_members: sql.Composable) -> sql.Composed:
    """Memberships a subject's forget removed that a restore (or its consent replay) brought back:
    added before the subject's latest epoch. Takes %(t)s."""
    return sql.SQL(
        "DELETE FROM {} tm USING memory.subjects s WHERE tm.tenant_id = %(t)s"
        " AND s.tenant_id = tm.tenant_id AND s.user_id = tm.user_id AND s.epoch > 0"
        " AND tm.added_at < (SELECT max(j.created_at) FROM control.journal j WHERE j.tenant_id = tm.tenant_id"
        " AND j.kind = 'SUBJECT_EPOCH' AND j.subject_id = tm.user_id)"
    ).format(team_members)


# Copies in PostgreSQL of versions a restore dropped (written after the backup, or forgotten), removed
# in the restore's own transaction by each store's `restore_drop` (stores/<store>/spec.py): cached
# recalls and prompt snapshots that read them, summaries that state them (the rebuild after the
# restore makes them again), and their postings.
_ORPHAN = (
    " FROM derived.lineage l WHERE l.tenant_id = %(t)s AND l.store = %(store)s AND NOT EXISTS (SELECT 1"
    " FROM memory.memory_versions v WHERE v.tenant_id = l.tenant_id AND v.memory_id = l.source_memory_id"
    " AND v.version = l.source_version)"
)


def _drop_copies_of_dropped_versions(conn: psycopg.Connection, tenant_id: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for spec in registry.stores():
        if spec.restore_drop is None:
            continue
        store = spec.name
        ids = [r[0] for r in conn.execute("SELECT DISTINCT l.record_id" + _ORPHAN, {"t": tenant_id, "store": store})]
        counts[f"dropped_{store}"] = 0
        if ids:
            counts[f"dropped_{store}"] = conn.execute(spec.restore_drop, {"t": tenant_id, "ids": ids}).rowcount
            conn.execute(
                "DELETE FROM derived.lineage WHERE tenant_id = %s AND store = %s AND record_id = ANY(%s)",
                (tenant_id, store, ids),
            )
    return counts
