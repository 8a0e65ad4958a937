"""The key store: tenant, subject, team, group and version keys, and the tenant's key vault file."""

from __future__ import annotations

import psycopg

from memory_pipelines.lib.stores.registry import ALL_SCOPES, KEYS, StoreSpec

__all__ = [
    "SPECS",
    "count",
]


def count(conn: psycopg.Connection, tenant_id: str) -> int:
    """The tenant's subject, team, tenant, group, version and retired keys. A build key lives and dies
    with its summary or snapshot row (the row's trigger destroys it), so it is counted with that record,
    not here: the key store's count is what its own step deletes."""
    row = conn.execute(
        "SELECT (SELECT count(*) FROM keystore.subject_keys WHERE tenant_id = %(t)s)"
        " + (SELECT count(*) FROM keystore.team_keys WHERE tenant_id = %(t)s)"
        " + (SELECT count(*) FROM keystore.tenant_keys WHERE tenant_id = %(t)s)"
        " + (SELECT count(*) FROM keystore.group_keys WHERE tenant_id = %(t)s)"
        " + (SELECT count(*) FROM keystore.version_keys WHERE tenant_id = %(t)s)"
        " + (SELECT count(*) FROM keystore.retired_keys WHERE tenant_id = %(t)s)",
        {"t": tenant_id},
    ).fetchone()
    return int(row[0]) if row else 0


SPECS = (
    StoreSpec(
        name="key_store",
        owner="team:security",
        locator_key="(tenant, memory_id, version) / (tenant, subject) / tenant",
        adapter_version="keystore-v3",
        max_completion_seconds=60,
        verification="the key of every forgotten version, the subject's keys (SUBJECT) or the tenant's keys"
        " (TENANT) no longer exist",
        adapter="memory_pipelines.lib.stores.key_store.adapter:KeyStoreAdapter",
        order=KEYS,
        key_erasure=ALL_SCOPES,
        sealed_by="the tenant's key-encryption key, rotated by the erasure (a destroyed key's wrapped"
        " copies open nothing)",
        derived=False,
        count=count,
    ),
)
