"""What a forget run fixes at its freeze, before any store deletes: the exact target versions (with
the copies a restore orphaned), the records each store held of them, the paraphrase probes (plain
text, in memory only) and the keyed fingerprints the physical erasure scans for.

Targets, counts and fingerprints are recorded on the job at its first freeze and reused on resume.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from memory_pipelines.lib.forget import ledger
from memory_pipelines.lib.forget.ledger import LEGACY_SEALED
from memory_pipelines.lib.infra.errors import ServiceError
from memory_pipelines.lib.results import DeletionJob, DeletionScope
from memory_pipelines.lib.stores import bytescan, lineage, registry
from memory_pipelines.lib.stores.adapter import Context, Lineage, Source, ever_restored, lineage_map
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "LEGACY_SEALED",
    "MAX_PROBES",
    "Probes",
    "Records",
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
# Rows one set-based insert carries (arrays bound as three parameters).
_INSERT_CHUNK = 50_000


@dataclass
class Probes:
    """Recall probes of the deleted content; held in memory for one run, never stored."""

    texts: list[str]
    vectors: list[Any]
    stored: dict[str, Any] = field(default_factory=dict)  # the index's own vectors read for them, by record id
    asked: set[str] = field(default_factory=set)  # record ids the index was asked for (found ones in `stored`)
    targets: int = 0  # versions the probes were drawn from (more than the probes when sampled)


def probes(derived: DerivedStores, tenant_id: str, sources: set[Source]) -> Probes:
    """Paraphrase probes, built in memory from each target before deletion and discarded after.

    The texts feed the keyword probes; the semantic probes reuse each target's stored vector
    (the embedding of that very text, read in one call: `VectorStore.stored`) and embed only targets
    that have none, such as superseded versions.
    """
    chosen = sorted(sources)
    if len(chosen) > MAX_PROBES:
        # A retention sweep or a large batch: exact-id checks stay exhaustive, paraphrase probes
        # are a random sample (the proof says how many, of how many).
        chosen = sorted(random.sample(chosen, MAX_PROBES))
    texts = derived.store.open_texts(tenant_id=tenant_id, sources=chosen, skip_unreadable=True)
    ids = [f"{m}:{v}" for m, v in sorted(texts)]
    try:
        found = derived.vectors.stored(tenant_id, ids)
    except ServiceError:
        # Chroma down: embed every probe; the Chroma step itself will block the job.
        found, ids = {}, []
    if found is None:
        # No index: nothing a vector could find (and nothing stored to fingerprint).
        return Probes(texts=list(texts.values()), vectors=[], asked=set(ids), targets=len(sources))
    stored = found
    missing = [source for source in sorted(texts) if f"{source[0]}:{source[1]}" not in stored]
    vectors = list(stored.values())
    if missing:
        vectors += list(derived.vectors.embedder.embed([texts[source] for source in missing]))
    return Probes(texts=list(texts.values()), vectors=vectors, stored=stored, asked=set(ids), targets=len(sources))


def resolve_targets(conn: psycopg.Connection, tenant_id: str, jobs: list[DeletionJob]) -> dict[str, set[Source]]:
    """job_id -> exact (memory_id, version) set, fixed at the first run and reused on resume.

    Set-based: one query per kind of scope for all the batch's jobs, one insert of every new target
    and one update of the jobs' counts, whatever the batch's size."""
    out: dict[str, set[Source]] = {job["job_id"]: set() for job in jobs}
    job_ids = [job["job_id"] for job in jobs]
    fixed = {
        job_id
        for job_id, is_fixed in conn.execute(
            "SELECT job_id, targets_fixed FROM control.deletion_jobs WHERE job_id = ANY(%s)", (job_ids,)
        )
        if is_fixed
    }
    if fixed:
        for job_id, m, v in conn.execute(
            "SELECT job_id, memory_id, version FROM control.deletion_targets WHERE job_id = ANY(%s)", (sorted(fixed),)
        ):
            out[job_id].add((m, v))
    new = [job for job in jobs if job["job_id"] not in fixed]
    if not new:
        return out
    rows: dict[str, list[Source]] = {job["job_id"]: [] for job in new}
    subjects: dict[str, list[str]] = {}
    for job in new:
        if job["scope"]["type"] == "SUBJECT":
            subjects.setdefault(str(job["scope"]["subject"]), []).append(job["job_id"])
    if subjects:
        for user_id, m, v in conn.execute(
            "SELECT m.user_id, v.memory_id, v.version FROM memory.memory_versions v JOIN memory.memories m"
            " ON m.tenant_id = v.tenant_id AND m.memory_id = v.memory_id"
            " WHERE v.tenant_id = %s AND m.user_id = ANY(%s)",
            (tenant_id, sorted(subjects)),
        ):
            for job_id in subjects[user_id]:
                rows[job_id].append((m, v))
    tombstoned = [job["job_id"] for job in new if job["scope"]["type"] in ("MEMORY", "RETENTION")]
    if tombstoned:
        for job_id, m, v in conn.execute(
            "SELECT job_id, memory_id, version FROM control.tombstones WHERE job_id = ANY(%s)", (tombstoned,)
        ):
            rows[job_id].append((m, v))
    tenant_jobs = [job["job_id"] for job in new if job["scope"]["type"] not in ("SUBJECT", "MEMORY", "RETENTION")]
    if tenant_jobs:
        every = conn.execute(
            "SELECT memory_id, version FROM memory.memory_versions WHERE tenant_id = %s", (tenant_id,)
        ).fetchall()
        for job_id in tenant_jobs:
            rows[job_id] = [(m, v) for m, v in every]
    _insert_rows(
        conn,
        "INSERT INTO control.deletion_targets (job_id, memory_id, version)"
        " SELECT * FROM unnest(%s::text[], %s::text[], %s::int[]) ON CONFLICT DO NOTHING",
        [(job_id, m, v) for job_id, targets in rows.items() for m, v in targets],
    )
    ledger.fix_target_counts(conn, {job_id: len(targets) for job_id, targets in rows.items()})
    for job_id, targets in rows.items():
        out[job_id] = set(targets)
    return out


def with_orphans(
    conn: psycopg.Connection, tenant_id: str, jobs: list[DeletionJob], fixed: dict[str, set[Source]]
) -> dict[str, set[Source]]:
    """job_id -> its fixed targets and the orphans its scope covers (looked up at every run)."""
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


class Records:
    """job_id -> store -> the store's records derived from the job's targets, found once per batch
    (each on first use) from one read of the lineage of every target (`lineage_map`): the counts of
    `found` and the fingerprints of `fingerprint` read the same rows."""

    def __init__(
        self,
        conn: psycopg.Connection,
        derived: DerivedStores,
        tenant_id: str,
        jobs: list[DeletionJob],
        targets: dict[str, set[Source]],
    ) -> None:
        self.conn = conn
        self.derived = derived
        self.tenant_id = tenant_id
        self.jobs = {job["job_id"]: job for job in jobs}
        self.targets = targets
        self._lineage: Lineage | None = None
        self._found: dict[tuple[str, str], set[str]] = {}

    @property
    def read(self) -> Lineage | None:
        """The lineage read so far (None: not read)."""
        return self._lineage

    @property
    def lineage(self) -> Lineage:
        if self._lineage is None:
            self._lineage = lineage_map(self.conn, self.tenant_id, set().union(*self.targets.values()))
        return self._lineage

    def context(self, job_id: str, **extra: Any) -> Context:
        return Context(
            derived=self.derived,
            tenant_id=self.tenant_id,
            jobs=[self.jobs[job_id]],
            everything=self.targets[job_id],
            lineage=self.lineage,
            **extra,
        )

    def of(self, job_id: str, store: str) -> set[str]:
        key = (job_id, store)
        if key not in self._found:
            self._found[key] = registry.adapter(store).find(self.conn, self.context(job_id))
        return self._found[key]


# Of a job's target versions, those of which a copy may be sealed under a key that outlives them
# (LEGACY_SEALED in its `found`): sealed under their author's subject key (written before version keys,
# not yet converted), or converted while a retired key of their author opens the copies made before
# (lib/memories/key_conversion.py).
_LEGACY_SEALED = (
    "SELECT count(*) FROM memory.memory_versions v JOIN unnest(%(m)s::text[], %(v)s::int[]) AS w(memory_id, version)"
    " ON v.memory_id = w.memory_id AND v.version = w.version WHERE v.tenant_id = %(t)s AND (v.key_id NOT LIKE 'vk\\_%%'"
    " OR EXISTS (SELECT 1 FROM memory.memories m JOIN keystore.retired_keys r ON r.tenant_id = %(t)s"
    "  AND r.user_id = m.user_id WHERE m.tenant_id = %(t)s AND m.memory_id = v.memory_id"
    "  AND v.created_at < r.retired_at))"
)


def found(conn: psycopg.Connection, records: Records, jobs: list[DeletionJob]) -> dict[str, dict[str, int]]:
    """job_id -> store -> records that existed at the job's first freeze (kept across retries), and
    LEGACY_SEALED -> target versions sealed under a key their deletion does not destroy."""
    out: dict[str, dict[str, int]] = {}
    kept: dict[str, dict[str, int]] = dict(
        conn.execute(
            "SELECT job_id, found FROM control.deletion_jobs WHERE job_id = ANY(%s) AND found IS NOT NULL",
            ([job["job_id"] for job in jobs],),
        ).fetchall()
    )
    for job in jobs:
        if job["job_id"] in kept:
            out[job["job_id"]] = dict(kept[job["job_id"]])
            continue
        out[job["job_id"]] = {spec.name: len(records.of(job["job_id"], spec.name)) for spec in registry.stores()}
        memory_ids, versions = lineage.pair_arrays(sorted(records.targets[job["job_id"]]))
        legacy = conn.execute(_LEGACY_SEALED, {"m": memory_ids, "v": versions, "t": records.tenant_id}).fetchone()
        out[job["job_id"]][LEGACY_SEALED] = int(legacy[0]) if legacy else 0
    new = [job_id for job_id in out if job_id not in kept]
    if new:
        ledger.record_found(conn, {job_id: out[job_id] for job_id in new})
    return out


def fingerprint(conn: psycopg.Connection, records: Records, jobs: list[DeletionJob], probes: Probes) -> None:
    """Keyed fingerprints of what each store holds of the targets, for the physical erasure's
    byte scan (the bytes themselves are never kept). Taken once per job and store, before that
    store deletes; a store that is down now is fingerprinted at the next freeze (its own step
    blocks the job meanwhile). Each store that had nothing leaves a 0 row (never scanned for).
    Vectors the probes read are not read again."""
    store = records.derived.store
    taken = set(
        conn.execute(
            "SELECT DISTINCT job_id, store FROM control.erasure_fingerprints WHERE job_id = ANY(%s)",
            ([job["job_id"] for job in jobs],),
        ).fetchall()
    )
    base = bytescan.base_from_key(store.keys.control_key(conn))
    rows: list[tuple[str, str, int]] = []
    for spec in registry.stores():
        adapter = registry.adapter(spec.name)
        todo = [
            job
            for job in jobs
            if (job["job_id"], spec.name) not in taken
            and not str(job["targets"].get(spec.name, "")).startswith("DONE:")
        ]
        ctxs = [records.context(job["job_id"], vectors=probes.stored, vectors_asked=probes.asked) for job in todo]
        try:
            for ctx, job in zip(ctxs, todo, strict=True):
                ctx.records = records.of(job["job_id"], spec.name)
            # One read of the store for the whole batch where the adapter can (Chroma: a
            # get per job was most of a 100-subject freeze), else one per job.
            many = getattr(adapter, "fingerprints_many", None)
            windows = many(conn, ctxs) if many else [adapter.fingerprints(conn, ctx) for ctx in ctxs]
        except ServiceError:
            continue
        for job, window in zip(todo, windows, strict=True):
            fingerprints = set(bytescan.fingerprints(window, base)) | {0}
            rows += [(job["job_id"], spec.name, fp) for fp in sorted(fingerprints)]
    # Set-based: a batch of 100 subjects has about 100,000 rows, and row-by-row inserts took seconds.
    _insert_rows(
        conn,
        "INSERT INTO control.erasure_fingerprints (job_id, store, fingerprint)"
        " SELECT * FROM unnest(%s::text[], %s::text[], %s::bigint[]) ON CONFLICT DO NOTHING",
        rows,
    )


def _insert_rows(conn: psycopg.Connection, query: str, rows: Sequence[tuple[Any, ...]]) -> None:
    """Run `query` (an INSERT from `unnest` of one array per column) on `rows`, _INSERT_CHUNK at a time."""
    for start in range(0, len(rows), _INSERT_CHUNK):
        part = rows[start : start + _INSERT_CHUNK]
        conn.execute(query, tuple(list(column) for column in zip(*part, strict=True)))
