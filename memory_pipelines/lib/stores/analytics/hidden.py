"""What accepted deletions hide from a tenant's analytics rows before their cascade reaches the table.

A query leaves these rows out at once: authors being forgotten (by pseudonym), memories forgotten
whole, single versions. A COMPLETE deletion has taken its rows out of the table already.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from memory_pipelines.lib.infra.errors import NotFoundError
from memory_pipelines.lib.memories import ordering
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.stores.analytics.rows import pseudonym, record_ids

__all__ = [
    "Hidden",
    "hidden_now",
]


@dataclass(frozen=True)
class Hidden:
    """What accepted deletions hide from a tenant's analytics rows now, before their cascade reaches
    the table: authors being forgotten (by pseudonym), memories forgotten whole, single versions."""

    pseudonyms: frozenset[str] = frozenset()
    memories: frozenset[str] = frozenset()
    records: frozenset[str] = frozenset()  # memory_id:version
    everything: bool = False  # authors being forgotten, and no tenant key left to name them by

    def __bool__(self) -> bool:
        return self.everything or bool(self.pseudonyms or self.memories or self.records)

    def keep(self, table: pa.Table) -> pa.Table:
        """The rows of `table` (analytics rows) that nothing hides."""
        if self.everything:
            return table.slice(0, 0)
        columns: list[tuple[Callable[[], Any], frozenset[str]]] = [
            (lambda: table["user_pseudonym"], self.pseudonyms),
            (lambda: table["memory_id"], self.memories),
            (lambda: record_ids(table), self.records),
        ]
        masks = [
            pc.fill_null(pc.is_in(column(), value_set=pa.array(sorted(values), pa.string())), False)
            for column, values in columns
            if values
        ]
        if not masks:
            return table
        drop = masks[0]
        for mask in masks[1:]:
            drop = pc.or_(drop, mask)
        return table.filter(pc.invert(drop))


# What accepted deletions whose cascade has not completed hide in one tenant; a COMPLETE one has taken
# its rows out of the table (its verification counts them by exact id). One statement, bound values.
_HIDDEN_NOW = (
    "SELECT 'subject', s.user_id, NULL::int FROM memory.subjects s"
    " WHERE s.tenant_id = %(t)s AND s.forgotten_at IS NOT NULL"
    " UNION ALL SELECT 'memory', j.memory_id, NULL FROM control.deletion_jobs j"
    " WHERE j.tenant_id = %(t)s AND j.state <> 'COMPLETE' AND j.scope = 'MEMORY' AND j.version IS NULL"
    " UNION ALL SELECT CASE WHEN j.scope = 'RETENTION' THEN 'memory' ELSE 'version' END, x.memory_id, x.version"
    " FROM control.deletion_jobs j JOIN control.tombstones x ON x.job_id = j.job_id AND x.tenant_id = %(t)s"
    " WHERE j.tenant_id = %(t)s AND j.state <> 'COMPLETE' AND j.scope IN ('MEMORY', 'RETENTION')"
)


def hidden_now(store: MemoryStore, tenant_id: str) -> Hidden:
    """What analytics reads of `tenant_id` must leave out at this moment; refuses a tenant that is
    unknown, deleted or behind a restore's gate, as every read does.

    One transaction under the tenant's gate lock (shared): no deletion is accepted while it reads,
    so the tenant check and the hidden set are one consistent answer."""
    with store.transaction() as conn:
        ordering.lock_tenant_shared(conn, tenant_id)
        store.require_tenant(tenant_id=tenant_id)  # joins this transaction
        rows = conn.execute(_HIDDEN_NOW, {"t": tenant_id}).fetchall()
        subjects = sorted({str(i) for kind, i, _ in rows if kind == "subject"})
        pseudonyms: frozenset[str] = frozenset()
        if subjects:
            try:
                key = store.keys.tenant_subkey(conn, tenant_id, "analytics-pseudonym", create=False)
            except NotFoundError:
                return Hidden(everything=True)
            pseudonyms = frozenset(pseudonym(key, user_id) for user_id in subjects)
    return Hidden(
        pseudonyms=pseudonyms,
        memories=frozenset(str(i) for kind, i, _ in rows if kind == "memory"),
        records=frozenset(f"{i}:{v}" for kind, i, v in rows if kind == "version"),
    )
