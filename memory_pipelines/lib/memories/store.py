"""The versioned, encrypted memory store on PostgreSQL (source of truth for every derived store).

A memory has a stable `memory_id` and an append-only list of versions; exactly one is current.
Text is sealed under its author's subject key with (tenant, memory_id, version) as associated data,
so no plaintext reaches the database, its WAL or its backups.

`MemoryStore` is assembled here from one part per concern, each in a module of its own:
connections.py (pool, transactions), tenants.py (tenants, subjects, change sequence), teams.py,
sealing.py (texts at rest), versions.py (heads, rollback, history), writes.py (writes, do-not-sell),
visibility.py (who sees what), derived_reads.py (what derived stores read), export.py and
statistics.py. Names other modules import from here are re-exported unchanged.
"""

from __future__ import annotations

from memory_pipelines.lib.memories.connections import POOL_IDLE, ConnectionsMixin
from memory_pipelines.lib.memories.derived_reads import DerivedReadsMixin
from memory_pipelines.lib.memories.export import EXPORT_BATCH, ExportMixin
from memory_pipelines.lib.memories.keys import KeyStore
from memory_pipelines.lib.memories.records import CurrentVersion, WriteResult
from memory_pipelines.lib.memories.sealing import SealingMixin
from memory_pipelines.lib.memories.sealing import query_aad as query_aad
from memory_pipelines.lib.memories.sealing import text_aad as text_aad
from memory_pipelines.lib.memories.statistics import StatisticsMixin
from memory_pipelines.lib.memories.teams import TeamsMixin
from memory_pipelines.lib.memories.tenants import TenantsMixin
from memory_pipelines.lib.memories.versions import VersionsMixin, repair_heads
from memory_pipelines.lib.memories.visibility import VisibilityMixin, visible_candidates_sql
from memory_pipelines.lib.memories.write_rules import DEFAULT_CATEGORY, DEFAULT_CONFIDENCE
from memory_pipelines.lib.memories.writes import WritesMixin

__all__ = [
    "DEFAULT_CATEGORY",
    "DEFAULT_CONFIDENCE",
    "EXPORT_BATCH",
    "POOL_IDLE",
    "CurrentVersion",
    "MemoryStore",
    "WriteResult",
    "repair_heads",
    "visible_candidates_sql",
]


class MemoryStore(
    WritesMixin,
    VersionsMixin,
    VisibilityMixin,
    DerivedReadsMixin,
    ExportMixin,
    StatisticsMixin,
    TeamsMixin,
    TenantsMixin,
    SealingMixin,
    ConnectionsMixin,
):
    """API over the memory and key-store schemas. Methods take keyword arguments only."""

    def __init__(self, conninfo: str, keys: KeyStore) -> None:
        super().__init__(conninfo)
        self.keys = keys
