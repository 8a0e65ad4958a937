"""The Chroma vector index (ids and scope only, no text)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.stores.registry import StoreCheck, StoreSpec, Synced

if TYPE_CHECKING:
    from memory_pipelines.lib.stores.derived import DerivedStores


__all__ = [
    "SPECS",
    "problems",
    "sync",
]


def sync(derived: DerivedStores, *, tenant_id: str, progress: Progress = no_progress) -> Synced:
    """Embed what is new, drop what is gone; cached recalls go when the index changed."""
    from memory_pipelines.lib.stores.derived import sync_embeddings

    counts = sync_embeddings(derived.store, derived.vectors, tenant_id=tenant_id, progress=progress)
    return Synced(counts, text={"embedding_model": derived.vectors.embedder.name})


def problems(derived: DerivedStores, *, tenant_id: str) -> dict[str, int]:
    return derived.vectors.check(store=derived.store, tenant_id=tenant_id)


SPECS = (
    StoreSpec(
        name="chroma",
        owner="team:memory-platform",
        locator_key="memory_id:version (collection per tenant)",
        adapter_version="chroma-v2",
        older_adapter_versions=("chroma-v1",),
        max_completion_seconds=600,
        verification="collection.get(ids=targets) is empty; paraphrase probes return no target",
        adapter="memory_pipelines.lib.stores.chroma.adapter:ChromaAdapter",
        order=30,
        sealed_by="nothing: Chroma stores embeddings in the clear (no documents)",
        asset="memory_embeddings",
        sync=sync,
        asset_description="Vectors of every current memory for semantic recall (Chroma, ids and scope only, no text).",
        kinds=("chroma",),
        checks=(
            StoreCheck(
                "embeddings_lineage_and_no_documents",
                "Every vector has lineage and a current source version; Chroma holds no documents.",
                problems,
                ("documents", "without_lineage", "not_current"),
            ),
        ),
    ),
)
