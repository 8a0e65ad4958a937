"""What every part of the backup service shares: the memory store, the backup storage, the scratch
directory, the retention in days, and the test hooks called between a restore's steps."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from memory_pipelines.lib.backups.storage import BackupStorage
from memory_pipelines.lib.infra import artifacts, faults
from memory_pipelines.lib.infra.home import LEGACY_SCRATCH
from memory_pipelines.lib.memories.store import MemoryStore

__all__ = [
    "BackupContext",
    "Hook",
]

Hook = Callable[[str], None]


@dataclass(frozen=True)
class BackupContext:
    """The state the backup service's parts share, and the scratch directories and hooks they use."""

    store: MemoryStore
    storage: BackupStorage
    staging: Path
    days: int = 35
    hooks: dict[str, Hook] = field(default_factory=dict)

    @contextmanager
    def scratch(self, tenant_id: str) -> Iterator[Path]:
        """A scratch directory of the tenant's (ciphertext columns and ids), announced before it is made
        (lib/infra/artifacts.py): removed when the block ends, or by the next sweep once its process is
        gone, whatever killed it. Every backup and restore sweeps first."""
        artifacts.sweep(self.staging)
        artifacts.remove_unannounced(self.staging, LEGACY_SCRATCH)
        with artifacts.artifact(self.staging, "scratch-", owner=tenant_id, directory=True) as path:
            yield path

    def hook(self, step: str) -> None:
        """A restore reached `step`: its fault point, then the test hook registered for it, if any."""
        faults.point("restore." + step)
        if step in self.hooks:
            self.hooks[step](step)
