"""The toy store's table and its sync: one note per current memory version (ids only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.stores import lineage
from memory_pipelines.lib.stores.registry import Synced

if TYPE_CHECKING:
    from memory_pipelines.lib.stores.derived import DerivedStores

NAME = "toy_notes"


def install(store: MemoryStore) -> None:
    """Make the toy store's own table (idempotent)."""
    with store.transaction() as conn:
        conn.execute(
            "CREATE TABLE IF NOT EXISTS derived.toy_notes (tenant_id text NOT NULL, note_id text NOT NULL,"
            " memory_id text NOT NULL, version int NOT NULL, PRIMARY KEY (tenant_id, note_id))"
        )


def notes(store: MemoryStore, tenant_id: str) -> set[str]:
    with store.transaction() as conn:
        return {r[0] for r in conn.execute("SELECT note_id FROM derived.toy_notes WHERE tenant_id = %s", (tenant_id,))}


def sync(derived: DerivedStores, *, tenant_id: str, progress: Progress = no_progress) -> Synced:
    """A note per current version, each with its lineage edge; notes of versions no longer current go."""
    with derived.store.transaction() as conn:
        current = conn.execute(
            "SELECT v.memory_id, v.version FROM memory.memories m JOIN memory.memory_versions v"
            " ON v.tenant_id = m.tenant_id AND v.memory_id = m.memory_id AND v.version = m.current_version"
            " WHERE m.tenant_id = %s",
            (tenant_id,),
        ).fetchall()
        want = {f"{m}:{v}": (m, v) for m, v in current}
        have = {r[0] for r in conn.execute("SELECT note_id FROM derived.toy_notes WHERE tenant_id = %s", (tenant_id,))}
        stale = sorted(have - want.keys())
        new = sorted(want.keys() - have)
        conn.execute("DELETE FROM derived.toy_notes WHERE tenant_id = %s AND note_id = ANY(%s)", (tenant_id, stale))
        lineage.remove_records(conn, tenant_id=tenant_id, store=NAME, record_ids=stale)
        for note in new:
            conn.execute(
                "INSERT INTO derived.toy_notes (tenant_id, note_id, memory_id, version) VALUES (%s, %s, %s, %s)",
                (tenant_id, note, *want[note]),
            )
        lineage.insert_edges(conn, tenant_id=tenant_id, store=NAME, records=[(note, want[note]) for note in new])
    return Synced({"records": len(want), "written": len(new), "removed": len(stale)})


def problems(derived: DerivedStores, *, tenant_id: str) -> dict[str, int]:
    """Notes without a lineage edge (must be none)."""
    with derived.store.transaction() as conn:
        row = conn.execute(
            "SELECT count(*) FROM derived.toy_notes n WHERE n.tenant_id = %s AND NOT EXISTS (SELECT 1"
            " FROM derived.lineage l WHERE l.tenant_id = n.tenant_id AND l.store = %s AND l.record_id = n.note_id)",
            (tenant_id, NAME),
        ).fetchone()
    return {"without_lineage": int(row[0]) if row else 0}
