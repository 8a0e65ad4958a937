"""Restores and the history around a deletion (issue 20, items 2, 4, 5 and 6), on real engines.

- A restore after the physical erasure writes nothing forgotten into PostgreSQL's files (the
  journal's rules run on TEMPORARY tables; only what survives reaches a real table), and if the
  safety net ever removes a row from a real table, the jobs it belongs to owe an erasure again.
- Consent and access changes made after a backup survive restoring it (the consent journal).
- A proof counts a backup still in flight when the job completes.
- A restore_id belongs to one restore of one tenant: a clash is refused, never an overwrite.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from memory_pipelines.lib.backups.service import BackupService, completed_restores
from memory_pipelines.lib.backups.storage import LocalBackupStorage
from memory_pipelines.lib.forget.canary import files_containing
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.erasure import ErasureLedger, ErasureService
from memory_pipelines.lib.forget.ledger import DeletionLedger
from memory_pipelines.lib.infra.errors import ConflictError, PermissionDeniedError, ValidationError
from memory_pipelines.lib.stores import bytescan
from memory_pipelines.lib.stores.adapter import postgres_files
from tests.conftest import row_counts, run_cli
from tests.support.legacy import seal_as_before_version_keys

pytestmark = pytest.mark.slow


def seed(store, derived, tenant: str) -> dict[str, Any]:
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="alice")
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="bob")
    # Texts unique to the tenant, so their bytes exist nowhere else on the session's server.
    written = {
        "alice_personal": store.write(tenant_id=tenant, user_id="alice", text=f"Alice hides licorice in {tenant}"),
        "alice_team": store.write(
            tenant_id=tenant,
            user_id="alice",
            text=f"Core freeze of {tenant} starts Friday",
            team_id="core",
            original_query=f"when does the {tenant} freeze start?",
        ),
        "bob_keep": store.write(tenant_id=tenant, user_id="bob", text=f"Bob keeps a sourdough starter in {tenant}"),
        "bob_gone": store.write(
            tenant_id=tenant,
            user_id="bob",
            text=f"Bob's locker code in {tenant} is 4417",
            original_query=f"what is bob's {tenant} locker code?",
        ),
        "carol": store.write(tenant_id=tenant, user_id="carol", text=f"Carol runs marathons in April ({tenant})"),
    }
    derived.sync_all(tenant_id=tenant)
    return written


def service_for(store, tmp_path: Path, **kwargs: Any) -> BackupService:
    """A backup service wired as the platform's is: a restore's erasure owed written by the deletion ledger."""
    return BackupService(
        store,
        LocalBackupStorage(tmp_path / "backups"),
        staging=tmp_path / "staging",
        job_records=DeletionLedger(store),
        **kwargs,
    )


def checkpoint(store) -> None:
    with psycopg.connect(store.conninfo, autocommit=True) as conn:
        conn.execute("CHECKPOINT")


def ciphertexts(store, tenant: str, memory_ids: list[str]) -> list[bytes]:
    """Every sealed text and query of these memories, as stored."""
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT text_ct, original_query_ct FROM memory.memory_versions WHERE tenant_id = %s"
            " AND memory_id = ANY(%s)",
            (tenant, memory_ids),
        ).fetchall()
    return [bytes(blob) for row in rows for blob in row if blob is not None]


def fingerprints_of(store, job_ids: list[str]) -> tuple[list[int], int]:
    """The fingerprints the erasure will scan for (it drops them once ERASED, so read them before)."""
    with store.transaction() as conn:
        found = [
            int(r[0])
            for r in conn.execute(
                "SELECT DISTINCT fingerprint FROM control.erasure_fingerprints WHERE job_id = ANY(%s)"
                " AND fingerprint <> 0",
                (job_ids,),
            )
        ]
        base = bytescan.base_from_key(store.keys.control_key(conn))
    return found, base


def physical(service: DeletionService, job_id: str) -> str:
    return str(service.status(job_id=job_id)["targets"]["physical"])


# -- item 2: a restore after ERASED -------------------------------------------------------------------


def test_a_restore_after_erasure_puts_no_forgotten_byte_into_postgres_files(
    store, derived, tenant, tmp_path, session_settings
):
    w = seed(store, derived, tenant)
    backups = service_for(store, tmp_path)
    manifest = backups.backup(tenant_id=tenant)
    forgotten_ids = [w["alice_personal"].memory_id, w["alice_team"].memory_id, w["bob_gone"].memory_id]
    raw = ciphertexts(store, tenant, forgotten_ids)
    assert len(raw) == 5  # three texts, two queries

    service = DeletionService(derived)
    jobs = [
        service.request(tenant_id=tenant, subject="alice"),
        service.request(tenant_id=tenant, memory_id=w["bob_gone"].memory_id),
    ]
    job_ids = [job["job_id"] for job in jobs]
    service.run_batch(tenant_id=tenant, job_ids=job_ids)
    assert [service.status(job_id=j)["state"] for j in job_ids] == ["COMPLETE", "COMPLETE"]
    fingerprints, base = fingerprints_of(store, job_ids)
    assert fingerprints
    report = ErasureService(derived).erase_tenant(tenant_id=tenant)
    assert report["erased"] == 2 and report["byteScan"]["hits"] == 0
    assert all(physical(service, j).startswith("ERASED:") for j in job_ids)

    restored = backups.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    assert restored["state"] == "COMPLETE"
    assert {m["memory_id"] for m in store.list_visible(tenant_id=tenant, user_id="bob")} == {w["bob_keep"].memory_id}

    checkpoint(store)
    with store.transaction() as conn:
        files = postgres_files(conn, tenant)
    assert files
    scan = bytescan.scan(files, fingerprints, base)
    assert scan.hits == {}, f"the erasure's fingerprints are back in the tenant's files: {scan.hits}"
    heap = session_settings.pgdata / "base"
    left = {blob.hex()[:16]: where for blob, where in files_containing(heap, raw).items() if where}
    assert left == {}, f"forgotten ciphertext in PostgreSQL's files after the restore: {left}"
    # The journal's rules dropped them before any real table saw them; the replay on the real
    # tables (the safety net) then has nothing to remove.
    removed = restored["replayed"]["rows_removed"]
    assert removed["subject_epochs"] == 2 and removed["tombstones"] == 1
    assert set(restored["replayed"]["rows_removed_after_load"].values()) == {0}
    # Nothing was owed: the jobs stay ERASED and no erasure is pending.
    assert all(physical(service, j).startswith("ERASED:") for j in job_ids)
    assert ErasureLedger(store).pending(tenant_id=tenant) == []


def test_a_row_the_safety_net_removes_puts_its_job_back_to_pending(store, derived, tenant, tmp_path, session_settings):
    """A journal entry that lands between the filtering of the snapshot and the load (here a tombstone
    put back by a hook) lets a forgotten row reach a real table: the replay on the real tables removes
    it, and its job owes an erasure again, with the fingerprints of what was removed. The row is
    sealed as before version keys: a row under a version key is dropped at the filtering whatever
    the journal says, since its key is destroyed."""
    w = seed(store, derived, tenant)
    seal_as_before_version_keys(store, tenant, w["carol"].memory_id)
    backups = service_for(store, tmp_path)
    manifest = backups.backup(tenant_id=tenant)
    raw = ciphertexts(store, tenant, [w["carol"].memory_id])
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, memory_id=w["carol"].memory_id, version=1)
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    ErasureService(derived).erase_tenant(tenant_id=tenant)
    assert physical(service, job["job_id"]).startswith("ERASED:")

    with store.transaction() as conn:
        stashed = conn.execute(
            "DELETE FROM control.tombstones WHERE job_id = %s RETURNING tenant_id, memory_id, version, job_id",
            (job["job_id"],),
        ).fetchall()
    assert len(stashed) == 1

    def tombstone_lands_late(step: str) -> None:
        with store.transaction() as conn:
            conn.execute(
                "INSERT INTO control.tombstones (tenant_id, memory_id, version, job_id) VALUES (%s, %s, %s, %s)",
                stashed[0],
            )

    late = service_for(store, tmp_path, hooks={"filtered": tombstone_lands_late})
    restored = late.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    assert restored["state"] == "COMPLETE"
    assert restored["replayed"]["rows_removed_after_load"]["tombstones"] == 1
    assert restored["erasure_owed"] == {"jobs": [job["job_id"]], "fingerprints": 2}  # both ends of one text
    status = service.status(job_id=job["job_id"])
    assert status["targets"]["physical"].startswith("PENDING:")
    assert service.proof(job_id=job["job_id"])["targets"]["physical"] == status["targets"]["physical"]
    assert [j["job_id"] for j in ErasureLedger(store).pending(tenant_id=tenant)] == [job["job_id"]]

    # The erasure sensor's run: rewrite, scan for those fingerprints, ERASED again.
    report = ErasureService(derived).erase_tenant(tenant_id=tenant)
    assert report["erased"] == 1 and report["byteScan"]["hits"] == 0 and report["byteScan"]["fingerprints"] >= 2
    assert physical(service, job["job_id"]).startswith("ERASED:")
    checkpoint(store)
    heap = session_settings.pgdata / "base"
    assert [where for where in files_containing(heap, raw).values() if where] == []


# -- item 4: consent and access after a backup --------------------------------------------------------


def test_consent_and_access_changes_after_a_backup_survive_restoring_it(store, derived, tenant, tmp_path):
    store.add_team_member(tenant_id=tenant, team_id="legal", user_id="alice")
    store.add_team_member(tenant_id=tenant, team_id="legal", user_id="max")
    sold = store.write(tenant_id=tenant, user_id="alice", text="Alice drafts the merger memo", team_id="legal")
    unsold = store.write(tenant_id=tenant, user_id="alice", text="Alice prefers fountain pens")
    store.write(tenant_id=tenant, user_id="carol", text="Carol collects vinyl records")
    store.set_do_not_sell(tenant_id=tenant, user_id="alice", memory_id=unsold.memory_id, value=True)
    store.add_team_member(tenant_id=tenant, team_id="legal", user_id="zoe")
    backups = service_for(store, tmp_path)
    manifest = backups.backup(tenant_id=tenant)
    # zoe is forgotten (her membership goes with her), then joins again: the restore's rule that drops
    # memberships older than a forget must not take her new membership for the backup's old one.
    deletions = DeletionService(derived)
    job = deletions.request(tenant_id=tenant, subject="zoe")
    deletions.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert "zoe" not in store.teams(tenant_id=tenant)["legal"]
    store.add_team_member(tenant_id=tenant, team_id="legal", user_id="zoe")

    # After the backup: an opt-out, an opt-out withdrawn, a subject's opt-out, a member removed, a
    # member added, and the sharing mode changed.
    store.set_do_not_sell(tenant_id=tenant, user_id="alice", memory_id=sold.memory_id, value=True)
    store.set_do_not_sell(tenant_id=tenant, user_id="alice", memory_id=unsold.memory_id, value=False)
    store.set_do_not_sell(tenant_id=tenant, user_id="carol", subject="carol", value=True)
    store.remove_team_member(tenant_id=tenant, team_id="legal", user_id="max")
    store.add_team_member(tenant_id=tenant, team_id="legal", user_id="zed")
    store.set_sharing_mode(tenant_id=tenant, sharing_mode="shared_pool")
    with pytest.raises(PermissionDeniedError):
        store.list_visible(tenant_id=tenant, user_id="max", team_id="legal")

    restored = backups.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    assert restored["state"] == "COMPLETE"

    flags = {m["memory_id"]: m["do_not_sell"] for m in store.list_visible(tenant_id=tenant, user_id="alice")}
    assert flags == {unsold.memory_id: False}  # personal view; the team memory is below
    team = store.list_visible(tenant_id=tenant, user_id="alice", team_id="legal")
    assert [(m["memory_id"], m["do_not_sell"]) for m in team] == [(sold.memory_id, True)]
    assert all(m["do_not_sell"] for m in store.list_visible(tenant_id=tenant, user_id="carol"))
    with pytest.raises(PermissionDeniedError):
        store.list_visible(tenant_id=tenant, user_id="max", team_id="legal")
    assert store.teams(tenant_id=tenant)["legal"] == ["alice", "zed", "zoe"]
    assert store.require_tenant(tenant_id=tenant) == "shared_pool"
    assert restored["consent"]["entries_replayed"] == 7

    # The rebuild after the restore (the backfill) leaves the opted-out rows out of analytics.
    derived.sync_all(tenant_id=tenant)
    assert set(derived.analytics.read_partition(tenant)["memory_id"].to_pylist()) == {unsold.memory_id}


# -- item 5: a backup in flight ---------------------------------------------------------------------


class LandsLate(LocalBackupStorage):
    """Local storage whose first upload waits for `meanwhile`: a snapshot taken, its upload not yet done."""

    def __init__(self, root: Path, meanwhile: Any) -> None:
        super().__init__(root)
        self.meanwhile = meanwhile

    def put_file(self, name: str, path: Path) -> None:
        if self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            meanwhile()
        super().put_file(name, path)


def test_a_backup_in_flight_is_counted_by_the_proof(store, derived, tenant, tmp_path):
    w = seed(store, derived, tenant)
    service = DeletionService(derived)
    jobs: dict[str, str] = {}
    seen_in_flight: list[dict[str, Any]] = []

    def forget_while_uploading() -> None:
        for name, scope in (("memory", {"memory_id": w["bob_gone"].memory_id}), ("subject", {"subject": "carol"})):
            job = service.request(tenant_id=tenant, **scope)
            service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
            assert service.status(job_id=job["job_id"])["state"] == "COMPLETE"
            jobs[name] = job["job_id"]
        seen_in_flight.extend(backups.list_backups(tenant_id=tenant))

    backups = BackupService(
        store,
        LandsLate(tmp_path / "backups", forget_while_uploading),
        staging=tmp_path / "staging",
        job_records=DeletionLedger(store),
    )
    manifest = backups.backup(tenant_id=tenant)
    # The backup holds bob's row and carol's (its snapshot predates both forgets): neither proof may
    # say that no backup holds them.
    memory_targets = service.proof(job_id=jobs["memory"])["targets"]
    assert memory_targets["backups"] == "PENDING_SHRED:1", memory_targets  # its version's key is destroyed
    assert service.proof(job_id=jobs["subject"])["targets"]["backups"] == "PENDING_SHRED:1"
    assert [(b["backup_id"], b["state"]) for b in seen_in_flight] == [(manifest["backup_id"], "IN_FLIGHT")]
    assert seen_in_flight[0]["snapshot_at"] is not None  # taken; its upload had not landed
    listed = backups.list_backups(tenant_id=tenant)
    assert [(b["backup_id"], b["state"], b["rows"]["memory_versions"]) for b in listed] == [
        (manifest["backup_id"], "DONE", 5)
    ]
    # And the journal replay still keeps what the backup holds from coming back.
    restored = backups.restore(tenant_id=tenant, backup_id=manifest["backup_id"])
    assert restored["state"] == "COMPLETE"
    assert {m["memory_id"] for m in store.list_visible(tenant_id=tenant, user_id="bob")} == {w["bob_keep"].memory_id}
    assert store.list_visible(tenant_id=tenant, user_id="carol") == []


def test_a_backup_that_fails_in_flight_is_not_counted(store, derived, tenant, tmp_path):
    w = seed(store, derived, tenant)

    def broken() -> None:
        raise OSError("disk full")

    backups = BackupService(
        store, LandsLate(tmp_path / "backups", broken), staging=tmp_path / "staging", job_records=DeletionLedger(store)
    )
    with pytest.raises(OSError):
        backups.backup(tenant_id=tenant)
    assert [b["state"] for b in backups.list_backups(tenant_id=tenant)] == ["FAILED"]
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, memory_id=w["bob_gone"].memory_id)
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert service.proof(job_id=job["job_id"])["targets"]["backups"] == "DONE:0"


# -- item 6: restore ids ----------------------------------------------------------------------------


def test_a_restore_id_is_one_tenants_and_a_clash_is_refused(store, derived, tmp_path, session_settings):
    first, second = ("t-" + uuid.uuid4().hex[:12] for _ in range(2))
    backups = service_for(store, tmp_path)
    manifests = {}
    for t in (first, second):
        seed(store, derived, t)
        manifests[t] = backups.backup(tenant_id=t)
    taken = "r_" + uuid.uuid4().hex[:16]
    done = backups.restore(tenant_id=first, backup_id=manifests[first]["backup_id"], restore_id=taken)
    assert done["state"] == "COMPLETE"
    with store.transaction() as conn:
        seq = conn.execute("SELECT completion_seq FROM control.restores WHERE restore_id = %s", (taken,)).fetchone()[0]

    before = row_counts(store.conninfo)
    for tenant, backup in ((second, manifests[second]), (first, manifests[first])):
        with pytest.raises(ConflictError) as err:
            backups.restore(tenant_id=tenant, backup_id=backup["backup_id"], restore_id=taken)
        assert err.value.field == "restore_id"
        if tenant == second:
            assert first not in err.value.message  # another tenant's id is never named
        with pytest.raises(ConflictError):
            backups.request_restore(tenant_id=tenant, backup_id=backup["backup_id"], restore_id=taken)
    for bad in ("x", "r_", "r_../../etc", "r_a b", "r_" + "a" * 80, "R_ABC", "r_ab';--", 7):
        with pytest.raises(ValidationError) as err:
            backups.restore(tenant_id=second, backup_id=manifests[second]["backup_id"], restore_id=bad)
        assert err.value.field == "restore_id"
    assert row_counts(store.conninfo) == before
    with store.transaction() as conn:
        row = conn.execute(
            "SELECT tenant_id, report->>'tenant_id' FROM control.restores WHERE restore_id = %s", (taken,)
        )
        assert row.fetchall() == [(first, first)]
    store.list_visible(tenant_id=second, user_id="bob")  # reads of the second tenant stay open

    # The backfill sensor's input: the first tenant once under that id, the second under its own.
    own = backups.restore(tenant_id=second, backup_id=manifests[second]["backup_id"])
    assert own["state"] == "COMPLETE" and own["restore_id"] != taken
    rebuilt = [(r["restore_id"], r["tenant_id"]) for r in completed_restores(store, after=seq - 1)]
    assert (taken, first) in rebuilt and (own["restore_id"], second) in rebuilt
    assert [t for r, t in rebuilt if r == taken] == [first]


def test_the_restore_launchpad_and_the_cli_refuse_a_restore_id_clash(
    store, derived, tmp_path, session_settings, cli_env
):
    from memory_pipelines.defs.backups.jobs import restore_job
    from memory_pipelines.resources import BackupResource, MemoryStoreResource

    first, second = ("t-" + uuid.uuid4().hex[:12] for _ in range(2))
    home = str(session_settings.home)
    service = BackupResource(home=home).service(store=store)
    manifests = {}
    for t in (first, second):
        seed(store, derived, t)
        manifests[t] = service.backup(tenant_id=t)
    taken = "r_" + uuid.uuid4().hex[:16]
    assert (
        service.restore(tenant_id=first, backup_id=manifests[first]["backup_id"], restore_id=taken)["state"]
        == "COMPLETE"
    )

    instance = dg.DagsterInstance.from_config(str(session_settings.dagster_home))
    try:
        instance.add_dynamic_partitions("tenants", [second])
        for restore_id, expected in ((taken, "restore_id: "), ("r_../x", "restore_id: malformed")):
            result = restore_job.execute_in_process(
                run_config={
                    "ops": {
                        "restore_tenant": {
                            "config": {"backup_id": manifests[second]["backup_id"], "restore_id": restore_id}
                        }
                    }
                },
                instance=instance,
                partition_key=second,
                resources={"memory_store": MemoryStoreResource(home=home), "backups": BackupResource(home=home)},
                raise_on_error=False,
            )
            assert not result.success
            failure = result.failure_data_for_node("restore_tenant")
            assert failure is not None and failure.user_failure_data is not None
            assert str(failure.user_failure_data.description).startswith(expected), failure.user_failure_data
    finally:
        instance.dispose()
    with store.transaction() as conn:
        assert conn.execute("SELECT tenant_id FROM control.restores WHERE restore_id = %s", (taken,)).fetchall() == [
            (first,)
        ]

    # The CLI: a clash exits 5, a malformed id 2, both naming the field; nothing is requested.
    env = cli_env["env"]  # the session's server; HOME is the session's, whose backups these are
    args = ["restore", "--tenant", second, "--backup", manifests[second]["backup_id"]]
    clash = run_cli(*args, "--restore-id", taken, home=session_settings.home, env=env)
    assert clash.returncode == 5, clash.stderr
    assert "restore_id" in clash.stderr and "Traceback" not in clash.stderr
    malformed = run_cli(*args, "--restore-id", "r_;drop", home=session_settings.home, env=env)
    assert malformed.returncode == 2 and "restore_id" in malformed.stderr, malformed.stderr
    fresh = "r_" + uuid.uuid4().hex[:16]
    requested = run_cli(*args, "--restore-id", fresh, home=session_settings.home, env=env)
    assert requested.returncode == 0, requested.stderr
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT restore_id, tenant_id, state FROM control.restores WHERE restore_id = ANY(%s) ORDER BY 1",
            ([taken, fresh],),
        ).fetchall()
    assert sorted(rows) == sorted([(taken, first, "COMPLETE"), (fresh, second, "REQUESTED")])
