"""Prompt snapshots: what an agent run showed its model, sealed under the subject's key."""

from memory_pipelines.lib.stores.registry import ALL_SCOPES, StoreSpec

__all__ = [
    "SPECS",
]

SPECS = (
    StoreSpec(
        name="prompt_snapshots",
        owner="team:agent-runtime",
        locator_key="lineage(prompt_snapshots) -> snapshot_id",
        adapter_version="prompt-snapshots-v2",
        max_completion_seconds=60,
        verification="no snapshot with a lineage edge to a target version",
        adapter="memory_pipelines.lib.stores.prompt_snapshots.adapter:PromptSnapshotsAdapter",
        order=20,
        key_erasure=ALL_SCOPES,
        sealed_by="a key of each snapshot, destroyed with it",
        restore_drop="DELETE FROM derived.prompt_snapshots WHERE tenant_id = %(t)s AND snapshot_id = ANY(%(ids)s)",
    ),
)
