"""Incident switches on real engines: a pause holds every cascade and erasure (requests still hidden at
once), a resume lets them complete with the pause in the proof; a pinned adapter version runs and is
recorded; and no way of undoing a completed deletion works (resume, pin, retry, rollback, restore,
SQL)."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from memory_pipelines.lib.backups.service import BackupService
from memory_pipelines.lib.backups.storage import LocalBackupStorage
from memory_pipelines.lib.forget import switches
from memory_pipelines.lib.forget.certificate import render
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.erasure import ErasureService
from memory_pipelines.lib.forget.ledger import DeletionLedger
from memory_pipelines.lib.forget.switches import DeletionPaused
from memory_pipelines.lib.infra.errors import ConflictError, NotFoundError, ValidationError

pytestmark = pytest.mark.slow


def remembered(store, derived, tenant, user="dana"):
    canary = f"canary-{uuid.uuid4().hex[:12]}"
    written = store.write(tenant_id=tenant, user_id=user, text=f"{user} parks the {canary} van on level 3")
    derived.sync_all(tenant_id=tenant)
    return written, canary


def visible(store, tenant, user):
    return [m["memory_id"] for m in store.list_visible(tenant_id=tenant, user_id=user)]


def switch(db, fn, /, **kwargs):
    with db.transaction() as conn:
        return fn(conn, **kwargs)


@pytest.fixture
def paused_tenant(store, tenant):
    """The tenant paused (INC-42); resumed after the test whatever happened."""
    store.create_tenant(tenant_id=tenant)
    switch(store, switches.pause, tenant_id=tenant, reason="INC-42 chroma upgrade")
    yield tenant
    with store.transaction() as conn:
        conn.execute(
            "UPDATE control.deletion_pauses SET resumed_at = now() WHERE tenant_id = %s AND resumed_at IS NULL",
            (tenant,),
        )


def test_a_paused_forget_is_hidden_at_once_cascades_nothing_and_completes_on_resume(store, derived, paused_tenant):
    tenant = paused_tenant
    written, canary = remembered(store, derived, tenant)
    record = f"{written.memory_id}:1"
    service = DeletionService(derived)

    job = service.request(tenant_id=tenant, subject="dana", basis="gdpr-art17")

    assert job["state"] == "REQUESTED" and job["paused"]["reason"] == "INC-42 chroma upgrade"
    assert visible(store, tenant, "dana") == []  # hidden at once, paused or not
    with pytest.raises(DeletionPaused) as raised:
        service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert raised.value.field == "pause" and "deletion resume" in raised.value.message
    held = service.status(job_id=job["job_id"])
    assert held["state"] == "REQUESTED" and held["attempts"] == 0 and held["paused"]["tenant_id"] == tenant
    assert record in derived.vectors.ids(tenant)  # nothing cascaded
    assert job["job_id"] not in {row["job_id"] for row in service.ledger(paused=False)}  # the sensor waits
    assert job["job_id"] in {row["job_id"] for row in service.ledger()}

    switch(store, switches.resume, tenant_id=tenant)
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])

    done = service.status(job_id=job["job_id"])
    assert done["state"] == "COMPLETE" and "paused" not in done
    assert done["deadline"] == job["deadline"]  # a pause never extends a deadline
    assert record not in derived.vectors.ids(tenant)
    proof = service.proof(job_id=job["job_id"])
    [pause] = proof["pauses"]
    assert pause["scope"] == "tenant" and pause["reason"] == "INC-42 chroma upgrade"
    assert proof["requestedAt"] <= pause["resumedAt"] <= proof["completedAt"]
    line = f"**Paused (tenant: INC-42 chroma upgrade):** `{pause['pausedAt']} to {pause['resumedAt']}`"
    assert line in render(proof, done, "md")
    assert "Paused (tenant: INC-42 chroma upgrade)" in render(proof, done, "html")
    assert canary not in json.dumps(proof)


def test_a_pause_of_every_tenant_holds_the_erasure_too_and_resume_names_its_scope(store, derived, tenant):
    service = DeletionService(derived)
    written, _ = remembered(store, derived, tenant)
    job = service.request(tenant_id=tenant, memory_id=written.memory_id)
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    erasure = ErasureService(derived)
    assert tenant in erasure.due_tenants(now=None) or erasure.pending(tenant_id=tenant)
    everyone = switch(store, switches.pause, tenant_id=None, reason="INC-7 storage incident")
    try:
        with pytest.raises(DeletionPaused):
            erasure.erase_tenant(tenant_id=tenant)
        assert tenant not in erasure.due_tenants()
        assert service.status(job_id=job["job_id"])["targets"]["physical"].startswith("PENDING:")
        with pytest.raises(NotFoundError) as raised:  # only every tenant's pause is open, not this tenant's
            switch(store, switches.resume, tenant_id=tenant)
        assert raised.value.field == "tenant"
        again = switch(store, switches.pause, tenant_id=None, reason="INC-7 storage incident")
        assert again["pause_id"] == everyone["pause_id"]  # one open pause per scope
    finally:
        switch(store, switches.resume, tenant_id=None)
    assert erasure.erase_tenant(tenant_id=tenant)["erased"] >= 1


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"reason": ""}, "reason"),
        ({"reason": "x" * 201}, "reason"),
        ({"reason": "two\nlines"}, "reason"),
        ({"reason": "ok", "tenant_id": "bad tenant;--"}, "tenant"),
    ],
)
def test_a_bad_pause_names_the_field_and_pauses_nothing(store, kwargs, field):
    before = switch(store, switches.pauses)
    with pytest.raises(ValidationError) as raised:
        switch(store, switches.pause, **{"tenant_id": None, **kwargs})
    assert raised.value.field == field
    assert switch(store, switches.pauses) == before


def test_a_pinned_adapter_version_runs_and_every_proof_records_it(store, derived, tenant, monkeypatch):
    service = DeletionService(derived)
    calls: list[str] = []
    vectors = derived.vectors
    for name in ("delete", "discard"):
        original = getattr(vectors, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(vectors, name, spy)
    with pytest.raises(ValidationError) as bad:
        switch(store, switches.pin, store="chroma", version="chroma-v9", reason="INC-9")
    assert bad.value.field == "version" and "chroma-v1" in bad.value.message
    with pytest.raises(NotFoundError):
        switch(store, switches.pin, store="no_such_store", version="v1", reason="INC-9")
    assert switch(store, switches.adapter_versions)["chroma"]["pinned"] is None

    pinned = switch(store, switches.pin, store="chroma", version="chroma-v1", reason="INC-9 discard suspected")
    try:
        assert pinned == {"store": "chroma", "version": "chroma-v1", "default": "chroma-v2", "reason": pinned["reason"]}
        first, _ = remembered(store, derived, tenant, user="erin")
        job = service.request(tenant_id=tenant, memory_id=first.memory_id)
        service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
        assert service.proof(job_id=job["job_id"])["adapterVersions"]["chroma"] == "chroma-v1"
        assert calls == ["delete"]
        assert f"{first.memory_id}:1" not in derived.vectors.ids(tenant)
    finally:
        switch(store, switches.unpin, store="chroma")
    second, _ = remembered(store, derived, tenant, user="erin")
    later = service.request(tenant_id=tenant, memory_id=second.memory_id)
    service.run_batch(tenant_id=tenant, job_ids=[later["job_id"]])
    assert service.proof(job_id=later["job_id"])["adapterVersions"]["chroma"] == "chroma-v2"
    assert calls == ["delete", "discard"]
    # The first proof still says what ran for it.
    assert service.proof(job_id=job["job_id"])["adapterVersions"]["chroma"] == "chroma-v1"


def test_no_way_undoes_a_completed_deletion(store, derived, tenant, tmp_path):
    service = DeletionService(derived)
    backups = BackupService(
        store, LocalBackupStorage(tmp_path / "backups"), staging=tmp_path / "staging", job_records=DeletionLedger(store)
    )
    memory = store.write(tenant_id=tenant, user_id="finn", text="Finn's first draft: the gate code is 7719")
    store.write(tenant_id=tenant, user_id="finn", text="Finn's second draft", memory_id=memory.memory_id)
    store.write(tenant_id=tenant, user_id="gail", text="Gail's note stays")
    derived.sync_all(tenant_id=tenant)
    backup = backups.backup(tenant_id=tenant)
    subject = service.request(tenant_id=tenant, subject="gail")
    version = service.request(tenant_id=tenant, memory_id=memory.memory_id, version=1)
    service.run_batch(tenant_id=tenant, job_ids=[subject["job_id"], version["job_id"]])
    jobs = [subject["job_id"], version["job_id"]]
    proofs = {job_id: service.proof(job_id=job_id) for job_id in jobs}

    def unchanged() -> None:
        for job_id in jobs:
            status = service.status(job_id=job_id)
            assert status["state"] == "COMPLETE" and "paused" not in status
            assert service.proof(job_id=job_id) == proofs[job_id]
        assert visible(store, tenant, "gail") == []
        assert [v["version"] for v in store.history(tenant_id=tenant, memory_id=memory.memory_id)] == [2]

    # resume: nothing is paused, and a resume is no undo
    with pytest.raises(NotFoundError):
        switch(store, switches.resume, tenant_id=tenant)
    # pin: changes later cascades only
    switch(store, switches.pin, store="chroma", version="chroma-v1", reason="INC-11")
    switch(store, switches.unpin, store="chroma")
    # retry: a COMPLETE job is left as it is
    assert service.run_batch(tenant_id=tenant, job_ids=jobs)["jobs"] == {}
    unchanged()
    # rollback: the forgotten version is never copied forward
    with pytest.raises(ConflictError) as rolled:
        store.rollback(tenant_id=tenant, memory_id=memory.memory_id, user_id="finn")
    assert rolled.value.field == "memory_id"
    unchanged()
    # restore of a backup from before: the replay removes what was forgotten again
    report = backups.restore(tenant_id=tenant, backup_id=backup["backup_id"])
    assert report["state"] == "COMPLETE" and set(report["verification"].values()) == {0}
    unchanged()
    exported = [e for e in store.iter_export(tenant_id=tenant, subject="finn")]
    assert "gate code" not in json.dumps(exported)
    # SQL, as the database owner: a trigger refuses to re-open or remove a COMPLETE job
    with psycopg.connect(store.conninfo, autocommit=True) as conn:
        for statement in (
            "UPDATE control.deletion_jobs SET state = 'REQUESTED' WHERE job_id = %s",
            "UPDATE control.deletion_jobs SET completed_at = NULL WHERE job_id = %s",
            "DELETE FROM control.deletion_jobs WHERE job_id = %s",
        ):
            with pytest.raises(psycopg.errors.CheckViolation, match="COMPLETE"):
                conn.execute(statement, (subject["job_id"],))
    unchanged()


def test_the_cli_pauses_accepts_without_running_resumes_and_the_proof_shows_it(store, derived, tenant, cli_env):
    from tests.conftest import run_cli

    def cli(*args):
        return run_cli(*args, home=cli_env["home"], env=cli_env["env"], timeout=600)

    remembered(store, derived, tenant, user="hana")
    paused = cli("deletion", "pause", "--tenant", tenant, "--reason", "INC-77 drill")
    assert paused.returncode == 0, paused.stderr
    assert json.loads(paused.stdout)["reason"] == "INC-77 drill"
    bad = cli("deletion", "pause", "--tenant", tenant, "--reason", "")
    assert bad.returncode == 2 and "reason" in bad.stderr

    forgot = cli("forget", "--tenant", tenant, "--subject", "hana", "--wait")
    assert forgot.returncode == 0, forgot.stderr
    job = json.loads(forgot.stdout)
    assert job["state"] == "REQUESTED" and job["paused"]["reason"] == "INC-77 drill"
    assert "paused" in forgot.stderr and "deletion resume" in forgot.stderr
    assert visible(store, tenant, "hana") == []
    [listed] = [p for p in json.loads(cli("deletion", "pauses", "--tenant", tenant).stdout) if p["tenant_id"] == tenant]
    assert listed["resumed_at"] is None

    assert cli("deletion", "resume", "--tenant", tenant).returncode == 0
    again = cli("deletion", "resume", "--tenant", tenant)
    assert again.returncode == 3 and "no pause" in again.stderr
    retried = cli("deletion", "retry", job["job_id"])
    assert retried.returncode == 0, retried.stderr
    assert json.loads(retried.stdout)["state"] == "COMPLETE"
    proof = json.loads(cli("deletion", "proof", job["job_id"]).stdout)
    assert [p["reason"] for p in proof["pauses"]] == ["INC-77 drill"]

    adapters = {a["store"]: a for a in json.loads(cli("deletion", "adapter", "list").stdout)}
    assert adapters["chroma"]["shipped"] == ["chroma-v2", "chroma-v1"] and adapters["chroma"]["pinned"] is None
    wrong = cli("deletion", "adapter", "pin", "chroma", "chroma-v0", "--reason", "INC-78")
    assert wrong.returncode == 2 and "version" in wrong.stderr
    assert {a["store"]: a for a in json.loads(cli("deletion", "adapter", "list").stdout)} == adapters


def test_the_dagster_switch_job_pauses_and_resumes(store, tenant, session_settings):
    from memory_pipelines.defs.forget.jobs import deletion_switch_job
    from memory_pipelines.resources import MemoryStoreResource

    resources = {"memory_store": MemoryStoreResource(home=str(session_settings.home))}

    def run(**config):
        return deletion_switch_job.execute_in_process(
            run_config={"ops": {"switch_deletions": {"config": config}}}, resources=resources, raise_on_error=False
        )

    assert not run(action="pause", tenant=tenant, reason="INC-80 from the launchpad").success  # no such tenant
    store.create_tenant(tenant_id=tenant)
    paused = run(action="pause", tenant=tenant, reason="INC-80 from the launchpad")
    assert paused.success
    with store.transaction() as conn:
        assert switches.active_pause(conn, tenant)["reason"] == "INC-80 from the launchpad"
    unreasoned = run(action="pause", tenant=tenant)
    assert not unreasoned.success  # already paused, but a pause without a reason is refused first
    assert run(action="resume", tenant=tenant).success
    with store.transaction() as conn:
        assert switches.active_pause(conn, tenant) is None
    assert not run(action="reopen", tenant=tenant).success


def test_a_pause_lets_a_job_past_its_freeze_finish_holds_the_rest_and_a_retention_sweep_waits(
    store, derived, paused_tenant
):
    from datetime import date, timedelta

    from memory_pipelines.lib.retention import rules as retention

    tenant = paused_tenant
    service = DeletionService(derived)
    started, _ = remembered(store, derived, tenant, user="ida")
    waiting, _ = remembered(store, derived, tenant, user="ida")
    midway = service.request(tenant_id=tenant, memory_id=started.memory_id)
    held = service.request(tenant_id=tenant, memory_id=waiting.memory_id)
    with store.transaction() as conn:  # a run killed after its freeze left this one DELETING
        conn.execute("UPDATE control.deletion_jobs SET state = 'DELETING' WHERE job_id = %s", (midway["job_id"],))

    service.run_batch(tenant_id=tenant, job_ids=[midway["job_id"], held["job_id"]])

    assert service.status(job_id=midway["job_id"])["state"] == "COMPLETE"
    assert service.status(job_id=held["job_id"])["state"] == "REQUESTED"
    # A retention sweep of the paused tenant requests and hides, and waits instead of failing.
    old = store.write(tenant_id=tenant, user_id="ida", text="Ida's old payslip", category="general")
    day = date.today() - timedelta(days=1)
    with store.transaction() as conn:
        conn.execute(
            "UPDATE memory.memories SET created_at = now() - interval '4000 days' WHERE tenant_id = %s"
            " AND memory_id = %s",
            (tenant, old.memory_id),
        )
    swept = retention.sweep(service, day=day, tenant_id=tenant)
    assert swept["paused"] == [tenant] and swept["jobs"][tenant]["state"] == "REQUESTED"
    assert old.memory_id not in visible(store, tenant, "ida")


def test_a_pin_this_release_does_not_ship_is_refused_not_replaced(store, derived, tenant):
    service = DeletionService(derived)
    written, _ = remembered(store, derived, tenant, user="jon")
    job = service.request(tenant_id=tenant, memory_id=written.memory_id)
    with store.transaction() as conn:  # pinned by a later release, then rolled back to this one
        conn.execute("INSERT INTO control.adapter_pins (store, version, reason) VALUES ('chroma', 'chroma-v3', 'x')")
    try:
        with pytest.raises(ConflictError) as raised:
            service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
        assert raised.value.field == "pin" and "chroma-v3" in raised.value.message
        assert service.status(job_id=job["job_id"])["state"] == "REQUESTED"
        assert switch(store, switches.adapter_versions)["chroma"]["pin_shipped"] is False
    finally:
        switch(store, switches.unpin, store="chroma")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"


def test_pausing_a_tenant_that_does_not_exist_is_refused(store):
    with pytest.raises(NotFoundError) as raised:
        switch(store, switches.pause, tenant_id="no-such-tenant-xyz", reason="INC-1")
    assert raised.value.field == "tenant"
