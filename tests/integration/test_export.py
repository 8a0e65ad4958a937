"""Subject export (GDPR Art. 15/20, CCPA): complete, exclusive, streamed; do-not-sell flags."""

import json
import threading

import psycopg

from memory_pipelines.lib.memories import store as store_module


def test_export_has_every_version_of_every_memory_the_subject_wrote_and_nothing_else(store, tenant):
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="alice")
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="bob")
    personal = store.write(tenant_id=tenant, user_id="alice", text="alice v1", original_query="q1")
    store.write(tenant_id=tenant, user_id="alice", text="alice v2", memory_id=personal.memory_id)
    team = store.write(tenant_id=tenant, user_id="alice", text="alice team", team_id="core", category="work")
    store.write(tenant_id=tenant, user_id="bob", text="bob personal")
    store.write(tenant_id=tenant, user_id="bob", text="bob team", team_id="core")

    document = json.loads("".join(store.export_json(tenant_id=tenant, subject="alice")))
    assert (document["tenant"], document["subject"]) == (tenant, "alice")
    rows = {(m["memory_id"], m["version"]): m for m in document["memories"]}
    assert set(rows) == {(personal.memory_id, 1), (personal.memory_id, 2), (team.memory_id, 1)}
    assert rows[(personal.memory_id, 1)]["text"] == "alice v1"
    assert rows[(personal.memory_id, 1)]["current"] is False
    assert rows[(personal.memory_id, 2)]["current"] is True
    assert rows[(personal.memory_id, 1)]["original_query"] == "q1"
    assert rows[(team.memory_id, 1)]["team_id"] == "core"
    assert rows[(team.memory_id, 1)]["category"] == "work"
    for row in document["memories"]:
        assert "bob" not in row["text"]
        assert {"memory_id", "version", "text", "team_id", "do_not_sell", "created_at"} <= set(row)


def test_export_of_a_subject_with_nothing_is_an_empty_list(store, tenant):
    store.write(tenant_id=tenant, user_id="alice", text="something")
    document = json.loads("".join(store.export_json(tenant_id=tenant, subject="nobody")))
    assert document["memories"] == []


def test_export_streams_in_batches_through_a_server_side_cursor(store, tenant, endpoints):
    total = store_module.EXPORT_BATCH * 2 + 37
    with store.transaction():
        pass
    for n in range(total):
        store.write(tenant_id=tenant, user_id="bulk", text=f"memory number {n}")
    rows = store.iter_export(tenant_id=tenant, subject="bulk")
    first = next(rows)
    assert first["text"] == "memory number 0"
    # While the caller holds only the first row, the export backend has fetched one batch.
    with psycopg.connect(endpoints.store_conninfo) as conn:
        queries = [
            r[0]
            for r in conn.execute(
                "SELECT query FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        ]
    assert any(q.startswith("FETCH FORWARD") and str(store_module.EXPORT_BATCH) in q for q in queries), queries
    rest = list(rows)
    assert len(rest) + 1 == total
    assert [r["text"] for r in rest[-2:]] == [f"memory number {total - 2}", f"memory number {total - 1}"]


def test_do_not_sell_per_memory_and_per_subject(store, tenant):
    flagged = store.write(tenant_id=tenant, user_id="alice", text="flagged at write", do_not_sell=True)
    later = store.write(tenant_id=tenant, user_id="alice", text="flagged later")
    plain = store.write(tenant_id=tenant, user_id="bob", text="bob plain")

    def flags(user):
        return {m["memory_id"]: m["do_not_sell"] for m in store.list_visible(tenant_id=tenant, user_id=user)}

    assert flags("alice") == {flagged.memory_id: True, later.memory_id: False}
    store.set_do_not_sell(tenant_id=tenant, user_id="alice", memory_id=later.memory_id)
    assert flags("alice") == {flagged.memory_id: True, later.memory_id: True}
    store.set_do_not_sell(tenant_id=tenant, user_id="alice", memory_id=later.memory_id, value=False)
    assert flags("alice")[later.memory_id] is False

    # A subject-wide opt-out covers present and future memories, and shows in the export.
    store.set_do_not_sell(tenant_id=tenant, user_id="bob", subject="bob")
    future = store.write(tenant_id=tenant, user_id="bob", text="bob after opting out")
    assert flags("bob") == {plain.memory_id: True, future.memory_id: True}
    exported = list(store.iter_export(tenant_id=tenant, subject="bob"))
    assert {row["do_not_sell"] for row in exported} == {True}
    assert store.tenant_stats(tenant_id=tenant)["do_not_sell_memories"] == 1  # memory-level flags only
    # A new version does not drop the flag.
    store.write(tenant_id=tenant, user_id="alice", text="flagged at write, edited", memory_id=flagged.memory_id)
    assert flags("alice")[flagged.memory_id] is True


def test_concurrent_identical_writes_make_one_memory(store, tenant, session_settings, endpoints):
    from memory_pipelines.lib.runtime import open_store

    stores = [open_store(session_settings, endpoints) for _ in range(4)]
    results = []

    def write(s):
        results.append(s.write(tenant_id=tenant, user_id="alice", text="said twice at once"))

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s.close()
    assert len({r.memory_id for r in results}) == 1
    assert sum(r.changed for r in results) == 1


def test_the_export_holds_what_is_derived_and_recorded_about_the_subject_until_their_forget(
    session_settings, endpoints, store, derived, tenant
):
    from memory_pipelines import MemoryPlatform

    parts = {"settings": session_settings, "store": store, "endpoints": endpoints, "derived": derived}
    with MemoryPlatform(**parts) as mp:

        def document(subject="ivy"):
            return json.loads("".join(mp.export_json(tenant_id=tenant, subject=subject)))

        mp.write(tenant_id=tenant, user_id="ivy", text="Ivy's cat is called Pixel")
        trip = mp.write(tenant_id=tenant, user_id="ivy", text="Ivy flies to Lisbon in May")
        mp.write(tenant_id=tenant, user_id="jo", text="Jo's cat is called Biscuit")
        before = document()
        assert before["format"] == "memory-pipelines.export.v2" and len(before["memories"]) == 2
        assert before["summary"] is None and before["deletion_jobs"] == [] and before["agent_runs"] == []
        assert before["consent"] == {"do_not_sell": False, "summary_mode": "hybrid", "summary_mode_chosen": False}

        mp.sync(tenant_id=tenant)
        assert "Pixel" in document()["summary"]["summary"]
        mp.set_do_not_sell(tenant_id=tenant, user_id="ivy", subject="ivy")
        mp.set_summary_mode(tenant_id=tenant, subject="ivy", mode="full")
        assert document()["consent"] == {"do_not_sell": True, "summary_mode": "full", "summary_mode_chosen": True}

        forgotten_trip = mp.forget(tenant_id=tenant, memory_id=trip["memory_id"])
        forgotten_trip.wait()
        [job] = document()["deletion_jobs"]
        assert (job["job_id"], job["state"], job["scope"]["type"]) == (forgotten_trip.job_id, "COMPLETE", "MEMORY")
        assert job["scope"]["memory_id"] == trip["memory_id"] and job["completed_at"]
        assert document("jo")["deletion_jobs"] == []

        ivy_run = mp.open_run(tenant_id=tenant, subject_id="ivy", run_id="run-ivy-1")
        assert mp.run_recall(lease_id=ivy_run["lease_id"], query="what is the cat called")
        with mp.permit(lease_id=ivy_run["lease_id"], sink="model_output"):
            pass
        jo_run = mp.open_run(tenant_id=tenant, subject_id="jo", run_id="run-jo-1")
        assert mp.run_recall(lease_id=jo_run["lease_id"], query="what is the cat called")
        [run] = document()["agent_runs"]
        assert run["run_id"] == "run-ivy-1" and run["sinks"] == ["model_output"] and run["versions_read"] == 1
        assert [r["run_id"] for r in document("jo")["agent_runs"]] == ["run-jo-1"]

        mp.forget(tenant_id=tenant, subject="ivy").wait()
        after = document()
        assert after["memories"] == [] and after["summary"] is None
        # The one part that stays, by design: an opt-out is undone only by the subject, and covers what
        # is written under the id later. Their summary mode went with them.
        assert after["consent"] == {"do_not_sell": True, "summary_mode": "hybrid", "summary_mode_chosen": False}
        assert after["deletion_jobs"] == [] and after["agent_runs"] == []
        assert "Pixel" not in json.dumps(after) and trip["memory_id"] not in json.dumps(after)
        # jo's part is untouched
        assert [r["run_id"] for r in document("jo")["agent_runs"]] == ["run-jo-1"]
