"""Crash tests (issue 33): a lifecycle step killed with SIGKILL at named points of our code
(tests/support/crashes.py), then the next command or run checked: no temporary copy is left, and no
proof says ERASED while a copy of what it forgot is readable.

Each test works on one HOME of its own (the module's), with its own PostgreSQL and Chroma server.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from memory_pipelines.lib.infra.services import Endpoints, ensure_services, stop_services
from memory_pipelines.lib.infra.settings import Settings
from tests.conftest import run_cli, settings_for
from tests.support.crashes import artifacts_under, run_killed, run_ok

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
    out = run_ok(
        settings.home,
        f"""
        import json
        mp.write(tenant_id={tenant!r}, user_id="alice", text="alice keeps bees on the roof")
        backup = mp.backup(tenant_id={tenant!r})
        if {then!r} is not None:
            mp.write(tenant_id={tenant!r}, user_id="alice", text={then!r})
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


def test_an_erasure_killed_between_dropping_and_renaming_the_collection_proves_nothing_it_left(
    home: tuple[Settings, Endpoints],
) -> None:
    """Finding 1: killed after deleting the tenant's collection and before renaming its rebuilt copy,
    the erasure left the copy (`mem-<hash>-rebuild`) and nothing removed it: a later forget reached
    COMPLETE and ERASED while its vector stayed readable through Chroma's API."""
    settings, _ = home
    tenant = _tenant()
    out = run_ok(
        settings.home,
        f"""
        import json
        ids = [mp.write(tenant_id={tenant!r}, user_id="alice", text=f"alice fact {{i}} about her garden")["memory_id"]
               for i in range(4)]
        mp.sync(tenant_id={tenant!r})
        job = mp.forget(tenant_id={tenant!r}, memory_id=ids[0], basis="gdpr-art17")
        assert job.wait(timeout=120)["state"] == "COMPLETE"
        print(json.dumps(ids))
        """,
    )
    ids = json.loads(out.strip().splitlines()[-1])
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
    out = run_ok(
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
