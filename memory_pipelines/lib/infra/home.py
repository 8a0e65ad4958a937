"""HOME as a whole: every file of ours under it (what an erasure scans), and what killed processes
left there (removed at the start of every command, and by every erasure).

Every temporary file or directory of ours is an announced artifact (lib/infra/artifacts.py): one whose
maker is gone is a leftover wherever it lies, so the sweep walks the whole of HOME (and the key vault,
when it is elsewhere) rather than a list of places. PostgreSQL's data directory is left to
PostgreSQL: nothing of ours is made there, and the erasure reads it file by file (forget/datadir.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from memory_pipelines.lib.infra import artifacts
from memory_pipelines.lib.infra.settings import Settings

__all__ = [
    "LEGACY_SCRATCH",
    "LEGACY_VAULT",
    "files",
    "live_artifacts",
    "staging_dir",
    "sweep",
]


# Unannounced leftovers of older releases: backup scratch (mkdtemp's names), vault files being made.
LEGACY_SCRATCH = ("scratch-*",)
LEGACY_VAULT = (".*.tmp",)


def staging_dir(home: Path) -> Path:
    """Where backups and restores of `home` keep their scratch directories."""
    return home / "backups" / ".staging"


def _roots(settings: Settings) -> list[Path]:
    vault = settings.key_vault_path
    return [settings.home] + ([] if vault.is_relative_to(settings.home) else [vault])


def _skip(settings: Settings) -> tuple[Path, ...]:
    return (settings.pgdata,)


def files(settings: Settings, *, skip: tuple[Path, ...] = ()) -> set[Path]:
    """Every regular file under HOME and the key vault, but those under PostgreSQL's data directory
    and the directories of `skip`."""
    found: set[Path] = set()
    skip = (*_skip(settings), *skip)
    for root in _roots(settings):
        for directory, subdirectories, names in os.walk(root):
            subdirectories[:] = [d for d in subdirectories if Path(directory, d) not in skip]
            found |= {Path(directory, n) for n in names if Path(directory, n).is_file()}
    return found


def sweep(settings: Settings) -> list[Path]:
    """Remove every leftover under HOME and the key vault; returns what was removed."""
    removed = []
    for root in _roots(settings):
        removed += artifacts.sweep(root, tree=True, skip=_skip(settings))
    removed += artifacts.remove_unannounced(staging_dir(settings.home), LEGACY_SCRATCH)
    removed += artifacts.remove_unannounced(settings.key_vault_path, LEGACY_VAULT)
    return removed


def live_artifacts(settings: Settings, *, owner: str) -> list[Path]:
    """The artifacts of `owner` (a tenant id) under HOME and the key vault whose makers still run."""
    skip = _skip(settings)
    return [p for root in _roots(settings) for p in artifacts.live(root, owner=owner, tree=True, skip=skip)]
