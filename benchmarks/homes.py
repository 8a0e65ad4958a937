"""The HOME a benchmark runs in when none is given: new, and gone when the benchmark ends.

A benchmark's HOME holds the memory texts it wrote, in PostgreSQL's files, Chroma's, the analytics
copies and the backups. One given with `--home` is the caller's and stays as it is; a temporary one
has its Dagster processes and services stopped and is removed at exit, an exception or Ctrl-C
included (a SIGKILL leaves it, as it leaves the services running).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

from memory_pipelines.lib.infra.services import stop_services
from memory_pipelines.lib.infra.settings import Settings

__all__ = ["discard", "temporary_home"]


def temporary_home(prefix: str) -> Path:
    """A new HOME under the temporary directory, discarded when the process exits."""
    home = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(discard, home)
    return home


def discard(home: Path) -> None:
    """Everything of `home` ends (its Dagster processes, then its services), then its files go."""
    if home.exists():
        stop_services(Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)}))
        shutil.rmtree(home, ignore_errors=True)
