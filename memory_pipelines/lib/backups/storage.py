"""Where encrypted backups live: a folder under HOME by default, or an S3 bucket (AWS, MinIO, moto)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Protocol

from memory_pipelines.lib.infra import artifacts, faults
from memory_pipelines.lib.infra.errors import NotFoundError, ServiceError
from memory_pipelines.lib.infra.owner_only import private_file

__all__ = [
    "LIFECYCLE_RULE_ID",
    "BackupStorage",
    "LocalBackupStorage",
    "S3BackupStorage",
]

LIFECYCLE_RULE_ID = "memory-pipelines-backup-expiry"


class BackupStorage(Protocol):
    """Objects by name; names are `<tenant>/<backup_id>.<suffix>` and never hold content."""

    location: str

    def put_file(self, name: str, path: Path) -> None: ...

    def get_file(self, name: str, path: Path) -> None: ...

    def delete(self, name: str) -> None: ...

    def exists(self, name: str) -> bool: ...

    def ensure_expiry(self, days: int) -> None: ...


class LocalBackupStorage:
    """Backups as files under `root`; their expiry is the backup sweep's job."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.location = str(root)

    def _path(self, name: str) -> Path:
        return self.root / name

    def put_file(self, name: str, path: Path) -> None:
        target = self._path(name)
        # Copied under an announced name (lib/infra/artifacts.py), renamed into place when whole.
        with artifacts.artifact(target.parent, target.name + ".part-") as tmp:
            shutil.copyfile(path, tmp)
            private_file(tmp)
            faults.point("storage.put.copied")
            tmp.replace(target)

    def get_file(self, name: str, path: Path) -> None:
        source = self._path(name)
        if not source.exists():
            raise NotFoundError("backup", f"backup object {name} is missing from {self.location}")
        shutil.copyfile(source, path)

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def exists(self, name: str) -> bool:
        return self._path(name).exists()

    def ensure_expiry(self, days: int) -> None:
        """Nothing to configure: `BackupService.sweep_expired` deletes local backups past their expiry."""


class S3BackupStorage:
    """Backups as S3 objects under `prefix`; a bucket lifecycle rule bounds their lifetime."""

    def __init__(self, *, bucket: str, prefix: str = "", endpoint_url: str | None = None, client: Any = None) -> None:
        import boto3

        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        self.client = client or boto3.client("s3", endpoint_url=endpoint_url)
        self.location = f"s3://{bucket}/{prefix}"

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*args, **kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in {"404", "NoSuchKey", "NotFound"}:
                raise NotFoundError("backup", f"{what}: no such object in {self.location}") from exc
            raise ServiceError("s3", f"{what} failed against {self.location}: {code or exc}") from exc
        except BotoCoreError as exc:
            raise ServiceError("s3", f"{what} failed against {self.location}: {exc}") from exc

    def put_file(self, name: str, path: Path) -> None:
        # upload_file streams in multipart chunks: memory stays flat for large backups.
        self._call("uploading a backup", self.client.upload_file, str(path), self.bucket, self.prefix + name)

    def get_file(self, name: str, path: Path) -> None:
        self._call("downloading a backup", self.client.download_file, self.bucket, self.prefix + name, str(path))

    def delete(self, name: str) -> None:
        self._call("deleting a backup", self.client.delete_object, Bucket=self.bucket, Key=self.prefix + name)

    def exists(self, name: str) -> bool:
        try:
            self._call("looking up a backup", self.client.head_object, Bucket=self.bucket, Key=self.prefix + name)
        except NotFoundError:
            return False
        return True

    def ensure_expiry(self, days: int) -> None:
        """Put (or update) our lifecycle rule on the bucket, keeping every other rule as it is."""
        from botocore.exceptions import ClientError

        try:
            rules = self.client.get_bucket_lifecycle_configuration(Bucket=self.bucket).get("Rules", [])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "NoSuchLifecycleConfiguration":
                raise ServiceError("s3", f"reading the lifecycle of {self.location} failed: {exc}") from exc
            rules = []
        ours = {
            "ID": LIFECYCLE_RULE_ID,
            "Filter": {"Prefix": self.prefix},
            "Status": "Enabled",
            "Expiration": {"Days": days},
        }
        others = [rule for rule in rules if rule.get("ID") != LIFECYCLE_RULE_ID]
        self._call(
            "configuring backup expiry",
            self.client.put_bucket_lifecycle_configuration,
            Bucket=self.bucket,
            LifecycleConfiguration={"Rules": [*others, ours]},
        )

    def lifecycle_days(self) -> int | None:
        """Days of our expiry rule as the bucket reports it (None without one)."""
        rules = self._call(
            "reading the lifecycle", self.client.get_bucket_lifecycle_configuration, Bucket=self.bucket
        ).get("Rules", [])
        for rule in rules:
            if rule.get("ID") == LIFECYCLE_RULE_ID:
                return int(rule["Expiration"]["Days"])
        return None
