"""Python children never import from a place the caller does not own.

`python -m x` and `python -c ...` put the working directory first on `sys.path`, and PYTHONPATH adds
more: started from a directory another local user can write (as /tmp is), a child would import that
user's `duckdb.py` or `dagster.py` and run it as us. The children we start run with `-I` (no working
directory, user site or PYTHON* variable) from a directory of ours; the ones Dagster starts for us
(code servers, run workers, `dg dev`'s processes) inherit an environment from `isolated_env`, which
Python 3.11+ reads the same way (PYTHONSAFEPATH).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager

__all__ = [
    "ISOLATED",
    "children_isolated",
    "isolated_env",
]

# The interpreter flag for the children we start: isolated mode.
ISOLATED = "-I"
# Variables that add directories to a child's imports.
_IMPORT_PATHS = ("PYTHONPATH", "PYTHONUSERBASE")
_SAFE = {"PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1"}


def isolated_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a Python child someone else starts for us: no working directory or script directory
    first on its path, no user site, no PYTHONPATH."""
    return {**{k: v for k, v in env.items() if k not in _IMPORT_PATHS}, **_SAFE}


@contextmanager
def children_isolated(environ: MutableMapping[str, str] = os.environ) -> Iterator[None]:
    """The same for every child this process starts meanwhile; then the environment is as it was
    (this process's own imports are never changed, nor the children it starts later)."""
    saved = {name: environ.get(name) for name in (*_IMPORT_PATHS, *_SAFE)}
    for name in _IMPORT_PATHS:
        environ.pop(name, None)
    environ.update(_SAFE)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
