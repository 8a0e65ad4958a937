"""The toy store's declaration: everything the platform needs to know of it."""

from memory_pipelines.lib.stores.registry import StoreCheck, StoreSpec
from tests.support.toy_store.adapter import ToyAdapter
from tests.support.toy_store.store import NAME, problems, sync

SPECS = (
    StoreSpec(
        name=NAME,
        owner="team:toy",
        locator_key="lineage(toy_notes) -> memory_id:version",
        adapter_version="toy-v1",
        max_completion_seconds=60,
        verification="no toy note of a target",
        adapter=ToyAdapter,
        order=80,  # a copy: after the analytics copy, before the primary
        asset="toy_notes",
        sync=sync,
        asset_description="A toy copy of every current memory version's id, to prove a store is one package.",
        checks=(StoreCheck("toy_notes_lineage", "Every toy note has lineage.", problems, ("without_lineage",)),),
        restore_drop="DELETE FROM derived.toy_notes WHERE tenant_id = %(t)s AND note_id = ANY(%(ids)s)",
    ),
)
