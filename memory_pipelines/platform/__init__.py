"""`MemoryPlatform`: the one Python entry point to the memory store and everything around it.

    from memory_pipelines import MemoryPlatform

    with MemoryPlatform.from_env() as mp:
        mp.write(tenant_id="acme", user_id="alice", text="Allergic to penicillin")
        mp.recall(tenant_id="acme", user_id="alice", query="which antibiotics?")
        mp.forget(tenant_id="acme", subject="alice").wait()

It holds the existing parts and calls them: the memory store (`open_store`), the derived stores
(`open_derived`, opened on first use: they load the embedding model and reach Chroma), the
deletion service and the backup service. No Dagster: what the CLI runs as Dagster jobs (the
forget cascade, backups, restores) runs here in-process, through the same library calls the
jobs' ops make. Errors are `MemoryPipelinesError` subclasses naming the field.

The `memory-pipelines` CLI is a front end to this class: every command that does not launch a
Dagster run or manage the services calls one method here. Answers are plain dicts typed by the
TypedDicts of `memory_pipelines.lib.results`. The methods live in one plain class per group
(memories, tenants, derived views, forgetting, switches, backups, agent runs and checks: a module
each here), every group on the `PlatformParts` (parts.py) it is given; `MemoryPlatform`
(facade.py) holds one of each and delegates to it. `DeletionHandle` (handle.py) is what `forget`
answers.
"""

from memory_pipelines.platform.facade import MemoryPlatform
from memory_pipelines.platform.handle import DEFAULT_WAIT_SECONDS, DeletionHandle, DeletionTimeout

__all__ = ["DEFAULT_WAIT_SECONDS", "DeletionHandle", "DeletionTimeout", "MemoryPlatform"]
