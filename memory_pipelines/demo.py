"""The `demo` command: seeds a demo tenant from assets/demo, walks through versions and sharing
modes, and materializes the tenant's `memories` partition through the Dagster instance."""

from __future__ import annotations

import json
import os
from typing import Any

from memory_pipelines.lib.paths import ASSETS_DIR
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.services import ensure_services
from memory_pipelines.lib.settings import ENV_HOME, Settings
from memory_pipelines.lib.store import MemoryStore
from memory_pipelines.lib.validation import SHARING_MODES

CORPUS = ASSETS_DIR / "demo" / "corpus.json"


def seed(store: MemoryStore, corpus: dict[str, Any]) -> dict[str, Any]:
    """Write the corpus; identical re-writes are no-ops, so the demo can run again."""
    tenant = corpus["tenant"]
    store.create_tenant(tenant_id=tenant, sharing_mode="strict")
    for member in corpus["members"]:
        store.add_team_member(tenant_id=tenant, team_id=corpus["team"], user_id=member)
    written = [
        store.write(
            tenant_id=tenant,
            user_id=item["user"],
            text=item["text"],
            team_id=item.get("team"),
            shareable=item.get("shareable"),
            category=item.get("category"),
            original_query=item.get("original_query"),
            do_not_sell=item.get("do_not_sell"),
        )
        for item in corpus["memories"]
    ]
    return {"memories": len(written), "new_writes": sum(r.changed for r in written)}


def show_versions(store: MemoryStore, corpus: dict[str, Any]) -> dict[str, Any]:
    spec, tenant = corpus["versioned"], corpus["tenant"]
    first = store.write(tenant_id=tenant, user_id=spec["user"], text=spec["first"], category=spec["category"])
    second = store.write(tenant_id=tenant, user_id=spec["user"], text=spec["second"], memory_id=first.memory_id)
    rolled = store.rollback(tenant_id=tenant, memory_id=first.memory_id)
    history = store.history(tenant_id=tenant, memory_id=first.memory_id)
    return {
        "memory_id": first.memory_id,
        "updated_to_version": second.version,
        "rolled_back_to_version": rolled["version"],
        "history": [{k: h[k] for k in ("version", "text", "current", "restored_from")} for h in history[-3:]],
        "total_versions": len(history),
    }


def show_sharing_modes(store: MemoryStore, corpus: dict[str, Any]) -> dict[str, Any]:
    tenant, team = corpus["tenant"], corpus["team"]
    views: dict[str, Any] = {}
    for mode in SHARING_MODES:
        store.set_sharing_mode(tenant_id=tenant, sharing_mode=mode)
        views[mode] = {
            member: [
                f"{m['user_id']}: {m['text']}"
                for m in store.list_visible(tenant_id=tenant, user_id=member, team_id=team)
            ]
            for member in corpus["members"]
        }
    store.set_sharing_mode(tenant_id=tenant, sharing_mode="strict")
    views["personal_view_of_alice"] = [m["text"] for m in store.list_visible(tenant_id=tenant, user_id="alice")]
    return views


def materialize_memories(settings: Settings, tenant: str) -> dict[str, Any]:
    """Runs the `memories_snapshot` job in-process against the persistent instance (shows in the UI)."""
    import dagster as dg

    from memory_pipelines.definitions import defs

    os.environ["DAGSTER_HOME"] = str(settings.dagster_home)
    os.environ[ENV_HOME] = str(settings.home)
    with dg.DagsterInstance.get() as instance:
        if not instance.has_dynamic_partition("tenants", tenant):
            instance.add_dynamic_partitions("tenants", [tenant])
        job = defs().resolve_job_def("memories_snapshot")
        result = job.execute_in_process(instance=instance, partition_key=tenant, raise_on_error=True)
        event = instance.get_latest_materialization_event(dg.AssetKey("memories"))
        metadata = event.asset_materialization.metadata if event and event.asset_materialization else {}
        return {
            "run_id": result.run_id,
            "success": result.success,
            "materialized_counts": {k: getattr(v, "value", None) for k, v in metadata.items()},
        }


def run_demo(settings: Settings) -> dict[str, Any]:
    corpus = json.loads(CORPUS.read_text(encoding="utf-8"))
    endpoints = ensure_services(settings)
    store = open_store(settings, endpoints)
    try:
        seeded = seed(store, corpus)
        versions = show_versions(store, corpus)
        sharing = show_sharing_modes(store, corpus)
        exported = list(store.iter_export(tenant_id=corpus["tenant"], subject="alice"))
    finally:
        store.close()
    dagster = materialize_memories(settings, corpus["tenant"])
    return {
        "tenant": corpus["tenant"],
        "home": str(settings.home),
        "seeded": seeded,
        "versions": versions,
        "sharing_modes": sharing,
        "export_of_alice": {"versions": len(exported), "memories": len({e["memory_id"] for e in exported})},
        "dagster": dagster,
        "next": {
            "ui": f"memory-pipelines --home {settings.home} dev   # then open http://127.0.0.1:3000/assets/memories",
            "what_to_look_at": "asset `memories`, partition `demo`: counts per materialization and the "
            "store_integrity check; sensor `tenant_partitions_sensor` adds tenants as partitions",
            "stop": f"memory-pipelines --home {settings.home} stop",
        },
    }
