"""The `demo` command: seeds a demo tenant from assets/demo, walks through versions and sharing
modes, materializes every asset of the tenant through the Dagster instance, shows a recall, a
lineage lookup and an analytics query, then forgets bob (GDPR Art. 17) and prints the proof."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

from memory_pipelines.lib.deletion import DeletionService
from memory_pipelines.lib.derived import DerivedStores, open_derived
from memory_pipelines.lib.paths import ASSETS_DIR
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.services import ensure_services
from memory_pipelines.lib.settings import Settings
from memory_pipelines.lib.store import MemoryStore
from memory_pipelines.lib.validation import SHARING_MODES
from memory_pipelines.materialize import (
    materialize,
    run_backup,
    run_erasure,
    run_forget,
    run_restore,
    run_retention,
)

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
    rolled = store.rollback(tenant_id=tenant, memory_id=first.memory_id, user_id=spec["user"])
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


def store_rows(derived: DerivedStores, tenant: str, user: str) -> list[str]:
    return [m["text"] for m in derived.store.list_visible(tenant_id=tenant, user_id=user)]


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
    tenant = corpus["tenant"]
    run = materialize(settings, tenant)
    derived = open_derived(settings, open_store(settings, endpoints))
    try:
        recall_query = "what should the doctor know before prescribing antibiotics?"
        recalled = derived.recaller.recall(tenant_id=tenant, user_id="alice", query=recall_query, k=2)
        lineage = derived.lineage_of_memory(tenant_id=tenant, memory_id=versions["memory_id"])
        analytics = derived.analytics.query(
            "SELECT category, count(*) AS memories, avg(text_length)::int AS avg_text_length"
            " FROM memories GROUP BY ALL ORDER BY category",
            tenant_id=tenant,
        )
        backup = run_backup(settings, tenant)  # last night's backup, before bob asks to be forgotten
        forget_request = DeletionService(derived).request(tenant_id=tenant, subject="bob", basis="gdpr-art17")
        forget_run = run_forget(settings, tenant, [forget_request["job_id"]])
        # The demo does not wait for the erasure sensor's batch window: the bytes go now, proven.
        erasure_run = run_erasure(settings, tenant)
        service = DeletionService(derived)
        forgotten = service.status(job_id=forget_request["job_id"])
        proof = service.proof(job_id=forget_request["job_id"]) if forgotten["state"] == "COMPLETE" else None
        bob_after = {
            "list": store_rows(derived, tenant, "bob"),
            "recall_mortgage": derived.recaller.recall(tenant_id=tenant, user_id="bob", query="mortgage payments"),
            "team_summary": derived.summaries.read(tenant_id=tenant, scope="team", scope_id=corpus["team"])["summary"],
        }
        # Restoring the backup taken before the deletion must not bring bob back.
        restored = run_restore(settings, tenant, str(backup["backup_id"]))
        report = restored["report"] or {"state": "FAILED", "failures": restored["failures"]}
        bob_after_restore = {
            "list": store_rows(derived, tenant, "bob"),
            "export": list(derived.store.iter_export(tenant_id=tenant, subject="bob")),
            "others_back": {
                user: len(store_rows(derived, tenant, user)) for user in corpus["members"] if user != "bob"
            },
        }
        # In `dagster dev`, restored_tenants_backfill_sensor launches this rebuild as an asset backfill;
        # the demo has no daemon, so it materializes the same assets as one run.
        backfill = materialize(settings, tenant)
        # Last night's retention run of the tenant (the corpus is recent: nothing is due yet).
        yesterday = (datetime.now(UTC).date() - timedelta(days=1)).isoformat()
        swept = run_retention(settings, yesterday, [tenant])
    finally:
        derived.store.close()
    return {
        "tenant": corpus["tenant"],
        "home": str(settings.home),
        "seeded": seeded,
        "versions": versions,
        "sharing_modes": sharing,
        "export_of_alice": {"versions": len(exported), "memories": len({e["memory_id"] for e in exported})},
        "dagster": {
            "run_id": run["run_id"],
            "success": run["success"],
            "materialized": run["assets"],
            "checks": run["checks"],
        },
        "recall": {
            "user": "alice",
            "query": recall_query,
            "results": [{k: r[k] for k in ("memory_id", "version", "text", "score")} for r in recalled],
        },
        "lineage_of_versioned_memory": lineage,
        "analytics": analytics,
        "forget_bob": {
            "run_id": forget_run["run_id"],
            "erasure_run_id": erasure_run["run_id"],
            "state": forgotten["state"],
            "targets": forgotten["targets"],
            "proof": proof,
            "after": bob_after,
        },
        "backup_then_restore": {
            "backup": {k: backup.get(k) for k in ("backup_id", "location", "bytes", "expires_at", "rows_memories")},
            "restore": {
                k: report.get(k) for k in ("state", "loaded", "replayed", "verification", "failures") if k in report
            },
            "bob_after_restore": bob_after_restore,
            "backfill_after_restore": {"success": backfill["success"], "checks": backfill["checks"]},
        },
        "retention": {
            "date": swept["date"],
            "removed": swept["totals"].get("removed", 0),
            "success": swept["success"],
            "run_id": swept["runs"][0]["run_id"] if swept["runs"] else None,
        },
        "next": {
            "ui": f"memory-pipelines --home {settings.home} dev   # then open http://127.0.0.1:3000/assets/memories",
            "what_to_look_at": "Assets: `memories` and the derived_stores group, partition `demo`: counts per "
            "materialization and the asset checks; Runs: the `tenant_refresh`, `forget`, `backup` and `restore` "
            "runs above, launched from the code location (re-executable); sensor `tenant_partitions_sensor` keeps "
            "tenants as partitions; after a restore, `restored_tenants_backfill_sensor` starts a backfill",
            "stop": f"memory-pipelines --home {settings.home} stop",
        },
    }
