"""Every derived store of the memory store, built from Settings, plus the lineage API."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.infra.services import Endpoints, chroma_heartbeat, ensure_chroma
from memory_pipelines.lib.infra.settings import EMBEDDING_MODELS, ENV_EMBEDDING_MODEL, Settings
from memory_pipelines.lib.memories.key_conversion import KeyConversion
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import KeysConverted, LineageRecord, RecordSources
from memory_pipelines.lib.stores import lineage, registry
from memory_pipelines.lib.stores.chroma.index import VectorStore
from memory_pipelines.lib.stores.embedding import Embedder, MiniLMEmbedder
from memory_pipelines.lib.stores.keyword.index import KeywordIndex
from memory_pipelines.lib.stores.recall.recall import Recaller, drop_cache

if TYPE_CHECKING:  # imported where made: a recall or a write needs neither pyarrow nor the summarizers
    from memory_pipelines.lib.stores.analytics.store import AnalyticsStore
    from memory_pipelines.lib.stores.summaries.store import Summarizer, SummaryStore

__all__ = [
    "DerivedStores",
    "chroma_url_for",
    "convert_keys",
    "default_embedder",
    "open_derived",
    "summarizer_from",
    "sync_embeddings",
    "sync_keywords",
    "vector_store_for",
]

_embedders: dict[str, MiniLMEmbedder] = {}
_lazy_lock = threading.Lock()
_embedder_lock = threading.Lock()


def default_embedder(model: str = EMBEDDING_MODELS[0]) -> MiniLMEmbedder:
    """The process-wide all-MiniLM-L6-v2 embedder of `model` (one of EMBEDDING_MODELS: int8 by default);
    its ONNX session is loaded once, lazily."""
    if model not in EMBEDDING_MODELS:
        raise ValidationError(ENV_EMBEDDING_MODEL, f"must be one of {', '.join(EMBEDDING_MODELS)}, got {model!r}")
    with _embedder_lock:
        if model not in _embedders:
            _embedders[model] = MiniLMEmbedder(quantized=model.endswith("-int8"))
        return _embedders[model]


def summarizer_from(settings: Settings) -> Summarizer:
    """The OpenAI-compatible summarizer when its URL is configured, else the extractive default."""
    from memory_pipelines.lib.stores.summaries.store import ExtractiveSummarizer, OpenAICompatibleSummarizer

    if settings.summarizer_url:
        if not settings.summarizer_model:
            raise ValidationError("MEMORY_PIPELINES_SUMMARIZER_MODEL", "is required with a summarizer URL")
        return OpenAICompatibleSummarizer(
            base_url=settings.summarizer_url, model=settings.summarizer_model, api_key=settings.summarizer_api_key
        )
    return ExtractiveSummarizer()


def sync_embeddings(
    store: MemoryStore, vectors: VectorStore, *, tenant_id: str, progress: Progress = no_progress
) -> dict[str, int]:
    """Sync the tenant's vectors (`progress` hears of each embedded batch); cached recalls are
    dropped when the index changed."""
    counts = vectors.sync(store=store, tenant_id=tenant_id, progress=progress)
    if counts["embedded"] or counts["removed"]:
        counts["recall_cache_dropped"] = drop_cache(store, tenant_id=tenant_id)
    return counts


def sync_keywords(store: MemoryStore, *, tenant_id: str) -> dict[str, int]:
    """Sync the tenant's blind keyword index; cached recalls are dropped when it changed."""
    counts = KeywordIndex(store).sync(tenant_id=tenant_id)
    if counts["indexed"] or counts["removed"]:
        counts["recall_cache_dropped"] = drop_cache(store, tenant_id=tenant_id)
    return counts


def convert_keys(
    store: MemoryStore, *, tenant_id: str, backup_days: int, progress: Progress = no_progress
) -> KeysConverted:
    """Seal the tenant's texts written before version keys under keys of their own and retire the
    subject keys that sealed them (lib/memories/key_conversion.py); then sync its keyword index, which
    rewrites the postings of each subject whose key was replaced. Counts only."""
    counts = KeyConversion(store.transaction, store.keys, backup_days=backup_days).convert_tenant(
        tenant_id=tenant_id, progress=progress
    )
    if counts["retired"]:
        counts["postings_rekeyed"] = sync_keywords(store, tenant_id=tenant_id)["rekeyed"]
    return counts


@dataclass
class DerivedStores:
    """Every derived store of one memory store."""

    store: MemoryStore
    vectors: VectorStore
    keywords: KeywordIndex
    summaries: SummaryStore
    analytics: AnalyticsStore
    # The HOME the stores were opened on, for what works on its files (an erasure's scan of every file
    # under HOME); None where the process's environment names it (Settings.from_env).
    settings: Settings | None = field(default=None, repr=False)

    @classmethod
    def lazy(
        cls,
        *,
        store: MemoryStore,
        vectors: Callable[[], VectorStore],
        summaries: Callable[[], SummaryStore],
        analytics: Callable[[], AnalyticsStore],
        settings: Settings | None = None,
    ) -> DerivedStores:
        """The stores with the vector index, summaries and analytics copy made on first use: a step
        that syncs the keyword index must not start a Chroma server or need a summarizer."""
        derived = cls.__new__(cls)
        derived.store = store
        derived.keywords = KeywordIndex(store)
        derived.settings = settings
        derived.__dict__["_factories"] = {"vectors": vectors, "summaries": summaries, "analytics": analytics}
        return derived

    def __getattr__(self, name: str) -> Any:
        # Reached only for a member `lazy` has not made yet (a made one is an ordinary attribute).
        factories = self.__dict__.get("_factories", {})
        if name not in factories:
            raise AttributeError(name)
        with _lazy_lock:
            if name not in self.__dict__:
                self.__dict__[name] = factories[name]()
            return self.__dict__[name]

    @property
    def recaller(self) -> Recaller:
        return Recaller(store=self.store, vectors=self.vectors, keywords=self.keywords)

    def sync_all(self, *, tenant_id: str) -> dict[str, dict[str, int]]:
        """Bring every derived store of the tenant up to date (what `materialize` does without Dagster):
        each registered store's sync, in registry order, by its asset's name."""
        return {
            spec.asset: registry.run_sync(spec, self, tenant_id=tenant_id).counts
            for spec in registry.stores()
            if spec.asset and spec.sync is not None
        }

    def lineage_of_memory(self, *, tenant_id: str, memory_id: str) -> list[LineageRecord]:
        """Every derived record of every version of a memory (store, record_id, version)."""
        validation.check_memory_id("memory_id", memory_id)
        self.store.history(tenant_id=tenant_id, memory_id=memory_id)  # tenant and memory must exist
        with self.store.transaction() as conn:
            return lineage.derived_of_memory(conn, tenant_id=tenant_id, memory_id=memory_id)

    def sources_of_record(self, *, tenant_id: str, record: str) -> RecordSources:
        """The memory versions a derived record `STORE:ID` was made from."""
        if not isinstance(record, str):
            raise ValidationError("record", f"must be a string STORE:ID, got {type(record).__name__}")
        store_name, sep, record_id = record.partition(":")
        if not sep or store_name not in registry.derived_names() or not record_id:
            raise ValidationError("record", f"must be STORE:ID with STORE one of {', '.join(registry.derived_names())}")
        self.store.require_tenant(tenant_id=tenant_id)
        with self.store.transaction() as conn:
            sources = lineage.sources_of_record(conn, tenant_id=tenant_id, store=store_name, record_id=record_id)
        return {"store": store_name, "record_id": record_id, "sources": sources}


def open_derived(
    settings: Settings,
    store: MemoryStore,
    *,
    embedder: Embedder | None = None,
    endpoints: Endpoints | None = None,
) -> DerivedStores:
    """Every derived store; vectors on the Chroma server of `endpoints` (ensure_services' when not given)."""
    embedder = embedder or default_embedder(settings.embedding_model)
    vectors = vector_store_for(settings, embedder=embedder, endpoints=endpoints)

    def summaries() -> SummaryStore:
        from memory_pipelines.lib.stores.summaries.store import SummaryStore

        return SummaryStore(store, summarizer_from(settings))

    def analytics() -> AnalyticsStore:
        from memory_pipelines.lib.stores.analytics.store import AnalyticsStore, QueryLimits

        return AnalyticsStore(store=store, limits=QueryLimits.of(settings), old_files=settings.analytics_old_files)

    return DerivedStores.lazy(
        store=store, vectors=lambda: vectors, summaries=summaries, analytics=analytics, settings=settings
    )


def vector_store_for(settings: Settings, *, embedder: Embedder, endpoints: Endpoints | None = None) -> VectorStore:
    """The Chroma server of these settings: MEMORY_PIPELINES_CHROMA_URL, else HOME's own `chroma run`
    (whose files under HOME/chroma erasures clear too). Never the embedded PersistentClient, which
    is not process-safe."""
    if settings.chroma_url:
        return VectorStore(embedder=embedder, url=settings.chroma_url)
    url = chroma_url_for(settings, endpoints)
    return VectorStore(
        embedder=embedder, url=url, path=settings.chroma_path, revive=functools.partial(ensure_chroma, settings)
    )


_chroma_urls: dict[Path, str] = {}
_chroma_urls_lock = threading.Lock()


def chroma_url_for(settings: Settings, endpoints: Endpoints | None = None) -> str:
    """The URL of HOME's Chroma server, started (like ensure_services does) when none answers;
    cached per process: later calls cost one heartbeat on localhost."""
    if settings.chroma_url:
        return settings.chroma_url
    if endpoints is not None and endpoints.chroma_url:
        with _chroma_urls_lock:
            _chroma_urls[settings.home] = endpoints.chroma_url
        return endpoints.chroma_url
    with _chroma_urls_lock:
        cached = _chroma_urls.get(settings.home)
    if cached is not None and chroma_heartbeat(cached):
        return cached
    url = ensure_chroma(settings)
    with _chroma_urls_lock:
        _chroma_urls[settings.home] = url
    return url
