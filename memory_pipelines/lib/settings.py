"""Runtime settings from environment variables, read when asked for, never at import time."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_HOME = "MEMORY_PIPELINES_HOME"
ENV_PG_URL = "MEMORY_PIPELINES_PG_URL"
ENV_DAGSTER_PG_URL = "MEMORY_PIPELINES_DAGSTER_PG_URL"
ENV_KMS_KEY_ID = "MEMORY_PIPELINES_KMS_KEY_ID"
DEFAULT_HOME = "./.memory_pipelines"


@dataclass(frozen=True)
class Settings:
    """Where data lives and which engines to use; `pg_url` None means the embedded PostgreSQL."""

    home: Path
    pg_url: str | None = None
    dagster_pg_url: str | None = None
    kms_key_id: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        return cls(
            home=Path(env.get(ENV_HOME) or DEFAULT_HOME).expanduser().resolve(),
            pg_url=env.get(ENV_PG_URL) or None,
            dagster_pg_url=env.get(ENV_DAGSTER_PG_URL) or None,
            kms_key_id=env.get(ENV_KMS_KEY_ID) or None,
        )

    @property
    def dagster_home(self) -> Path:
        return self.home / "dagster"

    @property
    def pgdata(self) -> Path:
        return self.home / "pg" / "data"

    @property
    def master_key_path(self) -> Path:
        return self.home / "keys" / "master.key"
