"""Dagster resources for the derived stores: Chroma, the summarizer and the analytics copy."""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import ClassVar

import dagster as dg

from memory_pipelines.lib.infra.services import ensure_chroma
from memory_pipelines.lib.infra.settings import DEFAULT_HOME, ENV_CHROMA_URL, ENV_HOME, Settings
from memory_pipelines.lib.infra.settings import EMBEDDING_MODELS as MODELS
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.stores.analytics.store import AnalyticsStore
from memory_pipelines.lib.stores.chroma.index import VectorStore
from memory_pipelines.lib.stores.derived import DerivedStores, chroma_url_for
from memory_pipelines.lib.stores.embedding import Embedder, HashingEmbedder
from memory_pipelines.lib.stores.summaries.store import (
    ExtractiveSummarizer,
    OpenAICompatibleSummarizer,
    Summarizer,
    SummaryStore,
)
from memory_pipelines.resources.memory_store import MemoryStoreResource

EMBEDDING_MODELS = (*MODELS, "hashing-test-only")


class ChromaResource(dg.ConfigurableResource):
    """Chroma vector index on a Chroma server: the one at `url`, else `home`'s own `chroma run`
    server (started by ensure_services with the embedded PostgreSQL, shared by every process)."""

    home: str = DEFAULT_HOME
    url: str | None = None
    embedding_model: str = MODELS[0]

    _stores: ClassVar[dict[tuple[str, str, str], VectorStore]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def _embedder(self) -> Embedder:
        if self.embedding_model in MODELS:
            from memory_pipelines.lib.stores.derived import default_embedder

            return default_embedder(self.embedding_model)
        if self.embedding_model == "hashing-test-only":
            return HashingEmbedder()
        raise dg.Failure(f"embedding_model must be one of {', '.join(EMBEDDING_MODELS)}")

    def settings(self) -> Settings:
        # The rest (the database's URL, Chroma's token) as every process reads it: a worker with an
        # external server must not start an embedded one of its own.
        return Settings.from_env({**os.environ, ENV_HOME: self.home, ENV_CHROMA_URL: self.url or ""})

    def vector_store(self) -> VectorStore:
        settings = self.settings()
        # Cheap after the first call per process: a cached URL and one heartbeat.
        url = chroma_url_for(settings)
        key = (str(settings.home), url, self.embedding_model)
        with self._lock:
            if key not in self._stores:
                embedder = self._embedder()
                own = not settings.chroma_url  # HOME's server: started again if it dies under a long run
                self._stores[key] = VectorStore(
                    embedder=embedder,
                    url=url,
                    path=settings.chroma_path if own else None,
                    revive=functools.partial(ensure_chroma, settings) if own else None,
                )
            return self._stores[key]


class SummarizerResource(dg.ConfigurableResource):
    """Extractive summaries offline by default; an OpenAI-compatible endpoint when `base_url` is set."""

    base_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    timeout_seconds: float = 60.0

    def summarizer(self) -> Summarizer:
        if not self.base_url:
            return ExtractiveSummarizer()
        if not self.model:
            raise dg.Failure("summarizer: a model is required with base_url (MEMORY_PIPELINES_SUMMARIZER_MODEL)")
        return OpenAICompatibleSummarizer(
            base_url=self.base_url, model=self.model, api_key=self.api_key, timeout=self.timeout_seconds
        )


class AnalyticsResource(dg.ConfigurableResource):
    """The analytics copy in the memory store's PostgreSQL, queried with DuckDB.

    `home` is only where an earlier version kept the copy as files (`home`/analytics), which the
    first write removes."""

    home: str = DEFAULT_HOME

    def analytics(self, *, store: MemoryStore) -> AnalyticsStore:
        """The analytics store of `store`'s database; its queries hide what accepted deletions hide."""
        return AnalyticsStore(store=store, old_files=Path(self.home).resolve() / "analytics")


def derived_stores(
    memory_store: MemoryStoreResource,
    chroma: ChromaResource,
    summarizer: SummarizerResource,
    analytics: AnalyticsResource,
) -> DerivedStores:
    """Every derived store of the configured resources, as the pure-logic layer takes them."""
    store = memory_store.store()
    # Made on first use: a step syncing the keyword index starts no Chroma server, needs no summarizer.
    return DerivedStores.lazy(
        store=store,
        vectors=chroma.vector_store,
        summaries=lambda: SummaryStore(store, summarizer.summarizer()),
        analytics=lambda: analytics.analytics(store=store),
    )
