"""The key vault's files: private, named by hash, written in place, crash-safe, destroyed for good."""

from __future__ import annotations

import multiprocessing
import os
import stat
from pathlib import Path

import pytest

from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.key_vault import VAULT_BYTES, KekUnavailable, KeyVault, vault_name


def _vault(tmp_path: Path) -> KeyVault:
    return KeyVault(tmp_path / "keys" / "vault", crypto.LocalMasterKey(tmp_path / "keys" / "master.key"))


def test_a_vault_file_is_private_named_by_a_hash_and_of_fixed_size(tmp_path: Path) -> None:
    vault = _vault(tmp_path)
    kek_id, kek = vault.current("acme", create=True)
    path = vault.path("acme")
    assert path.name == vault_name("acme") and "acme" not in path.name
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.stat().st_size == VAULT_BYTES and kek not in path.read_bytes()  # sealed, never raw
    assert vault.current("acme", create=False) == (kek_id, kek) and vault.unseal("acme", kek_id) == kek
    with pytest.raises(KekUnavailable):
        vault.current("globex", create=False)
    # A vault file is bound to its tenant: copied under another tenant's name, it unseals nothing.
    os.link(path, vault.path("globex"))
    with pytest.raises(crypto.DecryptionError):
        vault.unseal("globex", kek_id)


def test_a_rotation_overwrites_the_same_inode_and_leaves_the_old_kek_in_neither_slot(tmp_path: Path) -> None:
    vault = _vault(tmp_path)
    old_id, _ = vault.current("acme", create=True)
    path = vault.path("acme")
    inode, before = path.stat().st_ino, path.read_bytes()
    new_id, new = vault.introduce("acme", keep={old_id})
    assert set(vault.kek_ids("acme")) == {old_id, new_id} and vault.current("acme", create=False) == (new_id, new)
    vault.keep_only("acme", new_id)
    after = path.read_bytes()
    assert path.stat().st_ino == inode and len(after) == VAULT_BYTES
    old_sealed = before[36 : 36 + int.from_bytes(before[:4], "big")]
    assert old_sealed not in after and vault.kek_ids("acme") == [new_id]
    with pytest.raises(KekUnavailable):
        vault.unseal("acme", old_id)


def test_a_torn_write_leaves_the_other_slot_readable(tmp_path: Path) -> None:
    vault = _vault(tmp_path)
    old_id, old = vault.current("acme", create=True)
    _, new = vault.introduce("acme", keep={old_id})  # written to the slot the old document was not in
    path = vault.path("acme")
    raw = bytearray(path.read_bytes())
    raw[VAULT_BYTES // 2 + 40] ^= 0xFF  # the newest slot, torn by a crash mid-write
    path.write_bytes(bytes(raw))
    assert vault.kek_ids("acme") == [old_id] and vault.unseal("acme", old_id) == old
    assert new  # lost with its slot; no row could name it: the rotation had not committed


def test_finishing_an_older_rotation_keeps_a_kek_introduced_since(tmp_path: Path) -> None:
    vault = _vault(tmp_path)
    first, _ = vault.current("acme", create=True)
    second, _ = vault.introduce("acme", keep={first})
    third, _ = vault.introduce("acme", keep={first, second})  # a later rotation, not yet finished
    vault.keep_only("acme", second)  # the earlier rotation finishes late
    assert set(vault.kek_ids("acme")) == {second, third} and vault.current("acme", create=False)[0] == third


def test_destroying_overwrites_the_file_with_zeros_then_unlinks_it(tmp_path: Path) -> None:
    vault = _vault(tmp_path)
    kek_id, _ = vault.current("acme", create=True)
    link = tmp_path / "same-inode"
    os.link(vault.path("acme"), link)
    assert vault.destroy("acme") is True
    assert not vault.path("acme").exists() and link.read_bytes() == bytes(VAULT_BYTES)
    assert vault.destroy("acme") is False and vault.kek_ids("acme") == []
    with pytest.raises(KekUnavailable):
        vault.unseal("acme", kek_id)


def _create(directory: str, queue: multiprocessing.Queue[str]) -> None:
    vault = KeyVault(Path(directory) / "vault", crypto.LocalMasterKey(Path(directory) / "master.key"))
    queue.put(vault.current("acme", create=True)[0])


def test_processes_creating_one_tenants_vault_at_once_agree_on_one_kek(tmp_path: Path) -> None:
    crypto.LocalMasterKey(tmp_path / "master.key")
    queue: multiprocessing.Queue[str] = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=_create, args=(str(tmp_path), queue)) for _ in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
    assert len({queue.get(timeout=5) for _ in procs}) == 1
    assert not [p for p in (tmp_path / "vault").iterdir() if p.suffix == ".tmp"]
