"""What every part of the backup service shares: the memory store, the backup storage, the scratch
directory, the retention in days, and the test hooks called between a restore's steps."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from memory_pipelines.lib.backups.storage import BackupStorage
from memory_pipelines.lib.infra.owner_only import private_dir
from memory_pipelines.lib.memories.store import MemoryStore

__all__ = [
    "BackupServiceBase",
    "Hook",
]

Hook = Callable[[str], None]


class BackupServiceBase:
    """The state of a BackupService (set by its constructor) and the helpers all its parts use."""

    store: MemoryStore
    storage: BackupStorage
    staging: Path
    days: int
    hooks: dict[str, Hook]

    @contextmanager
    def _scratch(self) -> Iterator[Path]:
        # Scratch files hold ciphertext columns and ids only; they are removed whatever happens.
        private_dir(self.staging)
        path = Path(tempfile.mkdtemp(prefix="scratch-", dir=self.staging))  # mkdtemp: 0700
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)

    def _hook(self, step: str) -> None:
        if step in self.hooks:
            self.hooks[step](step)
