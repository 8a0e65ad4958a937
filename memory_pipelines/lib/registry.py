"""Store registry: every store that may receive memory-derived data, with what deletion needs to know.

A store without an entry has no delete adapter, so nothing may be written to it (lineage refuses).
"""

from __future__ import annotations

from dataclasses import dataclass

from memory_pipelines.lib.errors import ServiceError


@dataclass(frozen=True)
class StoreSpec:
    name: str
    owner: str
    locator_key: str
    adapter_version: str
    max_completion_seconds: int
    verification: str


# Deletion runs the adapters in this order: copies first, the primary and the keys last, so an
# interrupted job can still read what it has to find (and build paraphrase probes) when it resumes.
STORES: tuple[StoreSpec, ...] = (
    StoreSpec(
        "recall_cache",
        "team:memory-platform",
        "lineage(recall_cache) -> cache_key",
        "recall-cache-v1",
        60,
        "no lineage edge of recall_cache to a target version",
    ),
    StoreSpec(
        "prompt_snapshots",
        "team:agent-runtime",
        "lineage(prompt_snapshots) -> snapshot_id",
        "prompt-snapshots-v1",
        60,
        "no snapshot with a lineage edge to a target version",
    ),
    StoreSpec(
        "chroma",
        "team:memory-platform",
        "memory_id:version (collection per tenant)",
        "chroma-v1",
        600,
        "collection.get(ids=targets) is empty; paraphrase probes return no target",
    ),
    StoreSpec(
        "keyword_index",
        "team:memory-platform",
        "(tenant, memory_id, version)",
        "keyword-index-v1",
        300,
        "no posting for a target; keyword probes return no target",
    ),
    StoreSpec(
        "subject_summaries",
        "team:memory-platform",
        "lineage(subject_summaries) -> subject:U",
        "summaries-v1",
        600,
        "no summary lineage to a target version",
    ),
    StoreSpec(
        "team_summaries",
        "team:memory-platform",
        "lineage(team_summaries) -> team:X",
        "summaries-v1",
        600,
        "no summary lineage to a target version",
    ),
    StoreSpec(
        "analytics",
        "team:analytics",
        "memory_id:version in tenant_id=T partition",
        "analytics-v1",
        600,
        "no Parquet row of a target in the tenant partition",
    ),
    StoreSpec(
        "primary",
        "team:memory-platform",
        "(tenant, memory_id, version)",
        "primary-v1",
        300,
        "no memory_versions row of a target",
    ),
    StoreSpec(
        "key_store",
        "team:security",
        "(tenant, subject) / tenant",
        "keystore-v1",
        60,
        "the subject (SUBJECT) or tenant (TENANT) key no longer exists",
    ),
)
BY_NAME = {spec.name: spec for spec in STORES}
# Stores that receive derived records through lineage (the primary and the key store are the source).
DERIVED_STORES = (
    "chroma",
    "keyword_index",
    "subject_summaries",
    "team_summaries",
    "analytics",
    "recall_cache",
    "prompt_snapshots",
)


def require_registered(store: str) -> None:
    """Refuse writes to a store that deletion cannot reach."""
    if store not in BY_NAME:
        raise ServiceError("store", f"store {store!r} has no registered delete adapter; refusing to write to it")
