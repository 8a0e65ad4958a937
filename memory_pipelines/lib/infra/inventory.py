"""Every path the code writes under HOME: what it is, which host needs it, where it lives in production.

One host today holds all of HOME. In production (docs/operating.md, Production: the Dagster
Helm chart, every run a pod of its own) each host has a HOME of its own, empty at start, and what
more than one host must see cannot live there. This table is the one place that says, for each
path, which is which; `tests/integration/test_private_files.py` walks a HOME after the whole lifecycle
and fails on a path no entry covers, and the table in docs/operating.md is checked against it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

__all__ = [
    "INVENTORY",
    "Entry",
    "entry_for",
    "unlisted",
]


@dataclass(frozen=True)
class Entry:
    """`pattern`: a path relative to HOME; `*` matches within one name, a trailing `/**` the
    directory and everything below it. `hosts`: which hosts read or write it. `production`: where it lives there."""

    pattern: str
    what: str
    hosts: str
    production: str


_EACH = "each host, its own"
INVENTORY: tuple[Entry, ...] = (
    Entry(".services.lock", "orders the start of HOME's embedded servers", _EACH, "each pod's HOME"),
    Entry("pg", "the embedded PostgreSQL (0711 as root)", "the host of its server", "none: a managed PostgreSQL"),
    Entry(
        "pg/data/**",
        "its data directory (PostgreSQL's own files)",
        "the host of its server",
        "none: a managed PostgreSQL",
    ),
    Entry("pg/.embedded-postgres.lock", "orders its starts", "the host of its server", "none: a managed PostgreSQL"),
    Entry(
        "pg/.socket-dir",
        "where its socket is, when HOME is too deep for one (a `mp-pg-*` directory in the temporary"
        " directory, used at every start; swept by the next HOME that makes one once this HOME is gone)",
        "the host of its server",
        "none",
    ),
    Entry("keys", "key material", "", ""),
    Entry("keys/master.key", "the local master key", "every host", "none: KMS (MEMORY_PIPELINES_KMS_KEY_ID)"),
    Entry("keys/vault", "the key vault", "every host", "one shared volume (MEMORY_PIPELINES_KEY_VAULT)"),
    Entry(
        "keys/vault/*",
        "a tenant's sealed KEK (and its artifact lock while made)",
        "every host",
        "the shared vault volume",
    ),
    Entry("dagster", "the Dagster instance's home (DAGSTER_HOME)", _EACH, "each pod, from the Helm values"),
    Entry("dagster/dagster.yaml", "the instance configuration", _EACH, "the Helm values' ConfigMap"),
    Entry("dagster/workspace.yaml", "the code location, for --verbose and dev", _EACH, "the Helm values' workspace"),
    Entry(
        "dagster/**",
        "Dagster's local files: compute logs, artifacts",
        _EACH,
        "each pod (compute logs: the chart's log manager)",
    ),
    Entry("logs", "the CLI's logs", _EACH, "each pod"),
    Entry("logs/*", "the CLI's run log", _EACH, "each pod"),
    Entry("chroma", "the embedded Chroma server", "the host of its server", "none: an external Chroma"),
    Entry("chroma/**", "its data, door, token, state and log", "the host of its server", "none: an external Chroma"),
    Entry(
        "backups",
        "local backups, when no bucket is set",
        "every host that backs up or restores",
        "none: S3 (MEMORY_PIPELINES_S3_BUCKET)",
    ),
    Entry(
        "backups/**",
        "sealed backups, manifests, scratch (.staging)",
        "every host that backs up or restores",
        "S3; scratch on each pod",
    ),
)


def entry_for(relative: Path) -> Entry | None:
    """The first entry whose pattern covers `relative` (a path under HOME, relative to it)."""
    text = relative.as_posix()
    for entry in INVENTORY:
        pattern = entry.pattern
        if pattern.endswith("/**"):
            if text == pattern[:-3] or text.startswith(pattern[:-2]):
                return entry
        elif fnmatchcase(text, pattern) and text.count("/") == pattern.count("/"):
            return entry
    return None


def unlisted(home: Path, paths: Iterable[Path]) -> list[Path]:
    """The paths under `home` (absolute) that no entry covers, sorted."""
    return sorted(path for path in paths if entry_for(path.relative_to(home)) is None)
