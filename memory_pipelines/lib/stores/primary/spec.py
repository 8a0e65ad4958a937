"""The primary store: the memory versions themselves (sealed text and query), the source of every copy."""

from __future__ import annotations

import psycopg

from memory_pipelines.lib.stores.registry import ALL_SCOPES, PRIMARY, StoreSpec

__all__ = [
    "SPECS",
    "count",
]


def count(conn: psycopg.Connection, tenant_id: str) -> int:
    """The tenant's memory versions."""
    row = conn.execute("SELECT count(*) FROM memory.memory_versions WHERE tenant_id = %s", (tenant_id,)).fetchone()
    return int(row[0]) if row else 0


SPECS = (
    StoreSpec(
        name="primary",
        owner="team:memory-platform",
        locator_key="(tenant, memory_id, version)",
        adapter_version="primary-v2",
        max_completion_seconds=300,
        verification="no memory_versions row of a target",
        adapter="memory_pipelines.lib.stores.primary.adapter:PrimaryAdapter",
        order=PRIMARY,
        key_erasure=ALL_SCOPES,
        sealed_by="each version's own key (versions written before version keys: their author's subject key)",
        derived=False,
        count=count,
    ),
)
