"""What a forget run fixes at its freeze, before any store deletes: the exact target versions (with
the copies a restore orphaned), the records each store held of them, the paraphrase probes (plain
text, in memory only) and the keyed fingerprints the physical erasure scans for.

Targets, counts and fingerprints are recorded on the job at its first freeze and reused on resume.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import psycopg

from memory_pipelines.lib.infra.errors import ServiceError
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import DeletionJob, DeletionScope
from memory_pipelines.lib.stores import bytescan, registry
from memory_pipelines.lib.stores.adapter import Context, Source, ever_restored
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "MAX_PROBES",
    "Probes",
    "covered",
    "fingerprint",
    "found",
    "orphans",
    "probes",
    "resolve_targets",
    "with_orphans",
]

# Paraphrase probes per run: every target up to this many, a random sample above (exact-id checks
# stay exhaustive). Each probe is a nearest-neighbour query; a batch of 100 subjects has 10,000.
MAX_PROBES = 2_000


@dataclass
class Probes:
    """Recall probes of the deleted content; held in memory for one run, never stored."""

    texts: list[str]
    vectors: list[Any]
    stored: dict[str, Any] = field(default_factory=dict)  # the index's own vectors read for them, by record id
    targets: int = 0  # versions the probes were drawn from (more than the probes when sampled)


def probes(derived: DerivedStores, tenant_id: str, sources: set[Source]) -> Probes:
    """Paraphrase probes, built in memory from each target before deletion and discarded after.

    The texts feed the keyword probes; the semantic probes reuse each target's stored vector
    (the embedding of that very text) and embed only targets that have none, such as
    superseded versions.
    """
    chosen = sorted(sources)
    if len(chosen) > MAX_PROBES:
        # A retention sweep or a large batch: exact-id checks stay exhaustive, paraphrase probes
        # are a random sample (the proof says how many, of how many).
        chosen = sorted(random.sample(chosen, MAX_PROBES))
    texts = derived.store.open_texts(tenant_id=tenant_id, sources=chosen, skip_unreadable=True)
    try:
        if derived.vectors.existing(tenant_id) is None:
            # No index: nothing a vector could find.
            return Probes(texts=list(texts.values()), vectors=[], targets=len(sources))
        stored = derived.vectors.vectors_of(tenant_id, [f"{m}:{v}" for m, v in sorted(texts)])
    except ServiceError:
        stored = {}  # Chroma down: embed every probe; the Chroma step itself will block the job
    missing = [source for source in sorted(texts) if f"{source[0]}:{source[1]}" not in stored]
    vectors = list(stored.values())
    if missing:
        vectors += list(derived.vectors.embedder.embed([texts[source] for source in missing]))
    return Probes(texts=list(texts.values()), vectors=vectors, stored=stored, targets=len(sources))


def resolve_targets(store: MemoryStore, tenant_id: str, jobs: list[DeletionJob]) -> dict[str, set[Source]]:
    """job_id -> exact (memory_id, version) set, fixed at the first run and reused on resume."""
    out: dict[str, set[Source]] = {}
    with store.transaction() as conn:
        for job in jobs:
            is_fixed = conn.execute(
                "SELECT targets_fixed FROM control.deletion_jobs WHERE job_id = %s", (job["job_id"],)
            ).fetchone()
            if is_fixed is not None and is_fixed[0]:
                fixed = conn.execute(
                    "SELECT memory_id, version FROM control.deletion_targets WHERE job_id = %s", (job["job_id"],)
                ).fetchall()
                out[job["job_id"]] = {(m, v) for m, v in fixed}
                continue
            scope = job["scope"]
            if scope["type"] == "SUBJECT":
                query = (
                    "SELECT v.memory_id, v.version FROM memory.memory_versions v JOIN memory.memories m"
                    " ON m.tenant_id = v.tenant_id AND m.memory_id = v.memory_id"
                    " WHERE v.tenant_id = %s AND m.user_id = %s"
                )
                rows = conn.execute(query, (tenant_id, scope["subject"])).fetchall()
            elif scope["type"] in ("MEMORY", "RETENTION"):
                rows = conn.execute(
                    "SELECT memory_id, version FROM control.tombstones WHERE job_id = %s", (job["job_id"],)
                ).fetchall()
            else:
                rows = conn.execute(
                    "SELECT memory_id, version FROM memory.memory_versions WHERE tenant_id = %s", (tenant_id,)
                ).fetchall()
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO control.deletion_targets (job_id, memory_id, version) VALUES (%s, %s, %s)"
                    " ON CONFLICT DO NOTHING",
                    [(job["job_id"], m, v) for m, v in rows],
                )
            conn.execute(
                "UPDATE control.deletion_jobs SET target_count = %s, targets_fixed = true WHERE job_id = %s",
                (len(rows), job["job_id"]),
            )
            out[job["job_id"]] = {(m, v) for m, v in rows}
    return out


def with_orphans(
    store: MemoryStore, tenant_id: str, jobs: list[DeletionJob], fixed: dict[str, set[Source]]
) -> dict[str, set[Source]]:
    """job_id -> its fixed targets and the orphans its scope covers (looked up at every run)."""
    with store.transaction() as conn:
        left = orphans(conn, tenant_id)
    return {
        job["job_id"]: fixed[job["job_id"]] | covered(left, job["scope"], {m for m, _ in fixed[job["job_id"]]})
        for job in jobs
    }


def orphans(conn: psycopg.Connection, tenant_id: str) -> list[tuple[str, int, str | None]]:
    """Versions with derived records but no primary row any more (a restore removed them after
    they were indexed, summarised or cached), each with its memory's author (None: memory gone).

    Only a restore makes them, so a tenant never restored skips the scan of its lineage; one scan
    a batch otherwise. The anti-join runs first and each orphan's memory is one primary-key probe,
    so a plan built on a new tenant's stale statistics stays linear (a join of lineage to the
    tenant's memories by tenant alone took minutes at 10,000 memories)."""
    if not ever_restored(conn, tenant_id):
        return []
    rows = conn.execute(
        "WITH o AS MATERIALIZED (SELECT DISTINCT l.source_memory_id, l.source_version FROM derived.lineage l"
        " WHERE l.tenant_id = %(t)s AND NOT EXISTS (SELECT 1 FROM memory.memory_versions v"
        "  WHERE v.tenant_id = %(t)s AND v.memory_id = l.source_memory_id AND v.version = l.source_version))"
        " SELECT o.source_memory_id, o.source_version, m.user_id FROM o LEFT JOIN LATERAL"
        " (SELECT m.user_id FROM memory.memories m WHERE m.tenant_id = %(t)s AND m.memory_id = o.source_memory_id"
        "  OFFSET 0) m ON true",
        {"t": tenant_id},
    ).fetchall()
    return [(str(m), int(v), user) for m, v, user in rows]


def covered(orphans: list[tuple[str, int, str | None]], scope: DeletionScope, memory_ids: set[str]) -> set[Source]:
    """The orphans a scope covers: a subject's (or the tenant's) forget takes those whose memory is
    theirs or gone with an unknown author; a memory's or a sweep's, those of its memories."""
    subject = scope["subject"] if scope["type"] == "SUBJECT" else None
    return {
        (m, v)
        for m, v, author in orphans
        if scope["type"] == "TENANT" or m in memory_ids or (subject is not None and author in (None, subject))
    }


def found(
    derived: DerivedStores, tenant_id: str, jobs: list[DeletionJob], targets: dict[str, set[Source]]
) -> dict[str, dict[str, int]]:
    """job_id -> store -> records that existed at the job's first freeze (kept across retries)."""
    out: dict[str, dict[str, int]] = {}
    with derived.store.transaction() as conn:
        for job in jobs:
            row = conn.execute("SELECT found FROM control.deletion_jobs WHERE job_id = %s", (job["job_id"],)).fetchone()
            if row is not None and row[0] is not None:
                out[job["job_id"]] = dict(row[0])
                continue
            ctx = Context(derived=derived, tenant_id=tenant_id, jobs=[job], everything=targets[job["job_id"]])
            counts = {spec.name: len(registry.adapter(spec.name).find(conn, ctx)) for spec in registry.stores()}
            conn.execute(
                "UPDATE control.deletion_jobs SET found = %s WHERE job_id = %s", (json.dumps(counts), job["job_id"])
            )
            out[job["job_id"]] = counts
    return out


def fingerprint(
    derived: DerivedStores,
    tenant_id: str,
    jobs: list[DeletionJob],
    targets: dict[str, set[Source]],
    vectors: dict[str, Any],
) -> None:
    """Keyed fingerprints of what each store holds of the targets, for the physical erasure's
    byte scan (the bytes themselves are never kept). Taken once per job and store, before that
    store deletes; a store that is down now is fingerprinted at the next freeze (its own step
    blocks the job meanwhile). Each store that had nothing leaves a 0 row (never scanned for)."""
    store = derived.store
    with store.transaction() as conn:
        taken = set(
            conn.execute(
                "SELECT DISTINCT job_id, store FROM control.erasure_fingerprints WHERE job_id = ANY(%s)",
                ([job["job_id"] for job in jobs],),
            ).fetchall()
        )
        base = bytescan.base_from_key(store.keys.control_key(conn))
    rows: list[tuple[str, str, int]] = []
    with store.transaction() as conn:
        for spec in registry.stores():
            adapter = registry.adapter(spec.name)
            todo = [
                job
                for job in jobs
                if (job["job_id"], spec.name) not in taken
                and not str(job["targets"].get(spec.name, "")).startswith("DONE:")
            ]
            ctxs = [
                Context(
                    derived=derived,
                    tenant_id=tenant_id,
                    jobs=[job],
                    everything=targets[job["job_id"]],
                    vectors=vectors,
                )
                for job in todo
            ]
            try:
                for ctx in ctxs:
                    ctx.records = adapter.find(conn, ctx)
                # One read of the store for the whole batch where the adapter can (Chroma: a
                # get per job was most of a 100-subject freeze), else one per job.
                many = getattr(adapter, "fingerprints_many", None)
                windows = many(conn, ctxs) if many else [adapter.fingerprints(conn, ctx) for ctx in ctxs]
            except ServiceError:
                continue
            for job, window in zip(todo, windows, strict=True):
                fingerprints = set(bytescan.fingerprints(window, base)) | {0}
                rows += [(job["job_id"], spec.name, fp) for fp in sorted(fingerprints)]
        # COPY: a batch of 100 subjects has about 100,000 rows, and row-by-row inserts took seconds.
        conn.execute(
            "CREATE TEMP TABLE IF NOT EXISTS erasure_fingerprints_in"
            " (job_id text, store text, fingerprint bigint) ON COMMIT DELETE ROWS"
        )
        with conn.cursor() as cur, cur.copy("COPY erasure_fingerprints_in FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)
        conn.execute(
            "INSERT INTO control.erasure_fingerprints (job_id, store, fingerprint)"
            " SELECT job_id, store, fingerprint FROM erasure_fingerprints_in ON CONFLICT DO NOTHING"
        )
