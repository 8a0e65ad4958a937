"""The `demo` command: seeds a demo tenant from assets/demo, walks through versions and sharing
modes, materializes every asset of the tenant through the Dagster instance, shows a recall, a
lineage lookup and an analytics query, then forgets bob (GDPR Art. 17) and prints the proof. Last,
it evaluates the month that ended and runs a canary drill, as runs of the code location, so that
every asset in the UI has a materialization to show."""

from __future__ import annotations

import json
import multiprocessing
import os
import warnings
from concurrent.futures import Future, ProcessPoolExecutor
from datetime import UTC, date, datetime, timedelta
from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import default
from typing import Any, cast

from memory_pipelines.launch.materialize import (
    IN_PROCESS,
    Launch,
    launch_and_wait,
    materialize,
    run_backup,
    run_erasure,
    run_forget,
    run_restore,
    run_retention,
)
from memory_pipelines.lib.forget.canary import CANARY_PREFIX
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.infra.paths import ASSETS_DIR
from memory_pipelines.lib.infra.progress import ENV_VERBOSE
from memory_pipelines.lib.infra.services import Endpoints, ensure_services, free_port
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.infra.validation import SHARING_MODES
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.notify.channels import channels_of
from memory_pipelines.lib.notify.config import NotifySettings
from memory_pipelines.lib.notify.outbox import deliver
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores.derived import DerivedStores, open_derived

CORPUS = ASSETS_DIR / "demo" / "corpus.json"
# The first month partition of `memory_eval` (defs/evaluation/assets.py `months`).
FIRST_EVAL_MONTH = date(2026, 1, 1)


def last_completed_month(today: date) -> date | None:
    """The first day of the month before `today`'s, if the evaluation has a partition for it."""
    month = (today.replace(day=1) - timedelta(days=1)).replace(day=1)
    return month if month >= FIRST_EVAL_MONTH else None


def populate_ui(settings: Settings) -> dict[str, Any]:
    """The month that ended evaluated (`memory_eval`, `memory_drift`) and a canary drill
    (`deletion_canary`), submitted together as runs of the code location so the UI shows them.

    The evaluation reads its own tenant (assets/eval, written on first use), not the demo's; the
    drill writes, forgets and offboards a `canary-...` tenant of its own. Neither reads what the
    rest of the demo writes, so the demo runs this in a child process alongside the rest.
    """
    month = last_completed_month(datetime.now(UTC).date())
    launches = [Launch("canary_drill", "", IN_PROCESS)]  # unpartitioned: no partition tag
    if month is not None:
        launches.insert(0, Launch("memory_evaluation", month.isoformat(), IN_PROCESS))
    # The trend is Markdown with an embedded PNG: too big for a JSON answer.
    *evaluated, drill = launch_and_wait(settings, launches, leave_out=("trend",))
    evaluation: dict[str, Any] = {"month": None, "success": None, "skipped": "no completed month to evaluate yet"}
    if evaluated:
        run = evaluated[0]
        quality, drift = run.assets.get("memory_eval", {}), run.assets.get("memory_drift", {})
        evaluation = {
            "month": month.isoformat()[:7] if month else None,
            "run_id": run.run_id,
            "success": run.success,
            "precision_hybrid": quality.get("precision_hybrid"),
            "recall_hybrid": quality.get("recall_hybrid"),
            "drift": drift.get("drift"),
            "checks": run.checks,
            "failures": run.failures,
        }
    canary = drill.assets.get("deletion_canary", {})
    return {
        "evaluation": evaluation,
        "canary_drill": {
            "run_id": drill.run_id,
            "success": drill.success,
            "passed": canary.get("passed"),
            "canaries": canary.get("canaries"),
            "restore_from_backup": canary.get("restore_from_backup"),
            "tenant_removed": canary.get("tenant_removed"),
            "checks": drill.checks,
            "failures": drill.failures,
        },
    }


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


def _populate_ui_quietly(settings: Settings) -> dict[str, Any]:
    """`populate_ui` in the child process: its output goes nowhere unless --verbose (the parent's
    progress display is the only one on a terminal, and warnings stay filtered), and an error comes
    back as a value (our errors do not unpickle)."""
    if os.environ.get(ENV_VERBOSE) != "1":
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        warnings.simplefilter("ignore")
    os.dup2(2, 1)  # the parent's stdout is the demo's one JSON document
    try:
        return populate_ui(settings)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _ui_outcome(background: Future[dict[str, Any]]) -> dict[str, Any]:
    """The child's result, or its error as failed evaluation and drill entries."""
    try:
        ui = background.result()
    except Exception as exc:  # the child died (killed, out of memory): say so, keep the demo's result
        ui = {"error": f"{type(exc).__name__}: {exc}"}
    if "error" in ui:
        failed = {"success": False, "failures": [{"step": None, "error": ui["error"]}]}
        return {"evaluation": failed, "canary_drill": dict(failed)}
    return ui


def store_rows(derived: DerivedStores, tenant: str, user: str) -> list[str]:
    return [m["text"] for m in derived.store.list_visible(tenant_id=tenant, user_id=user)]


def run_demo(settings: Settings) -> dict[str, Any]:
    corpus = json.loads(CORPUS.read_text(encoding="utf-8"))
    endpoints = ensure_services(settings)
    # The evaluation and the canary drill run alongside the rest (their own tenants, their own runs):
    # the evaluation takes about as long as everything else.
    pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    try:
        background = pool.submit(_populate_ui_quietly, settings)
        result = _walk_through(settings, endpoints, corpus)
    finally:
        pool.shutdown(wait=True)
    ui = _ui_outcome(background)
    store = open_store(settings, endpoints)
    try:
        # The drill offboards its tenant: none is left for `memory-pipelines tenants` to list.
        left = [t["tenant_id"] for t in store.tenants() if t["tenant_id"].startswith(CANARY_PREFIX)]
    finally:
        store.close()
    ui["canary_drill"]["canary_tenants_left"] = left
    next_steps = result.pop("next")
    return {**result, **ui, "next": next_steps}


def _walk_through(settings: Settings, endpoints: Endpoints, corpus: dict[str, Any]) -> dict[str, Any]:
    """The demo's own steps on its tenant, from the seed to the retention run."""
    tenant = corpus["tenant"]
    result: dict[str, Any] = {"tenant": tenant, "home": str(settings.home), **_first_steps(settings, endpoints, corpus)}
    run = materialize(settings, tenant)
    result["dagster"] = {
        "run_id": run["run_id"],
        "success": run["success"],
        "materialized": run["assets"],
        "checks": run["checks"],
    }
    derived = open_derived(settings, open_store(settings, endpoints))
    try:
        result.update(_reads(derived, tenant, result["versions"]["memory_id"]))
        backup = run_backup(settings, tenant)  # last night's backup, before bob asks to be forgotten
        result["forget_bob"] = _forget_bob(settings, derived, corpus)
        result["backup_then_restore"] = _restore_backup(settings, derived, corpus, backup)
        # Last night's retention run of the tenant (the corpus is recent: nothing is due yet).
        yesterday = (datetime.now(UTC).date() - timedelta(days=1)).isoformat()
        swept = run_retention(settings, yesterday, [tenant])
    finally:
        derived.store.close()
    result["retention"] = {
        "date": swept["date"],
        "removed": swept["totals"].get("removed", 0),
        "success": swept["success"],
        "run_id": swept["runs"][0]["run_id"] if swept["runs"] else None,
    }
    result["next"] = _next_steps(settings)
    return result


def _first_steps(settings: Settings, endpoints: Endpoints, corpus: dict[str, Any]) -> dict[str, Any]:
    """Seed, versions, sharing modes and alice's export: the memory store alone, before any run."""
    store = open_store(settings, endpoints)
    try:
        seeded = seed(store, corpus)
        versions = show_versions(store, corpus)
        sharing = show_sharing_modes(store, corpus)
        exported = list(store.iter_export(tenant_id=corpus["tenant"], subject="alice"))
    finally:
        store.close()
    return {
        "seeded": seeded,
        "versions": versions,
        "sharing_modes": sharing,
        "export_of_alice": {"versions": len(exported), "memories": len({e["memory_id"] for e in exported})},
    }


def _reads(derived: DerivedStores, tenant: str, memory_id: str) -> dict[str, Any]:
    """What the materialized derived stores answer: a recall, a lineage lookup, an analytics query."""
    recall_query = "what should the doctor know before prescribing antibiotics?"
    recalled = derived.recaller.recall(tenant_id=tenant, user_id="alice", query=recall_query, k=2)
    lineage = derived.lineage_of_memory(tenant_id=tenant, memory_id=memory_id)
    analytics = derived.analytics.query(
        "SELECT category, count(*) AS memories, avg(text_length)::int AS avg_text_length"
        " FROM memories GROUP BY ALL ORDER BY category",
        tenant_id=tenant,
    )
    return {
        "recall": {
            "user": "alice",
            "query": recall_query,
            "results": [{k: r[k] for k in ("memory_id", "version", "text", "score")} for r in recalled],
        },
        "lineage_of_versioned_memory": lineage,
        "analytics": analytics,
    }


def _forget_bob(settings: Settings, derived: DerivedStores, corpus: dict[str, Any]) -> dict[str, Any]:
    """bob asks to be forgotten (GDPR Art. 17): the forget run, the erasure run, the proof, and
    what is left of him to read (nothing)."""
    tenant = corpus["tenant"]
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
    return {
        "run_id": forget_run["run_id"],
        "erasure_run_id": erasure_run["run_id"],
        "state": forgotten["state"],
        "targets": forgotten["targets"],
        "proof": proof,
        "after": bob_after,
        "notifications": _notify(derived, forget_request["job_id"]),
    }


class _Mailbox:
    """The demo's SMTP server on loopback: it keeps what it is sent, in memory."""

    def __init__(self) -> None:
        self.messages: list[EmailMessage] = []

    async def handle_DATA(self, server: object, session: object, envelope: Any) -> str:
        self.messages.append(cast(EmailMessage, BytesParser(policy=default).parsebytes(envelope.content)))
        return "250 OK"


def _notify(derived: DerivedStores, job_id: str) -> dict[str, Any]:
    """bob's notices (COMPLETE, then ERASED) sent to a local SMTP server, as the `notify` job sends
    them to the operator's (MEMORY_PIPELINES_SMTP_HOST), and what that server received."""
    from aiosmtpd.controller import Controller

    mailbox = _Mailbox()
    port = free_port()  # given, not 0: aiosmtpd checks its server by connecting to that port
    controller = Controller(mailbox, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        settings = NotifySettings.build(
            smtp_host="127.0.0.1",
            smtp_port=port,
            smtp_starttls="off",  # loopback only; a real server is reached with STARTTLS
            email_from="memory-pipelines@demo.invalid",
            email_to="privacy-office@demo.invalid",
            events="completed,erased",
        )
        sent = deliver(db=derived.store, channels=channels_of(settings), events=settings.events)
    finally:
        controller.stop()
    return {
        "smtp_server": f"127.0.0.1:{port} (the demo's own)",
        "delivered": [d for d in sent["delivered"] if d["job_id"] == job_id],
        "received": [
            {
                "to": m["To"],
                "subject": m["Subject"],
                "idempotency_key": m["X-Idempotency-Key"],
                "body": cast(EmailMessage, m).get_content().splitlines(),
            }
            for m in mailbox.messages
            if job_id in str(m["Subject"])
        ],
    }


def _restore_backup(
    settings: Settings, derived: DerivedStores, corpus: dict[str, Any], backup: dict[str, Any]
) -> dict[str, Any]:
    """Restoring the backup taken before bob's deletion must not bring him back; then the rebuild."""
    tenant = corpus["tenant"]
    restored = run_restore(settings, tenant, str(backup["backup_id"]))
    report = restored["report"] or {"state": "FAILED", "failures": restored["failures"]}
    bob_after_restore = {
        "list": store_rows(derived, tenant, "bob"),
        "export": list(derived.store.iter_export(tenant_id=tenant, subject="bob")),
        "others_back": {user: len(store_rows(derived, tenant, user)) for user in corpus["members"] if user != "bob"},
    }
    # In `dagster dev`, restored_tenants_backfill_sensor launches this rebuild as an asset backfill;
    # the demo has no daemon, so it materializes the same assets as one run.
    backfill = materialize(settings, tenant)
    return {
        "backup": {k: backup.get(k) for k in ("backup_id", "location", "bytes", "expires_at", "rows_memories")},
        "restore": {
            k: report.get(k) for k in ("state", "loaded", "replayed", "verification", "failures") if k in report
        },
        "bob_after_restore": bob_after_restore,
        "backfill_after_restore": {"success": backfill["success"], "checks": backfill["checks"]},
    }


def _next_steps(settings: Settings) -> dict[str, str]:
    return {
        "ui": f"memory-pipelines --home {settings.home} dev   # then open http://127.0.0.1:3000/assets/memories",
        "what_to_look_at": "Assets: `memories` and the derived_stores group, partition `demo`: counts per "
        "materialization and the asset checks; `memory_deletions`, partition `demo`: bob's forget with its "
        "proof, certificate and data map, and the deletions_on_track check (the `forget` job's page says how to "
        "request a deletion from the launchpad); `memory_eval` and `memory_drift` for the month evaluated "
        "(the trend chart, precision_target and drift_target); `deletion_canary` and its nothing_left_behind "
        "check; "
        "`tenant_backups` lists the tenant's backups (the `backups` table) for a restore from the launchpad of "
        "the `restore` job; Runs: the `tenant_refresh`, `forget`, `backup`, `restore`, `memory_evaluation` and "
        "`canary_drill` runs above, launched from the code location (re-executable); sensor "
        "`tenant_partitions_sensor` keeps tenants as partitions; after a restore, "
        "`restored_tenants_backfill_sensor` starts a backfill",
        "stop": f"memory-pipelines --home {settings.home} stop",
    }
