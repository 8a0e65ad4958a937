"""Importing this module builds and resolves the project's definitions in this process.

The warm code server's fork server imports it last (`preload` in serve_code.py), so every run worker
forked from it starts with the definitions built; each worker built them again before its first step
(docs/performance.md, "Run workers forked warm"). The fork server stops at any error but an
ImportError, so a build that fails here is left to the worker, which reports it as its own.
"""

from memory_pipelines.definitions import built

try:
    built().get_repository_def()
except Exception:  # the worker builds them again and reports the failure
    pass
