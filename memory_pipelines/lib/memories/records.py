"""What the memory store hands back: `WriteResult` for a write, `CurrentVersion` for the metadata of
one current version (what derived stores are built from), and `iso` for the timestamps of its
dict answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from memory_pipelines.lib.results import MemoryWrite

__all__ = [
    "CurrentVersion",
    "WriteResult",
    "iso",
]


@dataclass(frozen=True)
class WriteResult:
    tenant_id: str
    memory_id: str
    version: int
    user_id: str
    team_id: str | None
    changed: bool

    def as_dict(self) -> MemoryWrite:
        return {
            "tenant_id": self.tenant_id,
            "memory_id": self.memory_id,
            "version": self.version,
            "user_id": self.user_id,
            "team_id": self.team_id,
            "changed": self.changed,
        }


@dataclass(frozen=True)
class CurrentVersion:
    """Metadata of one current memory version (no text): what derived stores are built from."""

    memory_id: str
    version: int
    user_id: str
    team_id: str | None
    memory_type: str
    shareable: bool
    category: str
    confidence: float
    do_not_sell: bool
    epoch: int
    created_at: datetime
    updated_at: datetime
    version_created_at: datetime

    @property
    def source(self) -> tuple[str, int]:
        return (self.memory_id, self.version)

    @property
    def record_id(self) -> str:
        return f"{self.memory_id}:{self.version}"


def iso(value: datetime | None) -> str | None:
    """A timestamp as ISO 8601 text for a dict answer; None stays None."""
    return None if value is None else value.isoformat()
