"""Dagster resource for the encrypted, versioned memory store."""

from __future__ import annotations

import os
import threading
from typing import ClassVar

import dagster as dg

from memory_pipelines.lib.infra.settings import DEFAULT_HOME, Settings
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.runtime import open_store


class MemoryStoreResource(dg.ConfigurableResource):
    """PostgreSQL memory store; an embedded server under `home` when `pg_url` is empty."""

    home: str = DEFAULT_HOME
    pg_url: str | None = None
    kms_key_id: str | None = None
    key_vault: str | None = None  # the key vault's directory; default HOME/keys/vault

    # One store per process and configuration: opening one starts or finds the server.
    _stores: ClassVar[dict[Settings, MemoryStore]] = {}
    _stores_lock: ClassVar[threading.Lock] = threading.Lock()

    def settings(self) -> Settings:
        # The rest (Chroma's URL and token, S3) as every process reads it: a worker with an external
        # server must not start an embedded one of its own.
        return Settings.from_env(
            {
                **os.environ,
                "MEMORY_PIPELINES_HOME": self.home,
                "MEMORY_PIPELINES_PG_URL": self.pg_url or "",
                "MEMORY_PIPELINES_KMS_KEY_ID": self.kms_key_id or "",
                "MEMORY_PIPELINES_KEY_VAULT": self.key_vault or "",
            }
        )

    def store(self) -> MemoryStore:
        settings = self.settings()
        with self._stores_lock:
            if settings not in self._stores:
                self._stores[settings] = open_store(settings)
            return self._stores[settings]
