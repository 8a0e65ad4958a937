"""An attacker holding a copy of HOME: every file under it, the master key, and every key left.

Used by the tests of issue 20, item 3: what the files of a HOME still give away after a deletion
was erased. The attacker knows the code (formats and associated data, Kerckhoffs) and the ids any
row or journal entry names; what it lacks is only what was destroyed. It:
- reads the master key file, unseals every KEK of the key vault with it, and unwraps every wrapped
  key the key store still holds (tenant, subject, team and build keys), whatever wraps them;
- carves sealed blobs (PostgreSQL varlena values holding our sealed format) out of files, e.g.
  pg_wal segments, and tries every key it has on them under the associated data of its targets;
- looks for exact byte strings (ciphertexts and wrapped keys taken before the deletion) in every file.
"""

from __future__ import annotations

import base64
import json
import mmap
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import psycopg
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from memory_pipelines.lib.memories import crypto

_NONCE = 12
_SEALED_MIN = 1 + _NONCE + 16
WRAPPED_KEY_BYTES = 1 + _NONCE + crypto.KEY_BYTES + 16


def home_files(home: Path) -> list[Path]:
    """Every regular file under HOME (symlinks not followed), sorted."""
    return sorted(p for p in home.rglob("*") if p.is_file() and not p.is_symlink())


def wal_files(home: Path) -> list[Path]:
    return [p for p in home_files(home) if "pg_wal" in p.parts]


def _read(path: Path) -> bytes:
    try:
        with path.open("rb") as fh:
            size = path.stat().st_size
            if size == 0:
                return b""
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                return bytes(mapped)
    except (FileNotFoundError, PermissionError, ValueError):
        return b""


def find_exact(files: Iterable[Path], blobs: dict[str, bytes]) -> dict[str, list[str]]:
    """name -> files holding that exact byte string."""
    found: dict[str, list[str]] = {}
    for path in files:
        data = _read(path)
        for name, blob in blobs.items():
            if blob and blob in data:
                found.setdefault(name, []).append(str(path))
    return found


def sealed_candidates(data: bytes, *, length: int | None = None) -> Iterator[bytes]:
    """Every byte string of `data` shaped like a PostgreSQL varlena value holding a sealed blob: a
    1-byte or 4-byte (uncompressed) varlena header, then our format byte; `length` keeps one size."""
    if len(data) < _SEALED_MIN + 1:
        return
    raw = np.frombuffer(data, dtype=np.uint8)
    starts = np.flatnonzero(raw[1:] == 1) + 1
    seen: set[tuple[int, int]] = set()
    for p in starts.tolist():
        sizes = []
        h = data[p - 1]
        if h & 1 and h != 1:
            sizes.append((h >> 1) - 1)
        if p >= 4:
            v = int.from_bytes(data[p - 4 : p], "little")
            if v & 3 == 0 and (v >> 2) > 4:
                sizes.append((v >> 2) - 4)
        for size in sizes:
            if size < _SEALED_MIN or (length is not None and size != length) or p + size > len(data):
                continue
            if (p, size) not in seen:
                seen.add((p, size))
                yield data[p : p + size]


def _vault_entries(raw: bytes) -> list[dict[str, str]]:
    """Every KEK entry of every slot of a vault file (lib/key_vault.py: slots of 2,048 bytes, each a
    4-byte length, a SHA-256 and a JSON document), valid or not: the attacker takes whatever is there."""
    entries: list[dict[str, str]] = []
    for start in range(0, len(raw), 2048):
        slot = raw[start : start + 2048]
        length = int.from_bytes(slot[:4], "big")
        try:
            document = json.loads(slot[36 : 36 + length].decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            continue
        keks = document.get("keks", {}) if isinstance(document, dict) else {}
        entries += [{"id": kek_id, **entry} for kek_id, entry in keks.items()]
    return entries


def try_open(keys: Iterable[bytes], blob: bytes, aads: Iterable[bytes]) -> bytes | None:
    """The plaintext of `blob` under any of `keys` and `aads`, or None."""
    if len(blob) < _SEALED_MIN or blob[:1] != b"\x01":
        return None
    nonce, body = blob[1 : 1 + _NONCE], blob[1 + _NONCE :]
    for key in keys:
        cipher = AESGCM(key)
        for aad in aads:
            try:
                return cipher.decrypt(nonce, body, aad)
            except InvalidTag:
                continue
    return None


def key_aads(kind: str, tenant: str, owner: str | None, key_id: str) -> list[bytes]:
    """Associated data a wrapped key of `kind` may carry, in every format the code has used."""
    if kind == "tenant":
        return [crypto.aad("tenant-key", tenant), crypto.aad("tenant-key", tenant, key_id)]
    if kind == "build":
        return [crypto.aad("build-key", tenant, key_id)]
    return [crypto.aad(f"{kind}-key", tenant, owner or "", key_id)]


class Attacker:
    """Everything `home` and its database give away about one tenant, with the master key."""

    def __init__(self, home: Path, conninfo: str, tenant: str) -> None:
        self.home = home
        self.conninfo = conninfo
        self.tenant = tenant
        self.master = (home / "keys" / "master.key").read_bytes()
        self.keys: dict[str, bytes] = {"master": self.master}
        self.kek_count = 0
        self._load_vault()
        self._load_key_store()

    def _load_vault(self) -> None:
        """Every KEK sealed in the vault files (any file under HOME/keys other than the master key)."""
        for path in home_files(self.home / "keys"):
            if path.name == "master.key":
                continue
            for entry in _vault_entries(_read(path)):
                wrapped = base64.b64decode(entry["wrapped"])
                aads = [
                    crypto.aad("tenant-kek", self.tenant),
                    crypto.aad("tenant-kek", self.tenant, entry.get("id", "")),
                ]
                kek = try_open([self.master], wrapped, aads)
                if kek is not None:
                    self.keys[f"kek:{entry.get('id')}"] = kek
                    self.kek_count += 1

    def _rows(self) -> list[tuple[str, str | None, str, bytes]]:
        """(kind, owner, key_id, wrapped) of every live wrapped key of the tenant."""
        queries = {
            "tenant": "SELECT NULL, key_id, wrapped FROM keystore.tenant_keys WHERE tenant_id = %s",
            "subject": "SELECT user_id, key_id, wrapped FROM keystore.subject_keys WHERE tenant_id = %s",
            "team": "SELECT team_id, key_id, wrapped FROM keystore.team_keys WHERE tenant_id = %s",
            "build": "SELECT NULL, key_id, wrapped FROM keystore.build_keys WHERE tenant_id = %s",
        }
        rows: list[tuple[str, str | None, str, bytes]] = []
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            for kind, query in queries.items():
                try:
                    found = conn.execute(query, (self.tenant,)).fetchall()
                except psycopg.errors.UndefinedTable:
                    continue
                rows += [(kind, owner, key_id, bytes(w)) for owner, key_id, w in found if w is not None]
        return rows

    def _load_key_store(self) -> None:
        """Unwrap every live wrapped key with whatever opens it, until nothing new opens."""
        pending = self._rows()
        while pending:
            opened = []
            for kind, owner, key_id, wrapped in pending:
                key = try_open(self.keys.values(), wrapped, key_aads(kind, self.tenant, owner, key_id))
                if key is not None:
                    self.keys[f"{kind}:{key_id}"] = key
                    opened.append((kind, owner, key_id, wrapped))
            if not opened:
                break
            pending = [row for row in pending if row not in opened]

    def destroyed_keys(self) -> list[tuple[str, str]]:
        """(subject, key_id) of every key the journal says was destroyed."""
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            return [
                (str(s), str(k))
                for s, k in conn.execute(
                    "SELECT subject_id, key_id FROM control.journal"
                    " WHERE tenant_id = %s AND kind = 'KEY_DESTROYED' AND key_id IS NOT NULL",
                    (self.tenant,),
                )
            ]

    def recover_destroyed(self, files: Iterable[Path]) -> dict[str, bytes]:
        """Destroyed subject keys rebuilt from wrapped copies carved out of `files`: key_id -> key."""
        wanted = {
            key_id: crypto.aad("subject-key", self.tenant, subject, key_id) for subject, key_id in self.destroyed_keys()
        }
        recovered: dict[str, bytes] = {}
        if not wanted:
            return recovered
        for path in files:
            for blob in sealed_candidates(_read(path), length=WRAPPED_KEY_BYTES):
                for key_id, aad in wanted.items():
                    if key_id not in recovered:
                        key = try_open(self.keys.values(), blob, [aad])
                        if key is not None:
                            recovered[key_id] = key
        return recovered

    def open_carved(
        self,
        files: Iterable[Path],
        targets: dict[str, bytes],
        keys: Iterable[bytes],
        markers: dict[str, tuple[bytes, ...]] | None = None,
    ) -> dict[str, str]:
        """Target name -> file, for every target (name -> associated data) a carved blob opens under.
        A target with `markers` counts only when the plaintext holds one of them: a summary's associated
        data names its subject or team, not its build, so the live summary opens under it too."""
        keys = list(keys)
        markers = markers or {}
        opened: dict[str, str] = {}
        for path in files:
            for blob in sealed_candidates(_read(path)):
                for name, aad in targets.items():
                    if name in opened:
                        continue
                    plain = try_open(keys, blob, [aad])
                    if plain is not None and (name not in markers or any(m in plain for m in markers[name])):
                        opened[name] = str(path)
        return opened
