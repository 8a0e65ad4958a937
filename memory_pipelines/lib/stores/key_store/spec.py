"""The key store: subject, team and tenant keys, and the tenant's key vault file."""

from __future__ import annotations

import psycopg

from memory_pipelines.lib.stores.registry import KEYS, StoreSpec

__all__ = [
    "SPECS",
    "count",
]


def count(conn: psycopg.Connection, tenant_id: str) -> int:
    """The tenant's subject, team and tenant keys. A build key lives and dies with its summary or
    snapshot row (the row's trigger destroys it), so it is counted with that record, not here: the key
    store's count is what its own step deletes."""
    row = conn.execute(
        "SELECT (SELECT count(*) FROM keystore.subject_keys WHERE tenant_id = %(t)s)"
        " + (SELECT count(*) FROM keystore.team_keys WHERE tenant_id = %(t)s)"
        " + (SELECT count(*) FROM keystore.tenant_keys WHERE tenant_id = %(t)s)",
        {"t": tenant_id},
    ).fetchone()
    return int(row[0]) if row else 0


SPECS = (
    StoreSpec(
        name="key_store",
        owner="team:security",
        locator_key="(tenant, subject) / tenant",
        adapter_version="keystore-v2",
        max_completion_seconds=60,
        verification="the subject (SUBJECT) or tenant (TENANT) key no longer exists",
        adapter="memory_pipelines.lib.stores.key_store.adapter:KeyStoreAdapter",
        order=KEYS,
        derived=False,
        count=count,
    ),
)
