"""The key store: subject, team and tenant keys, and the tenant's key vault file."""

from memory_pipelines.lib.stores.registry import KEYS, StoreSpec

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
    ),
)
