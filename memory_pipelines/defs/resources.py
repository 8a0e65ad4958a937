"""The one place that decides local (embedded) versus production resources, from the environment."""

import os

import dagster as dg

from memory_pipelines.lib.infra import settings as env
from memory_pipelines.lib.notify import config as notify
from memory_pipelines.resources import (
    AnalyticsResource,
    BackupResource,
    ChromaResource,
    JudgeResource,
    MemoryStoreResource,
    NotifierResource,
    SummarizerResource,
)


def _env_or(name: str, default: str | None) -> dg.EnvVar | str | None:
    # Read at definitions load, not import; EnvVar keeps the value out of the UI and run config.
    return dg.EnvVar(name) if os.environ.get(name) else default


@dg.definitions
def resources() -> dg.Definitions:
    home = _env_or(env.ENV_HOME, env.DEFAULT_HOME)
    return dg.Definitions(
        resources={
            "memory_store": MemoryStoreResource(
                home=home,  # type: ignore[arg-type]
                pg_url=_env_or(env.ENV_PG_URL, None),
                kms_key_id=_env_or(env.ENV_KMS_KEY_ID, None),
                key_vault=_env_or(env.ENV_KEY_VAULT, None),
            ),
            "chroma": ChromaResource(
                home=home,  # type: ignore[arg-type]
                url=_env_or(env.ENV_CHROMA_URL, None),
                embedding_model=_env_or(env.ENV_EMBEDDING_MODEL, env.EMBEDDING_MODELS[0]),  # type: ignore[arg-type]
            ),
            "summarizer": SummarizerResource(
                base_url=_env_or(env.ENV_SUMMARIZER_URL, None),
                model=_env_or(env.ENV_SUMMARIZER_MODEL, None),
                api_key=_env_or(env.ENV_SUMMARIZER_API_KEY, None),
            ),
            "analytics": AnalyticsResource(home=home),  # type: ignore[arg-type]
            "judge": JudgeResource(
                base_url=_env_or(env.ENV_JUDGE_URL, None),
                model=_env_or(env.ENV_JUDGE_MODEL, None),
                api_key=_env_or(env.ENV_JUDGE_API_KEY, None),
            ),
            "backups": BackupResource(
                home=home,  # type: ignore[arg-type]
                s3_bucket=_env_or(env.ENV_S3_BUCKET, None),
                s3_prefix=_env_or(env.ENV_S3_PREFIX, "memory-pipelines/"),  # type: ignore[arg-type]
                s3_endpoint_url=_env_or(env.ENV_S3_ENDPOINT, None),
                retention_days=env.positive_int(
                    env.ENV_BACKUP_DAYS, os.environ.get(env.ENV_BACKUP_DAYS), env.DEFAULT_BACKUP_DAYS
                ),
            ),
            "notifier": NotifierResource(**{field: _env_or(name, None) for field, name in notify.FIELDS.items()}),
        }
    )
