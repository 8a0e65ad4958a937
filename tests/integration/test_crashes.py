"""Crash tests (issue 33): a lifecycle step killed with SIGKILL at named points of our code
(tests/support/crashes.py), then the next command or run checked: no temporary copy is left, and no
proof says ERASED while a copy of what it forgot is readable.

Each test works on one HOME of its own (the module's), with its own PostgreSQL and Chroma server.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from memory_pipelines.defs.runs.executors import LEASE_TAG
from memory_pipelines.lib.infra.leases import libpq_url
from memory_pipelines.lib.infra.services import Endpoints, ensure_services, stop_services
from memory_pipelines.lib.infra.settings import Settings
from tests.conftest import run_cli, settings_for
from tests.support.crashes import artifacts_under, cli_lost_with_its_host, run_here, run_killed, run_ok

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, Endpoints]]:
    settings = settings_for(tmp_path_factory.mktemp("crash-home"))
    endpoints = ensure_services(settings)
    try:
        yield settings, endpoints
    finally:
        stop_services(settings)


def _tenant() -> str:
    return "t-" + uuid.uuid4().hex[:12]


@pytest.mark.parametrize(
    "point", ["backup.snapshot_written", "backup.sealed", "storage.put.copied", "backup.object_uploaded"]
)
def test_a_backup_killed_at_each_step_leaves_nothing_once_the_next_command_starts(
    home: tuple[Settings, Endpoints], point: str
) -> None:
    """Finding 2: scratch (Parquet of the tenant's ciphertexts, the tar, the sealed object) and a
    partial upload were removed only by a `finally`, which SIGKILL skips; they stayed for ever."""
    settings, _ = home
    tenant = _tenant()
    run_killed(
        settings.home,
        point,
        f"""
        mp.write(tenant_id={tenant!r}, user_id="alice", text="alice keeps bees on the roof")
        mp.backup(tenant_id={tenant!r})
        """,
    )
    left = artifacts_under(settings.home)
    assert left, f"the control: a backup killed at {point} leaves its scratch or upload behind"
    listed = run_cli("tenants", home=settings.home)
    assert listed.returncode == 0, listed.stderr
    assert artifacts_under(settings.home) == []


def _backed_up(settings: Settings, tenant: str, *, then: str | None = None) -> str:
    """A memory of alice's written and backed up, then `then` written after the backup; the backup id."""
    out = run_here(
        settings.home,
        f"""
        import json
        mp.write(tenant_id={tenant!r}, user_id="alice", text="alice keeps bees on the roof")
        backup = mp.backup(tenant_id={tenant!r})
        then = {then!r}
        if then is not None:
            mp.write(tenant_id={tenant!r}, user_id="alice", text=then)
        print(json.dumps(backup["backup_id"]))
        """,
    )
    return str(json.loads(out.strip().splitlines()[-1]))


def test_a_restore_killed_with_the_backup_fetched_leaves_nothing_once_the_next_command_starts(
    home: tuple[Settings, Endpoints],
) -> None:
    settings, _ = home
    tenant = _tenant()
    backup_id = _backed_up(settings, tenant)
    run_killed(settings.home, "restore.fetched", f"mp.restore(tenant_id={tenant!r}, backup_id={backup_id!r})")
    assert any(p.name.startswith("scratch-") for p in artifacts_under(settings.home)), "the control"
    listed = run_cli("tenants", home=settings.home)
    assert listed.returncode == 0, listed.stderr
    assert artifacts_under(settings.home) == []


def test_a_vault_file_killed_while_being_made_leaves_no_copy_of_the_kek(home: tuple[Settings, Endpoints]) -> None:
    """A vault file is written whole under another name, then linked into place: a copy of the KEK
    left there would outlive the KEK's rotation, the crypto-erasure of everything it wrapped."""
    settings, _ = home
    tenant = _tenant()
    run_killed(
        settings.home,
        "vault.create.written",
        f'mp.write(tenant_id={tenant!r}, user_id="alice", text="alice keeps bees on the roof")',
    )
    vault = settings.key_vault_path
    assert [p.name for p in vault.iterdir() if p.name.startswith("new-")], "the control: the KEK's copy is there"
    listed = run_cli("tenants", home=settings.home)
    assert listed.returncode == 0, listed.stderr
    assert sorted(p.name for p in vault.iterdir() if not p.name.endswith(".kek")) == []


def _collections(settings: Settings) -> list[str]:
    with sqlite3.connect(str(settings.chroma_path / "chroma.sqlite3")) as db:
        return sorted(str(r[0]) for r in db.execute("SELECT name FROM collections"))


def _stored_anywhere(settings: Settings, record_ids: list[str]) -> dict[str, list[str]]:
    """Collection name -> which of `record_ids` it stores, through Chroma's own API (every collection)."""
    out = run_ok(
        settings.home,
        f"""
        import json
        client = mp.derived.vectors.client()
        found = {{}}
        for col in client.list_collections():
            got = client.get_collection(col.name).get(ids={record_ids!r}, include=[])["ids"]
            if got:
                found[col.name] = sorted(got)
        print(json.dumps(found))
        """,
    )
    return dict(json.loads(out.strip().splitlines()[-1]))


ERASE = "from memory_pipelines.lib.forget.erasure import ErasureService\n"


def _one_forgotten(settings: Settings, tenant: str, *, memories: int, backed_up: bool = False) -> tuple[list[str], str]:
    """Memories of alice, synced (and backed up), the first forgotten to COMPLETE: their ids and the job's."""
    out = run_here(
        settings.home,
        f"""
        import json
        ids = [mp.write(tenant_id={tenant!r}, user_id="alice", text=f"alice fact {{i}} about her garden")["memory_id"]
               for i in range({memories})]
        mp.sync(tenant_id={tenant!r})
        if {backed_up!r}:
            mp.backup(tenant_id={tenant!r})
        job = mp.forget(tenant_id={tenant!r}, memory_id=ids[0], basis="gdpr-art17")
        assert job.wait(timeout=120)["state"] == "COMPLETE"
        print(json.dumps([ids, job.job_id]))
        """,
    )
    ids, job_id = json.loads(out.strip().splitlines()[-1])
    return ids, job_id


def test_an_erasure_killed_between_dropping_and_renaming_the_collection_proves_nothing_it_left(
    home: tuple[Settings, Endpoints],
) -> None:
    """Finding 1: killed after deleting the tenant's collection and before renaming its rebuilt copy,
    the erasure left the copy (`mem-<hash>-rebuild`) and nothing removed it: a later forget reached
    COMPLETE and ERASED while its vector stayed readable through Chroma's API."""
    settings, _ = home
    tenant = _tenant()
    ids, _ = _one_forgotten(settings, tenant, memories=4)
    run_killed(
        settings.home,
        "vectors.rebuild.old_deleted",
        f"{ERASE}ErasureService(mp.derived).erase_tenant(tenant_id={tenant!r})",
    )
    staged = [name for name in _collections(settings) if name.endswith("-rebuild")]
    assert len(staged) == 1, f"the control: the rebuilt copy is left under its staging name ({_collections(settings)})"
    record = f"{ids[1]}:1"
    assert _stored_anywhere(settings, [record]) == {staged[0]: [record]}
    out = run_ok(
        settings.home,
        f"""
        import json
        from memory_pipelines.lib.forget.erasure import ErasureService
        job = mp.forget(tenant_id={tenant!r}, memory_id={ids[1]!r}, basis="gdpr-art17")
        assert job.wait(timeout=120)["state"] == "COMPLETE"
        report = ErasureService(mp.derived).erase_tenant(tenant_id={tenant!r})
        physical = mp.deletion_status(job_id=job.job_id)["targets"]["physical"]
        print(json.dumps({{"erased": report["erased"], "physical": physical}}))
        """,
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["erased"] == 2 and result["physical"].startswith("ERASED:")
    assert [name for name in _collections(settings) if name.endswith("-rebuild")] == []
    assert _stored_anywhere(settings, [record, f"{ids[0]}:1"]) == {}
    # What was not forgotten comes back with the next sync: the copy was dropped, not lost data.
    run_ok(settings.home, f"mp.sync(tenant_id={tenant!r})")
    kept = [f"{ids[2]}:1", f"{ids[3]}:1"]
    assert [sorted(ids) for ids in _stored_anywhere(settings, kept).values()] == [sorted(kept)]


def test_an_artifact_whose_maker_runs_is_never_swept_and_blocks_nothing_else(tmp_path: Path) -> None:
    """Makers and sweepers at once: 300 artifacts made, written, read back and removed by one process
    while another sweeps the same directory without pause; the maker finds every one whole."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from memory_pipelines.lib.infra import artifacts
        parent = Path({str(tmp_path)!r})
        for i in range(300):
            with artifacts.artifact(parent, "scratch-", owner="t", directory=True) as path:
                (path / "f").write_text(str(i))
                assert (path / "f").read_text() == str(i)
        print("ok")
        """
    )
    maker = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    from memory_pipelines.lib.infra import artifacts

    swept = 0
    while maker.poll() is None:
        swept += len(artifacts.sweep(tmp_path))
    out, err = maker.communicate()
    assert (maker.returncode, out.strip(), swept) == (0, "ok", 0), err[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_the_same_text_in_another_tenant_does_not_stop_an_erasure_that_scans_all_of_home(
    home: tuple[Settings, Endpoints],
) -> None:
    """The erasure scans every file under HOME, but another tenant's vectors are that tenant's own: the
    same text embedded alike is the same vector, and where the index's normalisation leaves it as it is
    (about a quarter of vectors here), the same bytes in that tenant's HNSW files. Those directories are
    left out of the scan (their unused capacity is cleared by the erasure), or such an erasure could
    never pass."""
    settings, _ = home
    mine, theirs = _tenant(), _tenant()
    out = run_here(
        settings.home,
        f"""
        import json
        import numpy as np
        from memory_pipelines.lib.forget.erasure import ErasureService
        candidates = [f"the lighthouse keeper's note number {{i}}" for i in range(24)]
        def write_alone(tenant, texts):
            # Each embedded alone (a batch of one), then 1,200 more: the server persists them to its files.
            ids = []
            for text in texts:
                ids.append(mp.write(tenant_id=tenant, user_id="alice", text=text)["memory_id"])
                mp.sync(tenant_id=tenant)
            mp.write_many(tenant_id=tenant, items=[{{"user_id": "bob", "text": f"note {{i}}"}} for i in range(1200)])
            mp.sync(tenant_id=tenant)
            got = mp.derived.vectors.collection(tenant).get(ids=[f"{{m}}:1" for m in ids], include=["embeddings"])
            files = b"".join(f.read_bytes() for s in mp.derived.vectors.segments(tenant) for f in s.rglob("*.bin"))
            vectors = dict(zip(got["ids"], (np.asarray(v, "<f4").tobytes() for v in got["embeddings"])))
            return [(m, vectors[f"{{m}}:1"], vectors[f"{{m}}:1"] in files) for m in ids]
        held = [text for text, (_, _, kept) in zip(candidates, write_alone({theirs!r}, candidates)) if kept]
        ((gone, vector, _),) = write_alone({mine!r}, held[:1])
        files = b"".join(f.read_bytes() for s in mp.derived.vectors.segments({theirs!r}) for f in s.rglob("*.bin"))
        found = vector in files
        job = mp.forget(tenant_id={mine!r}, memory_id=gone, basis="gdpr-art17")
        assert job.wait(timeout=120)["state"] == "COMPLETE"
        report = ErasureService(mp.derived).erase_tenant(tenant_id={mine!r})
        physical = mp.deletion_status(job_id=job.job_id)["targets"]["physical"]
        print(json.dumps({{"found": found, "erased": report["erased"], "physical": physical}}))
        """,
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert result["found"], "the control: the forgotten vector's very bytes are in the other tenant's files"
    assert result["erased"] == 1 and result["physical"].startswith("ERASED:")


def _restore_state(settings: Settings, tenant: str) -> dict[str, object]:
    out = run_ok(
        settings.home,
        f"""
        import json
        with mp.store.transaction() as conn:
            closed = conn.execute(
                "SELECT restoring_since IS NOT NULL FROM memory.tenants WHERE tenant_id = %s", ({tenant!r},)
            ).fetchone()[0]
            states = [r[0] for r in conn.execute(
                "SELECT state FROM control.restores WHERE tenant_id = %s ORDER BY created_at", ({tenant!r},)
            )]
        print(json.dumps({{"closed": closed, "states": states}}))
        """,
    )
    return dict(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.parametrize("point", ["restore.gate_closed", "restore.loaded", "restore.replayed"])
def test_a_restore_killed_behind_its_gate_reopens_the_tenant_at_the_next_command(
    home: tuple[Settings, Endpoints], point: str
) -> None:
    """Finding 4: a restore killed after closing its gate stayed RUNNING, and every read and forget of
    the tenant failed (exit 5, "being restored") until someone ran the restore again or `--reopen`. Its
    load is one transaction, which died with it: the next command reopens the tenant on the rows it had,
    and the restore is INTERRUPTED, which the same restore id may run again."""
    settings, _ = home
    tenant = _tenant()
    backup_id = _backed_up(settings, tenant, then="alice sold the bees in May")
    run_killed(settings.home, point, f"mp.restore(tenant_id={tenant!r}, backup_id={backup_id!r})")
    assert _restore_state(settings, tenant) == {"closed": True, "states": ["RUNNING"]}, "the control"
    listed = run_cli("list", "--tenant", tenant, "--user", "alice", home=settings.home)
    assert listed.returncode == 0, listed.stderr
    assert len(json.loads(listed.stdout)) == 2  # the rows it had: the load never committed
    assert _restore_state(settings, tenant) == {"closed": False, "states": ["INTERRUPTED"]}
    again = run_ok(
        settings.home,
        f"""
        import json
        print(json.dumps(mp.restore(tenant_id={tenant!r}, backup_id={backup_id!r})["state"]))
        """,
    )
    assert json.loads(again.strip().splitlines()[-1]) == "COMPLETE"
    listed = run_cli("list", "--tenant", tenant, "--user", "alice", home=settings.home)
    assert listed.returncode == 0 and len(json.loads(listed.stdout)) == 1, listed.stderr


def _runs(endpoints: Endpoints, tenant: str) -> list[dict[str, Any]]:
    """The tenant's runs, newest first, from the Dagster instance's own tables: status, lease tag and
    the failure's message."""
    with psycopg.connect(libpq_url(endpoints.dagster_url)) as conn:
        rows = conn.execute(
            "SELECT r.run_id, r.pipeline_name, r.status,"
            " (SELECT value FROM run_tags t WHERE t.run_id = r.run_id AND t.key = %s),"
            " (SELECT e.event FROM event_logs e WHERE e.run_id = r.run_id"
            "   AND e.dagster_event_type = 'PIPELINE_FAILURE' ORDER BY e.id DESC LIMIT 1)"
            " FROM runs r WHERE EXISTS (SELECT 1 FROM run_tags t WHERE t.run_id = r.run_id"
            "   AND t.key = 'dagster/partition' AND t.value = %s)"
            " ORDER BY r.id DESC",
            (LEASE_TAG, tenant),
        ).fetchall()
    return [
        {
            "run_id": run_id,
            "job": job,
            "status": status,
            "lease": lease,
            "failure": "" if event is None else json.loads(event)["dagster_event"]["message"] or "",
        }
        for run_id, job, status, lease, event in rows
    ]


def _yesterday() -> str:
    return (datetime.now(UTC).date() - timedelta(days=1)).isoformat()


# Each command that waits on a tenant's runs: (the command whose run loses its host, the command then
# waiting). {t} is the tenant, {job} a deletion job accepted beforehand (not yet run).
WAITING_COMMANDS = {
    "materialize": ("materialize --tenant {t}", "materialize --tenant {t}"),
    "backup": ("backup --tenant {t}", "backup --tenant {t}"),
    "deletion erase": ("deletion erase --tenant {t}", "deletion erase --tenant {t}"),
    "retention sweep --wait": ("retention sweep --wait --tenant {t} --date {day}",) * 2,
    "forget --wait": ("forget --tenant {t} --subject bob --wait", "forget --tenant {t} --subject bob --wait"),
    "deletion retry": ("deletion retry {job}", "deletion retry {job}"),
}


@pytest.mark.parametrize("command", list(WAITING_COMMANDS))
def test_a_run_lost_with_its_host_never_holds_up_the_tenants_next_command(
    home: tuple[Settings, Endpoints], command: str
) -> None:
    """Finding 3: a run whose worker died with its code server stayed STARTED, and each later command
    of the tenant waited behind it for ever, with no output. Now the next command finds the run's
    lease gone, marks it failed with the reason, says so, and runs; the work resumes from its record."""
    settings, endpoints = home
    tenant = _tenant()
    for user, text in (("alice", "alice keeps bees"), ("bob", "bob mends clocks")):
        wrote = run_cli("write", "--tenant", tenant, "--user", user, text, home=settings.home)
        assert wrote.returncode == 0, wrote.stderr
    accepted = run_cli("forget", "--tenant", tenant, "--subject", "bob", home=settings.home)
    assert accepted.returncode == 0, accepted.stderr
    fill = {"t": tenant, "job": json.loads(accepted.stdout)["job_id"], "day": _yesterday()}
    lost, waiting = (line.format(**fill).split() for line in WAITING_COMMANDS[command])
    cli_lost_with_its_host(settings.home, "run.leased", *lost)
    dead = _runs(endpoints, tenant)[0]
    assert (dead["status"], dead["lease"]) == ("STARTED", "held"), "the control: a run nobody will end"

    started = time.monotonic()
    ran = run_cli(*waiting, home=settings.home, timeout=240)
    took = time.monotonic() - started
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert f"run {dead['run_id']} " in ran.stderr and "marked failed: its worker's lease ended" in ran.stderr
    runs = {run["run_id"]: run for run in _runs(endpoints, tenant)}
    assert runs[dead["run_id"]]["status"] == "FAILURE"
    assert runs[dead["run_id"]]["failure"].startswith("Run worker lost: its worker's lease ended")
    newest = _runs(endpoints, tenant)[0]
    assert newest["status"] == "SUCCESS" and newest["job"] == dead["job"], newest
    assert took < 120, f"{command} took {took:.0f} s behind a dead run"
    if "{job}" in WAITING_COMMANDS[command][1] or "forget" in command:
        assert json.loads(ran.stdout)["state"] == "COMPLETE"


def test_a_run_lost_before_its_first_step_is_failed_after_the_start_timeout(
    home: tuple[Settings, Endpoints],
) -> None:
    """A worker that died while STARTING never took its lease: the next command waits no longer than
    the instance's start timeout (run_monitoring.start_timeout_seconds, 20 s here), says on what, and runs."""
    settings, endpoints = home
    tenant = _tenant()
    wrote = run_cli("write", "--tenant", tenant, "--user", "alice", "alice keeps bees", home=settings.home)
    assert wrote.returncode == 0, wrote.stderr
    yaml_file = settings.dagster_home / "dagster.yaml"
    shipped = yaml_file.read_text()
    yaml_file.write_text(shipped.replace("start_timeout_seconds: 120", "start_timeout_seconds: 20"))
    try:
        cli_lost_with_its_host(settings.home, "run.executor", "materialize", "--tenant", tenant)
        dead = _runs(endpoints, tenant)[0]
        assert (dead["status"], dead["lease"]) == ("STARTING", None), "the control: a run that never started"
        started = time.monotonic()
        ran = run_cli("materialize", "--tenant", tenant, home=settings.home, timeout=240)
        took = time.monotonic() - started
    finally:
        yaml_file.write_text(shipped)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert f"waiting for run {dead['run_id']} (tenant_refresh {tenant}, STARTING" in ran.stderr
    assert "did not reach its first step within 20 s" in ran.stderr
    assert {run["run_id"]: run["status"] for run in _runs(endpoints, tenant)}[dead["run_id"]] == "FAILURE"
    assert took < 90, f"waited {took:.0f} s on a run that never started"


def test_the_sensor_fails_a_run_lost_with_its_host_when_no_command_waits(
    home: tuple[Settings, Endpoints], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the daemon nobody may be waiting: its sensor tick finds the dead run by its lease."""
    import dagster as dg

    from memory_pipelines.defs.runs.sensors import dead_run_workers_sensor
    from memory_pipelines.lib.infra.settings import ENV_DAGSTER_PG_URL

    settings, endpoints = home
    tenant = _tenant()
    wrote = run_cli("write", "--tenant", tenant, "--user", "alice", "alice keeps bees", home=settings.home)
    assert wrote.returncode == 0, wrote.stderr
    cli_lost_with_its_host(settings.home, "run.leased", "materialize", "--tenant", tenant)
    dead = _runs(endpoints, tenant)[0]
    assert dead["status"] == "STARTED"
    monkeypatch.setenv(ENV_DAGSTER_PG_URL, endpoints.dagster_url)
    with dg.DagsterInstance.from_config(str(settings.dagster_home)) as instance:
        result = dead_run_workers_sensor(dg.build_sensor_context(instance=instance))
        again = dead_run_workers_sensor(dg.build_sensor_context(instance=instance))
    assert isinstance(result, dg.SkipReason) and (result.skip_message or "").startswith("1 run(s) with a dead worker")
    assert isinstance(again, dg.SkipReason) and again.skip_message == "no run's worker is lost"
    failed = {run["run_id"]: run for run in _runs(endpoints, tenant)}[dead["run_id"]]
    assert failed["status"] == "FAILURE"
    assert "Marked failed by the dead_run_workers_sensor" in failed["failure"]


# The harness's set for the other lifecycle operations: each point, the operation killed there, and
# what the next command runs. `forget.<phase>` points follow each group of the cascade's phases
# (after the derived stores, the primary rows, the key store, verification, the proofs).
LIFECYCLE = {
    "forget.frozen": "forget",
    "forget.delete_recall_cache": "forget",
    "forget.delete_primary": "forget",
    "forget.delete_key_store": "forget",
    "forget.verify": "forget",
    "forget.prove": "forget",
    "kek.introduced": "rotate",
    "kek.committed": "rotate",
    "write_many.chunk_committed#2": "write_many",
    "vectors.sync.chunk_written": "sync",
    "sync.keyword_index": "sync",
    "retention.requested": "retention",
}
BULK = [{"user_id": "dave", "text": f"dave bulk note {i} on the river path"} for i in range(300)]
KILLED = {
    "forget": "mp.forget(tenant_id={t!r}, subject='bob').wait(timeout=120)",
    "rotate": "ErasureService(mp.derived).rotate_keys({t!r})",
    "write_many": "mp.write_many(tenant_id={t!r}, items={bulk})",
    "sync": "mp.sync(tenant_id={t!r})",
    "retention": "mp.sweep_retention(day={day!r}, tenant_id={t!r})",
}
# The next command: every open deletion job run to COMPLETE, the killed operation again where it is
# one to finish; then what the checks read, through the API and Chroma's.
NEXT = """
import json
from memory_pipelines.lib.forget.erasure import ErasureService
t = {t!r}
if {op!r} in ("rotate", "sync", "retention"):
    exec({killed!r})
jobs = mp.deletion_jobs(tenant_id=t)
states = [mp.deletion(job_id=j["job_id"]).wait(timeout=120)["state"] for j in jobs]
listed = {{u: sorted(m["text"] for m in mp.list(tenant_id=t, user_id=u)) for u in ("alice", "bob", "dave", "erin")}}
current = sorted(f"{{m['memory_id']}}:{{m['version']}}" for u in ("alice", "bob", "erin")
                 for m in mp.list(tenant_id=t, user_id=u))
client = mp.derived.vectors.client()
stored = sorted(i for c in client.list_collections() if (c.metadata or {{}}).get("tenant_id") == t
                for i in client.get_collection(c.name).get(include=[])["ids"])
print(json.dumps({{"states": states, "scopes": [j["scope"] for j in jobs], "listed": listed, "current": current,
                  "stored": stored, "keks": len(mp.store.keys.vault.kek_ids(t)),
                  "collections": [c.name for c in client.list_collections()]}}))
"""


@pytest.mark.parametrize("point", list(LIFECYCLE))
def test_a_lifecycle_operation_killed_at_each_step_is_finished_by_the_next_command(
    home: tuple[Settings, Endpoints], point: str
) -> None:
    """Forget in each state, KEK rotation, write_many, sync (what materialize runs) and retention,
    each killed at a step: the next command leaves every acknowledged write readable whole, every
    accepted forget COMPLETE and its data gone from every store, Chroma holding exactly the current
    versions, one KEK, and no artifact."""
    settings, _ = home
    tenant, op = _tenant(), LIFECYCLE[point]
    fill = {"t": tenant, "day": _yesterday(), "bulk": repr(BULK)}
    texts = {"alice": ["alice keeps bees", "alice sings alto"], "bob": ["bob mends clocks", "bob rows at dawn"]}
    run_here(
        settings.home,
        f"""
        for user, texts in {texts!r}.items():
            for text in texts:
                mp.write(tenant_id={tenant!r}, user_id=user, text=text)
        mp.write(tenant_id={tenant!r}, user_id="erin", text="erin lives in Lyon", category="eu_user")
        """
        + ("" if op == "sync" else f"mp.sync(tenant_id={tenant!r})"),
    )
    run_killed(settings.home, point, f"{ERASE}{KILLED[op].format(**fill)}")
    after = json.loads(
        run_ok(settings.home, NEXT.format(op=op, killed=KILLED[op].format(**fill), **fill)).strip().splitlines()[-1]
    )
    assert artifacts_under(settings.home) == [] and not [c for c in after["collections"] if c.endswith("-rebuild")]
    assert set(after["states"]) <= {"COMPLETE"}, after["states"]
    assert after["listed"]["alice"] == sorted(texts["alice"])  # never touched: whole, whatever was killed
    assert after["listed"]["bob"] == ([] if op == "forget" else sorted(texts["bob"]))
    assert after["listed"]["erin"] == ([] if op == "retention" else ["erin lives in Lyon"])
    if op == "write_many":  # some chunks committed, each whole; the call never returned
        bulk = [item["text"] for item in BULK]
        assert 0 < len(after["listed"]["dave"]) < len(bulk) and set(after["listed"]["dave"]) <= set(bulk)
        assert len(set(after["listed"]["dave"])) == len(after["listed"]["dave"])
    else:
        assert after["stored"] == after["current"], "Chroma holds exactly the current versions of the tenant"
    if op == "retention":
        assert [s["memory_id"] is not None for s in after["scopes"]] == [True]  # one job, not one per attempt
    if op == "rotate":
        assert after["keks"] == 1, "the rotation run again leaves the new KEK alone in the vault"


ERASURE_STEPS = [
    "erasure.keys_rotated",
    "kek.committed",
    "vectors.rebuild.copied",
    "erasure.rewrote.chroma",
    "erasure.rewrote.analytics",
    "erasure.rewrote.primary",
    "erasure.rewrote.key_store",
    "erasure.wal_purged",
]


@pytest.mark.parametrize("point", ERASURE_STEPS)
def test_an_erasure_killed_at_each_step_is_proven_only_by_the_next_one(
    home: tuple[Settings, Endpoints], point: str
) -> None:
    """Killed at each step, an erasure marks nothing; the next one rewrites, scans and marks ERASED,
    the forgotten vector is in no collection, the kept ones come back with the next sync, one KEK
    is left, and nothing is left under HOME."""
    settings, _ = home
    tenant = _tenant()
    ids, job_id = _one_forgotten(settings, tenant, memories=3, backed_up=True)
    run_killed(settings.home, point, f"{ERASE}ErasureService(mp.derived).erase_tenant(tenant_id={tenant!r})")
    out = run_ok(
        settings.home,
        f"""
        import json
        {ERASE.strip()}
        before = mp.deletion_status(job_id={job_id!r})["targets"]["physical"]
        report = ErasureService(mp.derived).erase_tenant(tenant_id={tenant!r})
        mp.sync(tenant_id={tenant!r})
        print(json.dumps({{"before": before, "erased": report["erased"], "hits": report["byteScan"]["hits"],
                          "physical": mp.deletion_status(job_id={job_id!r})["targets"]["physical"],
                          "keks": len(mp.store.keys.vault.kek_ids({tenant!r}))}}))
        """,
    )
    after = json.loads(out.strip().splitlines()[-1])
    assert after["before"].startswith("PENDING"), "the killed erasure marked nothing"
    assert (after["erased"], after["hits"], after["keks"]) == (1, 0, 1)
    assert after["physical"].startswith("ERASED:")
    assert _stored_anywhere(settings, [f"{ids[0]}:1"]) == {}
    kept = sorted(f"{i}:1" for i in ids[1:])
    assert [sorted(found) for found in _stored_anywhere(settings, kept).values()] == [kept]
    assert artifacts_under(settings.home) == [] and not [c for c in _collections(settings) if c.endswith("-rebuild")]
