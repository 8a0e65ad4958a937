"""Issue 20, item 3: what PostgreSQL's history (WAL, dead tuples) keeps after an erasure is useless.

Each test runs on a HOME of its own (its own embedded PostgreSQL, so its pg_wal holds only its own
history) and reads the files under it as an attacker with a copy of HOME would: the master key,
every KEK of the key vault, every key left in the key store, and every file (tests/support/attacker.py).
"""

from __future__ import annotations

import base64
import dataclasses
import os
import re
import shutil
import stat
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from memory_pipelines.lib.agent_runs.runs import AgentRuns
from memory_pipelines.lib.forget import certificate, wal
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.erasure import ErasureService
from memory_pipelines.lib.infra.errors import NotFoundError
from memory_pipelines.lib.infra.services import Endpoints, ensure_services, stop_services
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.key_rotation import KeyRotation
from memory_pipelines.lib.memories.key_vault import VAULT_BYTES
from memory_pipelines.lib.memories.keys import KeyDestroyedError, KeyStore
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.runtime import open_backups, open_store
from memory_pipelines.lib.stores import bytescan
from memory_pipelines.lib.stores.derived import DerivedStores, open_derived
from memory_pipelines.lib.stores.summaries.store import ExtractiveSummarizer, SummaryStore
from tests.conftest import settings_for
from tests.support.attacker import Attacker, find_exact, home_files, try_open, wal_files

pytestmark = pytest.mark.slow


class World:
    def __init__(self, settings: Settings, endpoints: Endpoints, store: MemoryStore, derived: DerivedStores) -> None:
        self.settings = settings
        self.endpoints = endpoints
        self.store = store
        self.derived = derived

    @property
    def home(self) -> Path:
        return self.settings.home

    def checkpoint(self) -> None:
        with psycopg.connect(self.endpoints.store_conninfo, autocommit=True) as conn:
            conn.execute("CHECKPOINT")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A fresh HOME with its own embedded PostgreSQL and Chroma, stopped at the end."""
    settings = settings_for(tmp_path_factory.mktemp("wal-home"))
    endpoints = ensure_services(settings)
    store = open_store(settings, endpoints)
    derived = open_derived(settings, store, endpoints=endpoints)
    try:
        yield World(settings, endpoints, store, derived)
    finally:
        store.close()
        stop_services(settings)


def _seed(w: World, tenant: str) -> dict[str, Any]:
    """alice and bob in team core; alice's medical fact reaches the team summary; bob has a run
    whose prompt snapshot holds the memory of his that is forgotten."""
    store, derived = w.store, w.derived
    canary = uuid.uuid4().hex[:10]
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="alice")
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="bob")
    mem = {
        "alice_team": store.write(
            tenant_id=tenant, user_id="alice", text=f"alice is treated for epilepsy {canary}", team_id="core"
        ),
        "alice_personal": store.write(tenant_id=tenant, user_id="alice", text=f"alice hides licorice {canary}"),
        "bob_keep": store.write(tenant_id=tenant, user_id="bob", text=f"bob keeps a sourdough starter {canary}"),
        "bob_forget": store.write(tenant_id=tenant, user_id="bob", text=f"bob owes the casino money {canary}"),
    }
    derived.sync_all(tenant_id=tenant)
    runs = AgentRuns(derived)
    lease = runs.open(tenant_id=tenant, subject_id="bob", run_id="run-1")
    runs.recall(lease_id=lease, query="what does bob owe the casino?")
    snapshot = runs.snapshot_prompt(
        lease_id=lease,
        prompt=f"user bob: bob owes the casino money {canary}",
        sources=[(mem["bob_forget"].memory_id, mem["bob_forget"].version)],
    )
    return {"canary": canary, "snapshot_id": snapshot["snapshot_id"], **mem}


def _capture(w: World, tenant: str, seeded: dict[str, Any]) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """What the deletion will remove, as stored now (exact bytes), and the associated data of each."""
    blobs: dict[str, bytes] = {}
    aads: dict[str, bytes] = {}
    with w.store.transaction() as conn:
        key_id, wrapped = conn.execute(
            "SELECT key_id, wrapped FROM keystore.subject_keys WHERE tenant_id = %s AND user_id = 'alice'", (tenant,)
        ).fetchone()  # type: ignore[misc]
        blobs["alice_wrapped_key"] = bytes(wrapped)
        aads["alice_wrapped_key"] = crypto.aad("subject-key", tenant, "alice", key_id)
        for name in ("alice_team", "alice_personal", "bob_forget"):
            memory_id = seeded[name].memory_id
            for version, ct in conn.execute(
                "SELECT version, text_ct FROM memory.memory_versions WHERE tenant_id = %s AND memory_id = %s",
                (tenant, memory_id),
            ):
                blobs[f"{name}_v{version}"] = bytes(ct)
                aads[f"{name}_v{version}"] = crypto.aad("memory-text", tenant, memory_id, version)
        for scope, scope_id, ct in conn.execute(
            "SELECT scope, scope_id, summary_ct FROM derived.summaries WHERE tenant_id = %s", (tenant,)
        ):
            blobs[f"summary_{scope}_{scope_id}"] = bytes(ct)
            aads[f"summary_{scope}_{scope_id}"] = crypto.aad("summary", tenant, scope, scope_id)
        (ct,) = conn.execute(
            "SELECT prompt_ct FROM derived.prompt_snapshots WHERE tenant_id = %s AND snapshot_id = %s",
            (tenant, seeded["snapshot_id"]),
        ).fetchone()  # type: ignore[misc]
        blobs["prompt_snapshot"] = bytes(ct)
        aads["prompt_snapshot"] = crypto.aad("prompt-snapshot", tenant, seeded["snapshot_id"])
    return blobs, aads


def _fingerprints(w: World, jobs: list[str]) -> set[int]:
    """The fingerprints the cascade (or a restore) took of what the jobs removed; the erasure drops them."""
    with w.store.transaction() as conn:
        return {
            int(r[0])
            for r in conn.execute(
                "SELECT DISTINCT fingerprint FROM control.erasure_fingerprints WHERE job_id = ANY(%s)"
                " AND fingerprint <> 0",
                (jobs,),
            )
        }


def _forget(w: World, tenant: str, seeded: dict[str, Any]) -> list[str]:
    """SUBJECT forget of alice and MEMORY forget of bob's memory, to COMPLETE."""
    service = DeletionService(w.derived)
    jobs = [
        service.request(tenant_id=tenant, subject="alice")["job_id"],
        service.request(tenant_id=tenant, memory_id=seeded["bob_forget"].memory_id)["job_id"],
    ]
    service.run_batch(tenant_id=tenant, job_ids=jobs)
    assert [service.status(job_id=j)["state"] for j in jobs] == ["COMPLETE", "COMPLETE"]
    return jobs


def _erase(w: World, tenant: str, jobs: list[str]) -> dict[str, Any]:
    report = ErasureService(w.derived).erase_tenant(tenant_id=tenant)
    assert report["jobs"] == sorted(jobs) or set(report["jobs"]) == set(jobs), report["jobs"]
    assert report["byteScan"]["hits"] == 0
    return report


def _markers(seeded: dict[str, Any], gone: dict[str, bytes]) -> dict[str, tuple[bytes, ...]]:
    """For the summaries: the forgotten texts, one of which an old summary states and the live one does not."""
    forgotten = tuple(
        f"{phrase} {seeded['canary']}".encode()
        for phrase in ("alice is treated for epilepsy", "alice hides licorice", "bob owes the casino money")
    )
    return {name: forgotten for name in gone if name.startswith("summary_")}


def _attack(
    w: World,
    tenant: str,
    gone: dict[str, bytes],
    aads: dict[str, bytes],
    fingerprints: set[int],
    markers: dict[str, tuple[bytes, ...]],
) -> None:
    """Everything under HOME as an attacker reads it, after a CHECKPOINT: no file holds the bytes
    of what is gone (exact, and by the jobs' fingerprints); no destroyed key is rebuilt from a
    wrapped copy carved out of any file; no sealed blob carved out of pg_wal opens under any key left
    (master key, every vault KEK, every key of the key store, every key rebuilt) as any target."""
    w.checkpoint()
    files = home_files(w.home)
    found = find_exact(files, gone)
    with w.store.transaction() as conn:
        base = bytescan.base_from_key(w.store.keys.control_key(conn))
    hits = {str(Path(f).relative_to(w.home)): n for f, n in bytescan.scan(files, fingerprints, base).hits.items()}
    attacker = Attacker(w.home, w.endpoints.store_conninfo, tenant)
    recovered = attacker.recover_destroyed(files)
    keys = [*attacker.keys.values(), *recovered.values()]
    opened_exact = {name: f for name, f in found.items() if try_open(keys, gone[name], [aads[name]]) is not None}
    opened_carved = attacker.open_carved(wal_files(w.home), {n: aads[n] for n in gone}, keys, markers)
    assert (found, hits, recovered, opened_exact, opened_carved) == ({}, {}, {}, {}, {}), _describe(
        w.home, found, hits, recovered, opened_exact, opened_carved
    )
    assert attacker.kek_count >= 1  # the attacker did hold the live KEK: what it opens is all there is


def _describe(home: Path, *parts: Any) -> str:
    def rel(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: "<a key>" if isinstance(v, bytes) else rel(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rel(v) for v in value]
        return str(value).replace(str(home), "HOME") if isinstance(value, str) else value

    names = ("found", "fingerprint hits", "destroyed keys recovered", "found and opened", "carved from WAL and opened")
    return "\n".join(f"{name}: {rel(part)}" for name, part in zip(names, parts, strict=True))


def _gone(blobs: dict[str, bytes]) -> dict[str, bytes]:
    """Everything but bob's kept memory: alice's key and texts, bob's forgotten memory, every summary
    as it was (each stated a forgotten text, or was rebuilt since) and the snapshot."""
    return {name: blob for name, blob in blobs.items() if not name.startswith("bob_keep")}


def test_after_erasure_an_attacker_with_home_opens_nothing_forgotten(world: World) -> None:
    """The reproduction of item 3. Before the fix, after ERASED and a CHECKPOINT, pg_wal held alice's
    wrapped key (destroyed), every old summary, the snapshot and the forgotten ciphertexts, and all
    of them opened with the master key and the keys left (alice's key rebuilt from its WAL copy)."""
    tenant = "t-" + uuid.uuid4().hex[:12]
    seeded = _seed(world, tenant)
    blobs, aads = _capture(world, tenant, seeded)
    wal_dir = world.settings.pgdata / "pg_wal"
    with psycopg.connect(world.endpoints.store_conninfo, autocommit=True) as conn:
        assert conn.execute("SHOW wal_recycle").fetchone() == ("off",)  # set by ensure_services
    jobs = _forget(world, tenant, seeded)
    fingerprints = _fingerprints(world, jobs)
    segments_before = set(wal.segments(wal_dir))
    report = _erase(world, tenant, jobs)

    assert report["keys"]["rotated"] and report["keys"]["keksLeft"] == 1
    assert report["keys"]["rewrapped"]["tenant"] == 1 and report["keys"]["rewrapped"]["subject"] == 1  # bob's
    assert report["wal"]["purged"] and report["wal"]["segmentsLeft"] == 0
    assert not segments_before & set(wal.segments(wal_dir))  # every segment of before is unlinked
    scanned = {area["path"] for area in report["byteScan"]["scanned"]}
    assert "pg/data/pg_wal" in scanned and "pg/data/base" in scanned, scanned
    _attack(world, tenant, _gone(blobs), aads, fingerprints, _markers(seeded, blobs))

    # The certificate says what was scanned and what no file-level proof reaches.
    service = DeletionService(world.derived)
    markdown = certificate.render_markdown(service.proof(job_id=jobs[0]), service.status(job_id=jobs[0]))
    for expected in ("pg/data/pg_wal", "rotated", "free filesystem blocks", "SSD", "journal"):
        assert expected.lower() in markdown.lower(), expected


def test_a_copy_of_the_wal_the_erasure_cannot_reach_opens_nothing_forgotten(world: World, tmp_path: Path) -> None:
    """A WAL the erasure cannot remove (a replica's, an archive's, an external server's), here pg_wal
    copied aside after the forgets and before the erasure: it holds alice's wrapped key, bob's
    forgotten ciphertext with its wrapped version key, the old summaries and the snapshot. With
    every key left, nothing of it opens: each was sealed under a key the deletion destroyed, whose
    wrapped copies the rotation made useless. Before version keys, bob's MEMORY-scope ciphertext
    opened here under his live subject key (issue 32)."""
    tenant = "t-" + uuid.uuid4().hex[:12]
    seeded = _seed(world, tenant)
    blobs, aads = _capture(world, tenant, seeded)
    destroyed = _key_ids(world, tenant, seeded)
    gone = _gone(blobs)
    archive = tmp_path / "archive"  # every segment, as an archive would have it: copied before any could go
    shutil.copytree(world.settings.pgdata / "pg_wal", archive)
    jobs = _forget(world, tenant, seeded)
    shutil.copytree(world.settings.pgdata / "pg_wal", archive, dirs_exist_ok=True)
    report = _erase(world, tenant, jobs)
    assert report["keys"]["rotated"] and report["keys"]["rekeyed"]["groups"] >= 1
    copied = home_files(archive)
    found = find_exact(copied, gone)
    assert {"alice_wrapped_key", "bob_forget_v1", "summary_team_core", "prompt_snapshot"} <= set(found)  # the control
    attacker = Attacker(world.home, world.endpoints.store_conninfo, tenant)
    recovered = attacker.recover(copied, destroyed)
    keys = [*attacker.keys.values(), *recovered.values()]
    opened = attacker.open_carved(copied, {n: aads[n] for n in gone}, keys, _markers(seeded, gone))
    assert (recovered, opened) == ({}, {}), _describe(world.home, found, {}, recovered, {}, opened)
    assert attacker.kek_count >= 1 and any(name.startswith("version:") for name in attacker.keys)


def _key_ids(w: World, tenant: str, seeded: dict[str, Any]) -> dict[str, tuple[str, str | None]]:
    """key id -> (kind, owner) of every key the forgets of `_forget` destroy: alice's subject and group
    keys, the version keys of her memories and of bob's forgotten one, and bob's group key (rekeyed)."""
    with w.store.transaction() as conn:
        rows = conn.execute(
            "SELECT 'subject', user_id, key_id FROM keystore.subject_keys WHERE tenant_id = %(t)s AND user_id = 'alice'"
            " UNION ALL SELECT 'group', user_id, key_id FROM keystore.group_keys WHERE tenant_id = %(t)s"
            " UNION ALL SELECT 'version', NULL, key_id FROM keystore.version_keys WHERE tenant_id = %(t)s"
            " AND memory_id = ANY(%(m)s)",
            {
                "t": tenant,
                "m": [seeded[n].memory_id for n in ("alice_team", "alice_personal", "bob_forget")],
            },
        ).fetchall()
    return {str(key_id): (str(kind), owner) for kind, owner, key_id in rows}


def test_forget_erase_restore_erase_leaves_nothing_any_key_left_opens(world: World) -> None:
    """Done when (issue 20): forget -> erase -> restore of a backup taken before the deletion -> the
    next erasure; then no file under HOME (pg_wal included) holds the jobs' fingerprints or the
    wrapped subject key, and nothing carved out of the WAL opens under any key left under HOME."""
    tenant = "t-" + uuid.uuid4().hex[:12]
    seeded = _seed(world, tenant)
    blobs, aads = _capture(world, tenant, seeded)
    backups = open_backups(world.settings, world.store)
    before = backups.backup(tenant_id=tenant)
    jobs = _forget(world, tenant, seeded)
    fingerprints = _fingerprints(world, jobs)
    _erase(world, tenant, jobs)

    backups.restore(tenant_id=tenant, backup_id=before["backup_id"])
    fingerprints |= _fingerprints(world, jobs)  # what the restore's replay removed, if it owes an erasure
    world.derived.sync_all(tenant_id=tenant)  # the backfill a restore launches
    ErasureService(world.derived).erase_tenant(tenant_id=tenant)  # the next erasure (a no-op if none is owed)
    service = DeletionService(world.derived)
    assert all(service.status(job_id=j)["targets"]["physical"].startswith("ERASED:") for j in jobs)

    _attack(world, tenant, _gone(blobs), aads, fingerprints, _markers(seeded, blobs))
    # Bob's kept memory came back with the restore and reads; alice's and the forgotten one do not.
    texts = [m["text"] for m in world.store.list_visible(tenant_id=tenant, user_id="bob")]
    assert texts == [f"bob keeps a sourdough starter {seeded['canary']}"]
    assert world.store.list_visible(tenant_id=tenant, user_id="alice") == []


def _legacy_tenant(w: World, tenant: str) -> None:
    """A tenant as the code before key vaults left it: a tenant key wrapped by the master key, subject
    and team keys wrapped by the tenant key, summaries and snapshots sealed under subject and team keys."""
    store, keys = w.store, w.store.keys
    with store.transaction() as conn:
        conn.execute("INSERT INTO memory.tenants (tenant_id) VALUES (%s)", (tenant,))
        key, wrapped = keys.master.new_wrapped_key(tenant_id=tenant)
        conn.execute(
            "INSERT INTO keystore.tenant_keys (tenant_id, key_id, wrapped, provider) VALUES (%s, 'tk_legacy', %s, %s)",
            (tenant, wrapped, keys.master.provider),
        )
    _seed(w, tenant)
    with store.transaction() as conn:
        for scope, scope_id in (("subject", "bob"), ("team", "core")):
            summary = SummaryStore(store, ExtractiveSummarizer()).read(tenant_id=tenant, scope=scope, scope_id=scope_id)
            owner_key = keys.subject_key if scope == "subject" else keys.team_key
            key_id, key = owner_key(conn, tenant, scope_id)
            conn.execute(
                "UPDATE derived.summaries SET summary_ct = %s, key_id = %s WHERE tenant_id = %s AND scope = %s"
                " AND scope_id = %s",
                (
                    crypto.seal(key, summary["summary"].encode(), crypto.aad("summary", tenant, scope, scope_id)),
                    key_id,
                    tenant,
                    scope,
                    scope_id,
                ),
            )


def _everything_readable(store: MemoryStore, tenant: str) -> dict[str, Any]:
    summaries = SummaryStore(store, ExtractiveSummarizer())
    with store.transaction() as conn:
        snapshots = conn.execute(
            "SELECT snapshot_id, prompt_ct, key_id FROM derived.prompt_snapshots WHERE tenant_id = %s ORDER BY 1",
            (tenant,),
        ).fetchall()
        prompts = [
            crypto.open_sealed(
                store.keys.key_by_id(conn, tenant, key_id), bytes(ct), crypto.aad("prompt-snapshot", tenant, sid)
            ).decode()
            for sid, ct, key_id in snapshots
        ]
        subkey = store.keys.tenant_subkey(conn, tenant, "keyword-index", create=False)
    return {
        "memories": {
            user: sorted(m["text"] for m in store.list_visible(tenant_id=tenant, user_id=user))
            for user in ("alice", "bob")
        },
        "team": sorted(m["text"] for m in store.list_visible(tenant_id=tenant, user_id="bob", team_id="core")),
        "summaries": [
            summaries.read(tenant_id=tenant, scope=scope, scope_id=scope_id)["summary"]
            for scope, scope_id in (("subject", "alice"), ("subject", "bob"), ("team", "core"))
        ],
        "prompts": prompts,
        "keyword_subkey": subkey,
    }


def _kek_ids(w: World, tenant: str) -> set[str | None]:
    with w.store.transaction() as conn:
        return {
            r[0]
            for r in conn.execute(
                "SELECT kek_id FROM keystore.tenant_keys WHERE tenant_id = %(t)s"
                " UNION ALL SELECT kek_id FROM keystore.subject_keys WHERE tenant_id = %(t)s"
                " UNION ALL SELECT kek_id FROM keystore.team_keys WHERE tenant_id = %(t)s"
                " UNION ALL SELECT kek_id FROM keystore.build_keys WHERE tenant_id = %(t)s"
                " UNION ALL SELECT kek_id FROM keystore.group_keys WHERE tenant_id = %(t)s"
                " UNION ALL SELECT kek_id FROM keystore.retired_keys WHERE tenant_id = %(t)s",
                {"t": tenant},
            )
        }


def _fresh(w: World) -> MemoryStore:
    """Another process's store: nothing cached."""
    return MemoryStore(w.endpoints.store_conninfo, KeyStore(w.store.keys.master, vault=w.settings.key_vault_path))


def test_rotation_converts_rows_wrapped_the_old_way_and_keeps_everything_readable(world: World) -> None:
    tenant, neighbour = "t-" + uuid.uuid4().hex[:12], "t-" + uuid.uuid4().hex[:12]
    _legacy_tenant(world, tenant)
    _seed(world, neighbour)
    vault = world.store.keys.vault
    assert _kek_ids(world, tenant) == {None} and not vault.exists(tenant)  # nothing names a KEK yet
    readable = _everything_readable(_fresh(world), tenant)
    neighbour_keks = _kek_ids(world, neighbour)

    erasure = ErasureService(world.derived)
    first = erasure.rotate_keys(tenant)
    assert first["rotated"] and first["rewrapped"] == {
        "subject": 2,
        "team": 1,
        "build": 2,
        "group": 2,
        "retired": 0,
        "tenant": 1,
    }
    [kek] = vault.kek_ids(tenant)
    assert _kek_ids(world, tenant) == {kek}  # every row converted
    fresh = _fresh(world)
    assert _everything_readable(fresh, tenant) == readable  # keys, subkeys and texts unchanged
    assert _everything_readable(world.store, tenant) == readable  # and through a warm cache

    erasure.rotate_keys(tenant)
    [second] = vault.kek_ids(tenant)
    assert second != kek and _kek_ids(world, tenant) == {second}
    assert _everything_readable(_fresh(world), tenant) == readable
    assert _kek_ids(world, neighbour) == neighbour_keks  # another tenant's rows are not touched
    # A write after the rotation, by a process that cached the old KEK, wraps under the new one.
    world.store.write(tenant_id=tenant, user_id="carol", text="carol arrived after the rotation")
    assert _kek_ids(world, tenant) == {second}
    assert [m["text"] for m in _fresh(world).list_visible(tenant_id=tenant, user_id="carol")] == [
        "carol arrived after the rotation"
    ]


def test_a_cached_key_stops_opening_once_destroyed_and_new_keys_follow_the_new_kek(world: World) -> None:
    tenant = "t-" + uuid.uuid4().hex[:12]
    seeded = _seed(world, tenant)
    warm = _fresh(world)  # a long-lived process: reads everything, so every key is in its cache
    warm_summaries = SummaryStore(warm, ExtractiveSummarizer())
    with warm.transaction() as conn:
        alice_key, _ = warm.keys.subject_key(conn, tenant, "alice", create=False)
        team_build_key = conn.execute(
            "SELECT key_id FROM derived.summaries WHERE tenant_id = %s AND scope = 'team'", (tenant,)
        ).fetchone()[0]  # type: ignore[index]
        warm.keys.key_by_id(conn, tenant, alice_key)
        warm.keys.build_key(conn, tenant, team_build_key)
    assert "epilepsy" in warm_summaries.read(tenant_id=tenant, scope="team", scope_id="core")["summary"]
    old_kek = world.store.keys.vault.kek_ids(tenant)

    jobs = _forget(world, tenant, seeded)
    _erase(world, tenant, jobs)
    assert world.store.keys.vault.kek_ids(tenant) != old_kek
    with warm.transaction() as conn:
        with pytest.raises(KeyDestroyedError):
            warm.keys.key_by_id(conn, tenant, alice_key)  # destroyed by the forget: the cache does not answer
        with pytest.raises(KeyDestroyedError):
            warm.keys.build_key(conn, tenant, team_build_key)  # the team summary was rebuilt without alice
    with pytest.raises(NotFoundError):
        warm.history(tenant_id=tenant, memory_id=seeded["alice_personal"].memory_id)
    # Bob's memory still reads in the warm process, and what it wraps now names the new KEK.
    assert [h["text"] for h in warm.history(tenant_id=tenant, memory_id=seeded["bob_keep"].memory_id)] == [
        f"bob keeps a sourdough starter {seeded['canary']}"
    ]
    warm.write(tenant_id=tenant, user_id="dave", text="dave joined after the erasure")
    assert _kek_ids(world, tenant) == set(world.store.keys.vault.kek_ids(tenant))
    assert [m["text"] for m in _fresh(world).list_visible(tenant_id=tenant, user_id="dave")] == [
        "dave joined after the erasure"
    ]
    warm.close()


def test_vault_files_are_private_named_by_hash_and_overwritten_in_place(world: World, tmp_path: Path) -> None:
    tenant = "t-" + uuid.uuid4().hex[:12]
    seeded = _seed(world, tenant)
    vault = world.store.keys.vault
    path = vault.path(tenant)
    assert path.parent == world.settings.home / "keys" / "vault" and tenant not in path.name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.stat().st_size == VAULT_BYTES
    # A second name for the same inode: it shows what happens to the very blocks of the file.
    link = tmp_path / "vault-link"
    os.link(path, link)
    old = link.read_bytes()
    [old_kek] = vault.kek_ids(tenant)
    old_wrapped = _wrapped_keks(old)
    assert old_wrapped

    ErasureService(world.derived).rotate_keys(tenant)
    assert path.stat().st_ino == link.stat().st_ino  # written in place, never renamed over
    now = link.read_bytes()
    assert len(now) == VAULT_BYTES and not any(w in now for w in old_wrapped)
    assert vault.kek_ids(tenant) != [old_kek] and len(vault.kek_ids(tenant)) == 1

    # Destroying the tenant overwrites the file with zeros, then unlinks it.
    service = DeletionService(world.derived)
    job = service.request(tenant_id=tenant, all_tenant=True, confirm=tenant, basis="offboarding")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    assert not path.exists() and link.read_bytes() == bytes(VAULT_BYTES)
    assert seeded  # the tenant had every kind of key


def _wrapped_keks(raw: bytes) -> list[bytes]:
    """The sealed KEKs a vault file holds, as raw bytes and as the base64 text stored."""
    out: list[bytes] = []
    for match in re.finditer(rb'"wrapped":"([A-Za-z0-9+/=]+)"', raw):
        out += [match.group(1), base64.b64decode(match.group(1))]
    return out


def test_a_key_wrapped_while_a_rotation_waits_is_rewrapped_with_the_rest(world: World) -> None:
    """A new key (here carol's) is wrapped under the KEK current in its transaction, holding the
    rotation lock shared: the rotation waits for it to commit, then rewraps it too."""
    tenant = "t-" + uuid.uuid4().hex[:12]
    _seed(world, tenant)
    store = world.store
    with psycopg.connect(world.endpoints.store_conninfo) as writer:
        store.keys.subject_key(writer, tenant, "carol")  # a transaction left open, holding the lock
        rotation = threading.Thread(target=ErasureService(world.derived).rotate_keys, args=(tenant,))
        rotation.start()
        rotation.join(1.0)
        assert rotation.is_alive()  # waits for carol's key to commit
        writer.commit()
    rotation.join(30)
    assert not rotation.is_alive()
    [kek] = store.keys.vault.kek_ids(tenant)
    assert _kek_ids(world, tenant) == {kek}
    with _fresh(world).transaction() as conn:
        assert len(_fresh(world).keys.subject_key(conn, tenant, "carol", create=False)[1]) == crypto.KEY_BYTES


def test_a_version_key_added_while_its_group_is_rekeyed_is_rewrapped_with_it(world: World) -> None:
    """A writer takes the tenant's rotation lock (shared) before it reads its group and holds it until
    it commits: the erasure's rekey of that group, after a member was forgotten, waits for it and gives
    the new key the survivors' new group key. Nothing lands under a deleted group key."""
    tenant = "t-" + uuid.uuid4().hex[:12]
    store = world.store
    kept = store.write(tenant_id=tenant, user_id="alice", text="alice keeps a red kayak")
    gone = store.write(tenant_id=tenant, user_id="alice", text="alice hides a spare key under the mat")
    with psycopg.connect(world.endpoints.store_conninfo) as writer:
        [late] = store.keys.versions.allocate(writer, tenant, {"alice": 1})["alice"]  # in alice's group, held
        service = DeletionService(world.derived)
        job = service.request(tenant_id=tenant, memory_id=gone.memory_id)
        service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])  # marks the group for its rekey
        erasure = threading.Thread(target=ErasureService(world.derived).erase_tenant, kwargs={"tenant_id": tenant})
        erasure.start()
        erasure.join(2.0)
        assert erasure.is_alive()  # the rekey waits for the writer
        store.keys.versions.insert(writer, tenant, [(late, "m_" + "0" * 32, 1)])
        writer.commit()
    erasure.join(60)
    assert not erasure.is_alive()
    with store.transaction() as conn:
        groups = conn.execute(
            "SELECT key_id FROM keystore.group_keys WHERE tenant_id = %s AND user_id = 'alice'", (tenant,)
        ).fetchall()
        holding = conn.execute(
            "SELECT DISTINCT group_key_id FROM keystore.version_keys WHERE tenant_id = %s", (tenant,)
        ).fetchall()
    assert late.group_key_id not in {g for (g,) in groups}  # the group that lost a member is gone
    assert holding == groups and len(groups) == 1  # the survivor and the late key share its successor
    fresh = _fresh(world)
    with fresh.transaction() as conn:
        assert fresh.keys.keys_by_id(conn, tenant, [late.key_id]) == {late.key_id: late.key}
    assert fresh.open_texts(tenant_id=tenant, sources=[(kept.memory_id, 1)]) == {
        (kept.memory_id, 1): "alice keeps a red kayak"
    }


def test_a_write_during_a_rekey_waits_and_lands_in_the_new_group(world: World) -> None:
    """The other order: a rotation (with the rekey of a group that lost a member) holds the rotation
    lock; a write of that group's author waits for it, then finds the old group gone and wraps its key
    under the survivors' new group key."""
    tenant = "t-" + uuid.uuid4().hex[:12]
    store = world.store
    gone = store.write(tenant_id=tenant, user_id="alice", text="alice hides a spare key under the mat")
    service = DeletionService(world.derived)
    job = service.request(tenant_id=tenant, memory_id=gone.memory_id)
    store.write(tenant_id=tenant, user_id="alice", text="alice keeps a red kayak")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    with store.transaction() as conn:
        [(old,)] = conn.execute("SELECT key_id FROM keystore.group_keys WHERE tenant_id = %s", (tenant,)).fetchall()
    rotations = KeyRotation(store.keys)
    with psycopg.connect(world.endpoints.store_conninfo) as rotating:
        rotation = rotations.begin(rotating, tenant)  # rekeyed and rewrapped, not committed
        assert rotation is not None and rotation.rekeyed == {"groups": 1, "rewrapped": 1}
        out: dict[str, Any] = {}
        writer = threading.Thread(
            target=lambda: out.update(w=store.write(tenant_id=tenant, user_id="alice", text="alice paints"))
        )
        writer.start()
        writer.join(2.0)
        assert writer.is_alive()  # waits for the rotation lock, before reading any group
        rotating.commit()
    rotations.finish(rotation)
    writer.join(30)
    with store.transaction() as conn:
        groups = {g for (g,) in conn.execute("SELECT key_id FROM keystore.group_keys WHERE tenant_id = %s", (tenant,))}
        [(group,)] = conn.execute(
            "SELECT group_key_id FROM keystore.version_keys WHERE tenant_id = %s AND memory_id = %s",
            (tenant, out["w"].memory_id),
        ).fetchall()
    assert old not in groups and group in groups
    assert _fresh(world).open_texts(tenant_id=tenant, sources=[(out["w"].memory_id, 1)]) == {
        (out["w"].memory_id, 1): "alice paints"
    }


def test_a_bulk_chunk_whose_group_is_rekeyed_before_its_commit_keeps_its_keys(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`write_many` stores a chunk's version keys before the chunk's own transaction (out of the gate's
    hold): an erasure that rekeys their group in between (a member forgotten) rewraps them with the
    group's survivors, and every item reads back. Keys made for items already written are deleted."""
    from memory_pipelines.lib.memories import bulk_write

    tenant = "t-" + uuid.uuid4().hex[:12]
    store = world.store
    gone = store.write(tenant_id=tenant, user_id="alice", text="alice's locker code is 4417")
    store.write(tenant_id=tenant, user_id="alice", text="alice's note 0")  # the same as an item below
    service = DeletionService(world.derived)
    job = service.request(tenant_id=tenant, memory_id=gone.memory_id)
    real = bulk_write.BulkWriter._seal
    sealed = {"n": 0}

    def seal_then_erase(self: Any, chunk: list[dict[str, Any]]) -> Any:
        out = real(self, chunk)
        sealed["n"] += 1
        if sealed["n"] == 1:  # the chunk's keys are made and stored, under alice's group: now its rekey
            service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
            report = ErasureService(world.derived).erase_tenant(tenant_id=tenant)
            assert report["keys"]["rekeyed"]["groups"] == 1
        return out

    monkeypatch.setattr(bulk_write.BulkWriter, "_seal", seal_then_erase)
    written = store.write_many(
        tenant_id=tenant, items=[{"user_id": "alice", "text": f"alice's note {i}"} for i in range(5)]
    )
    assert sealed["n"] == 1 and [w.changed for w in written] == [False, True, True, True, True]
    texts = _fresh(world).open_texts(tenant_id=tenant, sources=[(w.memory_id, 1) for w in written])
    assert sorted(texts.values()) == [f"alice's note {i}" for i in range(5)]
    with store.transaction() as conn:
        keys = conn.execute("SELECT count(*) FROM keystore.version_keys WHERE tenant_id = %s", (tenant,)).fetchone()
    assert keys == (5,)  # one per version: none is left of the item that was already written


def test_kek_rotation_with_a_kms_master_key(world: World, kms_key: str) -> None:
    """The vault's KEKs are KMS data keys (bound to the tenant and their purpose); rotating them
    keeps everything readable through KMS, and a tenant's destruction removes its vault file."""
    settings = dataclasses.replace(world.settings, kms_key_id=kms_key)
    store = open_store(settings, world.endpoints)
    tenant = "t-" + uuid.uuid4().hex[:12]
    written = store.write(tenant_id=tenant, user_id="alice", text="sealed under a KEK from KMS")
    raw = store.keys.vault.path(tenant).read_bytes()
    assert f'"provider":"kms:{kms_key}"'.encode() in raw
    rotations = KeyRotation(store.keys)
    for _ in range(2):
        with store.transaction() as conn:
            rotation = rotations.begin(conn, tenant)
        assert rotation is not None
        rotations.finish(rotation)
        store.keys.forget_cached()  # the next read unwraps through KMS again
        assert store.history(tenant_id=tenant, memory_id=written.memory_id)[0]["text"] == "sealed under a KEK from KMS"
    with store.transaction() as conn:
        store.keys.destroy_tenant_keys(conn, tenant)
    assert not store.keys.vault.path(tenant).exists()
    store.close()
