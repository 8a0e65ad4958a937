"""What an agent runtime calls: a run's lease, recall inside it, prompt snapshots, and `explain`.

    runs = AgentRuns(derived)
    lease = runs.open(tenant_id="acme", subject_id="alice", run_id="run-42")
    hits = runs.recall(lease_id=lease, query="what is alice allergic to?")   # fenced on the lease
    with runs.gate.permit(lease_id=lease, sink="model_output", on_cancel=[stream.stop]) as permit:
        for token in model.stream(prompt):
            permit.check()            # stops if a deletion closed a fence of this run
            stream.send(token)
    runs.snapshot_prompt(lease_id=lease, prompt=prompt)   # sealed, with lineage; forget removes it

`explain` answers "which memories led to this answer" for the run: the exact versions recalled,
their text while it still exists, and every derived record that came from them.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

from memory_pipelines.lib.forget.gate import Fence, FenceClosed, Gate, lease_fenced
from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import NotFoundError
from memory_pipelines.lib.memories import crypto, ordering
from memory_pipelines.lib.results import DerivedRecord, PromptSnapshot, RecallHit, RunExplanation
from memory_pipelines.lib.stores import lineage
from memory_pipelines.lib.stores.derived import DerivedStores

__all__ = [
    "STORE",
    "AgentRuns",
]

STORE = "prompt_snapshots"


def _aad(tenant_id: str, snapshot_id: str) -> bytes:
    return crypto.aad("prompt-snapshot", tenant_id, snapshot_id)


class AgentRuns:
    def __init__(self, derived: DerivedStores) -> None:
        self.derived = derived
        self.store = derived.store
        self.gate = Gate(derived.store)  # one gate (and its connections) for the run's reads and sinks

    def open(self, *, tenant_id: str, subject_id: str, run_id: str, ttl_seconds: int = 300) -> str:
        """Open the run's lease; returns its id."""
        return self.gate.open_lease(tenant_id=tenant_id, subject_id=subject_id, run_id=run_id, ttl_seconds=ttl_seconds)

    def recall(
        self, *, lease_id: str, query: str, team_id: str | None = None, k: int = 5, mode: str = "hybrid"
    ) -> list[RecallHit]:
        """Recall for the run's subject; every hit is fenced on the lease."""
        lease = self.gate.lease(lease_id)

        def fence(reads: list[tuple[str, int, str, int]]) -> None:
            self.gate.record_reads(lease_id=lease_id, fences=[Fence(*read) for read in reads])

        return self.derived.recaller.recall(
            tenant_id=lease["tenant_id"],
            user_id=lease["subject_id"],
            query=query,
            team_id=team_id,
            k=k,
            mode=mode,
            on_read=fence,
        )

    def snapshot_prompt(
        self, *, lease_id: str, prompt: str, sources: Iterable[tuple[str, int]] | None = None
    ) -> PromptSnapshot:
        """Store the prompt the run sent, sealed under a key of its own (a build key), with lineage to
        every memory version in it (default: everything the lease read). A state write: it takes a permit."""
        validation.check_text("prompt", prompt)
        lease = self.gate.lease(lease_id)
        chosen = sorted(
            set(sources)
            if sources is not None
            else {(f.memory_id, f.version) for f in self.gate.fences(lease_id=lease_id)}
        )
        tenant_id, subject_id = lease["tenant_id"], lease["subject_id"]
        snapshot_id = "ps_" + secrets.token_hex(12)
        with self.gate.permit(lease_id=lease_id, sink="state_write"), self.store.transaction() as conn:
            # The permit was issued before any closure; this commit is ordered by the gate lock too,
            # so a snapshot of versions forgotten since (or of a forgotten run subject) is refused.
            if ordering.guard_build(conn, tenant_id, chosen) or lease_fenced(conn, lease_id):
                raise FenceClosed("lease", f"lease {lease_id} read something that is being forgotten")
            try:
                self.store.keys.subject_key(conn, tenant_id, subject_id, create=False)
            except NotFoundError as exc:
                raise NotFoundError("subject", f"subject {subject_id!r} has no key: they have written nothing") from exc
            # A key of this snapshot only, deleted with it (migration 0015): a copy of the snapshot in
            # PostgreSQL's history is sealed under a key gone with the row, even while the subject's lives.
            key_id, key = self.store.keys.new_build_key(conn, tenant_id, "prompt-snapshot")
            conn.execute(
                "INSERT INTO derived.prompt_snapshots (tenant_id, snapshot_id, run_id, subject_id, prompt_ct, key_id)"
                " VALUES (%s, %s, %s, %s, %s, %s)",
                (
                    tenant_id,
                    snapshot_id,
                    lease["run_id"],
                    subject_id,
                    crypto.seal(key, prompt.encode(), _aad(tenant_id, snapshot_id)),
                    key_id,
                ),
            )
            lineage.insert_edges(
                conn, tenant_id=tenant_id, store=STORE, records=[(snapshot_id, source) for source in chosen]
            )
        return {"snapshot_id": snapshot_id, "run_id": lease["run_id"], "sources": len(chosen)}

    def explain(self, *, tenant_id: str, run_id: str) -> RunExplanation:
        """The recall chain of a run: memories it read (text while it exists) and derived records."""
        validation.check_id("tenant", tenant_id)
        validation.check_id("run", run_id)
        with self.store.transaction() as conn:
            # Visibility and decryption are one check: under the gate lock (shared) no deletion is
            # accepted until this transaction ends, so nothing judged present is hidden when decrypted.
            ordering.lock_tenant_shared(conn, tenant_id)
            self.store.require_tenant(tenant_id=tenant_id)  # joins this transaction
            leases = [
                r[0]
                for r in conn.execute(
                    "SELECT lease_id FROM control.leases WHERE tenant_id = %s AND run_id = %s ORDER BY created_at",
                    (tenant_id, run_id),
                )
            ]
            if not leases:
                raise NotFoundError("run", f"no run {run_id!r} in tenant {tenant_id!r}")
            fences = conn.execute(
                "SELECT DISTINCT f.memory_id, f.version, f.author_id, f.epoch,"
                " (v.memory_id IS NOT NULL AND s.forgotten_at IS NULL AND s.epoch = f.epoch AND NOT EXISTS"
                "  (SELECT 1 FROM control.tombstones t WHERE t.tenant_id = f.tenant_id AND t.memory_id = f.memory_id"
                "   AND t.version = f.version)) AS present"
                " FROM control.lease_fences f"
                " LEFT JOIN memory.memory_versions v ON v.tenant_id = f.tenant_id AND v.memory_id = f.memory_id"
                "  AND v.version = f.version"
                " LEFT JOIN memory.subjects s ON s.tenant_id = f.tenant_id AND s.user_id = f.author_id"
                " WHERE f.lease_id = ANY(%s) AND f.tenant_id = %s ORDER BY 1, 2",  # one tenant's partition
                (leases, tenant_id),
            ).fetchall()
            present = [(m, v) for m, v, _, _, ok in fences if ok]
            derived_records = conn.execute(
                "SELECT l.source_memory_id, l.source_version, l.store, l.record_id FROM derived.lineage l"
                " JOIN unnest(%s::text[], %s::int[]) AS w(memory_id, version)"
                " ON l.source_memory_id = w.memory_id AND l.source_version = w.version"
                " WHERE l.tenant_id = %s ORDER BY 3, 4",
                (*lineage.pair_arrays(present), tenant_id),
            ).fetchall()
            snapshots = conn.execute(
                "SELECT snapshot_id, created_at FROM derived.prompt_snapshots WHERE tenant_id = %s AND run_id = %s"
                " ORDER BY created_at",
                (tenant_id, run_id),
            ).fetchall()
            # On this transaction's connection (a nested transaction joins it), still under the lock.
            texts = self.store.open_texts(tenant_id=tenant_id, sources=present, skip_unreadable=True, visible_only=True)
        by_source: dict[tuple[str, int], list[DerivedRecord]] = {}
        for memory_id, version, store, record_id in derived_records:
            by_source.setdefault((memory_id, version), []).append({"store": store, "record_id": record_id})
        return {
            "tenant_id": tenant_id,
            "run_id": run_id,
            "leases": leases,
            "memories": [
                {
                    "memory_id": m,
                    "version": v,
                    "author": author,
                    "read_under_epoch": epoch,
                    "state": "present" if ok else "forgotten",
                    "text": texts.get((m, v)) if ok else None,
                    "derived": by_source.get((m, v), []) if ok else [],
                }
                for m, v, author, epoch, ok in fences
            ],
            "prompt_snapshots": [{"snapshot_id": sid, "created_at": at.isoformat()} for sid, at in snapshots],
        }
