"""Store registry: every store that may receive memory-derived data, with what deletion needs to know.

A store without an entry has no delete adapter, so nothing may be written to it (lineage refuses).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import Any

from memory_pipelines.lib.infra.errors import ServiceError


@dataclass(frozen=True)
class StoreSpec:
    name: str
    owner: str
    locator_key: str
    adapter_version: str
    max_completion_seconds: int
    verification: str
    adapter: str  # "module:Class" of its deletion adapter (see adapters/base.py)


# Deletion runs the adapters in this order: copies first, the primary and the keys last, so an
# interrupted job can still read what it has to find (and build paraphrase probes) when it resumes.
STORES: tuple[StoreSpec, ...] = (
    StoreSpec(
        "recall_cache",
        "team:memory-platform",
        "lineage(recall_cache) -> cache_key; cached answers by the versions they name and by asker",
        "recall-cache-v2",
        60,
        "no cached answer naming a target version or asked by a forgotten subject",
        "memory_pipelines.lib.stores.recall_cache.adapter:RecallCacheAdapter",
    ),
    StoreSpec(
        "prompt_snapshots",
        "team:agent-runtime",
        "lineage(prompt_snapshots) -> snapshot_id",
        "prompt-snapshots-v2",
        60,
        "no snapshot with a lineage edge to a target version",
        "memory_pipelines.lib.stores.prompt_snapshots.adapter:PromptSnapshotsAdapter",
    ),
    StoreSpec(
        "chroma",
        "team:memory-platform",
        "memory_id:version (collection per tenant)",
        "chroma-v2",
        600,
        "collection.get(ids=targets) is empty; paraphrase probes return no target",
        "memory_pipelines.lib.stores.vectors.adapter:ChromaAdapter",
    ),
    StoreSpec(
        "keyword_index",
        "team:memory-platform",
        "(tenant, memory_id, version)",
        "keyword-index-v2",
        300,
        "no posting for a target; keyword probes return no target",
        "memory_pipelines.lib.stores.keyword.adapter:KeywordIndexAdapter",
    ),
    StoreSpec(
        "subject_summaries",
        "team:memory-platform",
        "lineage(subject_summaries) -> subject:U",
        "summaries-v2",
        600,
        "no summary lineage to a target version",
        "memory_pipelines.lib.stores.summaries.adapter:SubjectSummariesAdapter",
    ),
    StoreSpec(
        "team_summaries",
        "team:memory-platform",
        "lineage(team_summaries) -> team:X",
        "summaries-v2",
        600,
        "no summary lineage to a target version",
        "memory_pipelines.lib.stores.summaries.adapter:TeamSummariesAdapter",
    ),
    StoreSpec(
        "analytics",
        "team:analytics",
        "memory_id:version in the tenant=<hash of T> partition (rows carry tenant_id)",
        "analytics-v1",
        600,
        "no Parquet row of a target in the tenant partition",
        "memory_pipelines.lib.stores.analytics.adapter:AnalyticsAdapter",
    ),
    StoreSpec(
        "primary",
        "team:memory-platform",
        "(tenant, memory_id, version)",
        "primary-v2",
        300,
        "no memory_versions row of a target",
        "memory_pipelines.lib.stores.primary.adapter:PrimaryAdapter",
    ),
    StoreSpec(
        "key_store",
        "team:security",
        "(tenant, subject) / tenant",
        "keystore-v2",
        60,
        "the subject (SUBJECT) or tenant (TENANT) key no longer exists",
        "memory_pipelines.lib.stores.key_store.adapter:KeyStoreAdapter",
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


@cache
def adapter(name: str) -> Any:
    """The deletion adapter object of a registered store (imported on first use: adapters import
    the store modules, which import this registry)."""
    module, _, cls = BY_NAME[name].adapter.partition(":")
    return getattr(importlib.import_module(module), cls)()


def require_registered(store: str) -> None:
    """Refuse writes to a store that deletion cannot reach."""
    if store not in BY_NAME:
        raise ServiceError("store", f"store {store!r} has no registered delete adapter; refusing to write to it")
