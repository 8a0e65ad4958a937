"""Runtime settings from environment variables, read when asked for, never at import time."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CHROMA_ISOLATIONS",
    "DEFAULT_ANALYTICS_MEMORY_MB",
    "DEFAULT_ANALYTICS_THREADS",
    "DEFAULT_ANALYTICS_TIMEOUT",
    "DEFAULT_BACKGROUND_NICE",
    "DEFAULT_BACKUP_DAYS",
    "DEFAULT_ERASURE_BATCH_MINUTES",
    "DEFAULT_ERASURE_HOURS",
    "DEFAULT_HOME",
    "EMBEDDING_MODELS",
    "ENV_ANALYTICS_MEMORY_MB",
    "ENV_ANALYTICS_THREADS",
    "ENV_ANALYTICS_TIMEOUT",
    "ENV_BACKGROUND_NICE",
    "ENV_BACKUP_DAYS",
    "ENV_CHROMA_ISOLATION",
    "ENV_CHROMA_TOKEN",
    "ENV_CHROMA_URL",
    "ENV_DAGSTER_PG_URL",
    "ENV_DAGSTER_PG_URL_EXPORTED",
    "ENV_EMBEDDING_MODEL",
    "ENV_ERASURE_BATCH_MINUTES",
    "ENV_ERASURE_HOURS",
    "ENV_HOME",
    "ENV_JUDGE_API_KEY",
    "ENV_JUDGE_MODEL",
    "ENV_JUDGE_URL",
    "ENV_KEY_VAULT",
    "ENV_KMS_KEY_ID",
    "ENV_PG_URL",
    "ENV_S3_BUCKET",
    "ENV_S3_ENDPOINT",
    "ENV_S3_PREFIX",
    "ENV_SUMMARIZER_API_KEY",
    "ENV_SUMMARIZER_MODEL",
    "ENV_SUMMARIZER_URL",
    "Settings",
    "lower_priority",
    "niceness",
    "positive_int",
]

ENV_HOME = "MEMORY_PIPELINES_HOME"
ENV_PG_URL = "MEMORY_PIPELINES_PG_URL"
ENV_DAGSTER_PG_URL = "MEMORY_PIPELINES_DAGSTER_PG_URL"
# Set beside ENV_DAGSTER_PG_URL, to the same value, when our commands exported it (computed from a HOME)
# rather than the user: such a value belongs to the HOME it was computed for, not to this process's.
ENV_DAGSTER_PG_URL_EXPORTED = ENV_DAGSTER_PG_URL + "_EXPORTED"
ENV_KMS_KEY_ID = "MEMORY_PIPELINES_KMS_KEY_ID"
ENV_KEY_VAULT = "MEMORY_PIPELINES_KEY_VAULT"
ENV_CHROMA_URL = "MEMORY_PIPELINES_CHROMA_URL"
ENV_CHROMA_TOKEN = "MEMORY_PIPELINES_CHROMA_TOKEN"
ENV_CHROMA_ISOLATION = "MEMORY_PIPELINES_CHROMA_ISOLATION"
ENV_EMBEDDING_MODEL = "MEMORY_PIPELINES_EMBEDDING_MODEL"
ENV_SUMMARIZER_URL = "MEMORY_PIPELINES_SUMMARIZER_URL"
ENV_SUMMARIZER_MODEL = "MEMORY_PIPELINES_SUMMARIZER_MODEL"
ENV_SUMMARIZER_API_KEY = "MEMORY_PIPELINES_SUMMARIZER_API_KEY"
ENV_JUDGE_URL = "MEMORY_PIPELINES_JUDGE_URL"
ENV_JUDGE_MODEL = "MEMORY_PIPELINES_JUDGE_MODEL"
ENV_JUDGE_API_KEY = "MEMORY_PIPELINES_JUDGE_API_KEY"
ENV_S3_BUCKET = "MEMORY_PIPELINES_S3_BUCKET"
ENV_S3_PREFIX = "MEMORY_PIPELINES_S3_PREFIX"
ENV_S3_ENDPOINT = "MEMORY_PIPELINES_S3_ENDPOINT_URL"
ENV_BACKUP_DAYS = "MEMORY_PIPELINES_BACKUP_RETENTION_DAYS"
ENV_ERASURE_HOURS = "MEMORY_PIPELINES_ERASURE_HOURS"
ENV_ERASURE_BATCH_MINUTES = "MEMORY_PIPELINES_ERASURE_BATCH_MINUTES"
ENV_BACKGROUND_NICE = "MEMORY_PIPELINES_BACKGROUND_NICE"
ENV_ANALYTICS_MEMORY_MB = "MEMORY_PIPELINES_ANALYTICS_MEMORY_MB"
ENV_ANALYTICS_THREADS = "MEMORY_PIPELINES_ANALYTICS_THREADS"
ENV_ANALYTICS_TIMEOUT = "MEMORY_PIPELINES_ANALYTICS_TIMEOUT_SECONDS"
DEFAULT_HOME = "./.memory_pipelines"
DEFAULT_BACKUP_DAYS = 35
# A COMPLETE deletion's bytes leave every file within this many hours (the physical erasure run).
DEFAULT_ERASURE_HOURS = 24
# The erasure sensor waits this long after a tenant's first pending deletion, so later ones share
# its rewrite (never past the deadline's last quarter).
DEFAULT_ERASURE_BATCH_MINUTES = 60
# CPU niceness of forget and erasure run workers: background work yields the CPU to recalls.
# Measured on 2 cores: another tenant's recall p99 during a 100-subject forget and its erasure
# went from 5.75x its idle p99 to 1.31x (benchmarks/forget_isolation.py).
DEFAULT_BACKGROUND_NICE = 10
# Bounds of one `analytics --sql` query (DuckDB's memory_limit, threads, and a wall-clock timeout):
# a user's SQL may ask for anything (`range(1e12)`); it gets this much of the machine, then an error.
DEFAULT_ANALYTICS_MEMORY_MB = 1024
DEFAULT_ANALYTICS_THREADS = 2
DEFAULT_ANALYTICS_TIMEOUT = 30
# The embedded Chroma server runs in a network namespace of its own ("netns"), reachable only through
# its token-checking proxy; "none" is the opt-out for a system that cannot make one (lib/infra/chroma_proxy.py).
CHROMA_ISOLATIONS = ("auto", "netns", "none")
# The sentence embedding models (lib/stores/embedding.py); the first is the default. Changing
# it rebuilds each tenant's collection at its next memory_embeddings sync.
EMBEDDING_MODELS = ("all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2")


@dataclass(frozen=True)
class Settings:
    """Where data lives and which engines to use; `pg_url` None means the embedded PostgreSQL."""

    home: Path
    # URLs may carry a password: out of every repr, as the token and the API key are.
    pg_url: str | None = field(default=None, repr=False)
    dagster_pg_url: str | None = field(default=None, repr=False)
    kms_key_id: str | None = None
    key_vault: Path | None = None
    chroma_url: str | None = None
    chroma_token: str | None = field(default=None, repr=False)
    chroma_isolation: str = "auto"
    embedding_model: str = EMBEDDING_MODELS[0]
    summarizer_url: str | None = None
    summarizer_model: str | None = None
    summarizer_api_key: str | None = field(default=None, repr=False)
    s3_bucket: str | None = None
    s3_prefix: str = "memory-pipelines/"
    s3_endpoint_url: str | None = None
    backup_days: int = DEFAULT_BACKUP_DAYS
    erasure_hours: int = DEFAULT_ERASURE_HOURS
    erasure_batch_minutes: int = DEFAULT_ERASURE_BATCH_MINUTES
    background_nice: int = DEFAULT_BACKGROUND_NICE
    analytics_memory_mb: int = DEFAULT_ANALYTICS_MEMORY_MB
    analytics_threads: int = DEFAULT_ANALYTICS_THREADS
    analytics_timeout_seconds: int = DEFAULT_ANALYTICS_TIMEOUT

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        return cls(
            home=Path(env.get(ENV_HOME) or DEFAULT_HOME).expanduser().resolve(),
            pg_url=env.get(ENV_PG_URL) or None,
            dagster_pg_url=_users_dagster_url(env),
            kms_key_id=env.get(ENV_KMS_KEY_ID) or None,
            key_vault=Path(env[ENV_KEY_VAULT]).expanduser().resolve() if env.get(ENV_KEY_VAULT) else None,
            chroma_url=env.get(ENV_CHROMA_URL) or None,
            chroma_token=env.get(ENV_CHROMA_TOKEN) or None,
            chroma_isolation=_choice(ENV_CHROMA_ISOLATION, env.get(ENV_CHROMA_ISOLATION), CHROMA_ISOLATIONS),
            embedding_model=_choice(ENV_EMBEDDING_MODEL, env.get(ENV_EMBEDDING_MODEL), EMBEDDING_MODELS),
            summarizer_url=env.get(ENV_SUMMARIZER_URL) or None,
            summarizer_model=env.get(ENV_SUMMARIZER_MODEL) or None,
            summarizer_api_key=env.get(ENV_SUMMARIZER_API_KEY) or None,
            s3_bucket=env.get(ENV_S3_BUCKET) or None,
            s3_prefix=env.get(ENV_S3_PREFIX) or "memory-pipelines/",
            s3_endpoint_url=env.get(ENV_S3_ENDPOINT) or None,
            backup_days=positive_int(ENV_BACKUP_DAYS, env.get(ENV_BACKUP_DAYS), DEFAULT_BACKUP_DAYS),
            erasure_hours=positive_int(
                ENV_ERASURE_HOURS, env.get(ENV_ERASURE_HOURS), DEFAULT_ERASURE_HOURS, unit="hours"
            ),
            erasure_batch_minutes=positive_int(
                ENV_ERASURE_BATCH_MINUTES,
                env.get(ENV_ERASURE_BATCH_MINUTES),
                DEFAULT_ERASURE_BATCH_MINUTES,
                unit="minutes",
            ),
            background_nice=niceness(ENV_BACKGROUND_NICE, env.get(ENV_BACKGROUND_NICE), DEFAULT_BACKGROUND_NICE),
            analytics_memory_mb=positive_int(
                ENV_ANALYTICS_MEMORY_MB, env.get(ENV_ANALYTICS_MEMORY_MB), DEFAULT_ANALYTICS_MEMORY_MB, unit="MB"
            ),
            analytics_threads=positive_int(
                ENV_ANALYTICS_THREADS, env.get(ENV_ANALYTICS_THREADS), DEFAULT_ANALYTICS_THREADS, unit="threads"
            ),
            analytics_timeout_seconds=positive_int(
                ENV_ANALYTICS_TIMEOUT, env.get(ENV_ANALYTICS_TIMEOUT), DEFAULT_ANALYTICS_TIMEOUT, unit="seconds"
            ),
        )

    @property
    def backups_path(self) -> Path:
        return self.home / "backups"

    @property
    def dagster_home(self) -> Path:
        return self.home / "dagster"

    @property
    def pgdata(self) -> Path:
        return self.home / "pg" / "data"

    @property
    def master_key_path(self) -> Path:
        return self.home / "keys" / "master.key"

    @property
    def key_vault_path(self) -> Path:
        """The key vault: one file per tenant holding its key-encryption key (lib/memories/key_vault.py)."""
        return self.key_vault or self.home / "keys" / "vault"

    @property
    def chroma_path(self) -> Path:
        return self.home / "chroma"

    @property
    def analytics_old_files(self) -> Path:
        """Where an earlier version kept the analytics copy as files; removed by the first write."""
        return self.home / "analytics"


def niceness(name: str, raw: str | None, default: int) -> int:
    """A CPU niceness increment from 0 (none) to 19, from an environment variable (named in the error)."""
    if raw is None or raw == "":
        return default
    from memory_pipelines.lib.infra.errors import ValidationError

    try:
        value = int(raw)
    except ValueError:
        raise ValidationError(name, f"must be a whole number from 0 to 19, got {raw!r}") from None
    if not 0 <= value <= 19:
        raise ValidationError(name, f"must be from 0 to 19, got {value}")
    return value


_LOWERED = False


def lower_priority(settings: Settings) -> int:
    """Make this process background work (forget and erasure run workers): raise its niceness by
    `settings.background_nice`, once per process (os.nice adds up). Returns the niceness now."""
    global _LOWERED
    if _LOWERED or settings.background_nice == 0:
        return os.nice(0)
    _LOWERED = True
    return os.nice(settings.background_nice)


def positive_int(name: str, raw: str | None, default: int, *, unit: str = "days") -> int:
    """A whole number >= 1 (of `unit`) from an environment variable (named in the error), or `default`."""
    if not raw:
        return default
    from memory_pipelines.lib.infra.errors import ValidationError

    try:
        value = int(raw)
    except ValueError:
        raise ValidationError(name, f"must be a whole number of {unit}, got {raw!r}") from None
    if value < 1:
        raise ValidationError(name, f"must be at least 1, got {value}")
    return value


def _choice(name: str, raw: str | None, choices: tuple[str, ...]) -> str:
    """One of `choices` (the first when unset) from an environment variable (named in the error)."""
    if not raw:
        return choices[0]
    if raw not in choices:
        from memory_pipelines.lib.infra.errors import ValidationError

        raise ValidationError(name, f"must be one of {', '.join(choices)}, got {raw!r}")
    return raw


def _users_dagster_url(env: Mapping[str, str]) -> str | None:
    """MEMORY_PIPELINES_DAGSTER_PG_URL when the user set it; None when one of our commands exported
    it for its HOME (a child, or a shell after `env`, may work on another HOME and computes its own)."""
    value = env.get(ENV_DAGSTER_PG_URL) or None
    return None if value is not None and value == env.get(ENV_DAGSTER_PG_URL_EXPORTED) else value
