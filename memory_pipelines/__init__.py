"""memory_pipelines: the data lifecycle of an AI assistant's long-term memory, on Dagster.

`from memory_pipelines import MemoryPlatform` is the Python entry point (memory_pipelines/platform/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memory_pipelines.platform import DeletionHandle, MemoryPlatform

__all__ = ["DeletionHandle", "MemoryPlatform"]


def __getattr__(name: str) -> Any:
    # Imported on first use: every `memory_pipelines.*` import (Dagster definitions, the CLI) runs
    # this package's __init__, and the platform pulls in the store and its engines.
    if name in __all__:
        from memory_pipelines import platform

        return getattr(platform, name)
    raise AttributeError(f"module 'memory_pipelines' has no attribute {name!r}")
