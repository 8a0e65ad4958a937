"""An attacker holding a copy of HOME: every file under it (and any other copy it was given: a WAL
archive, a base backup, an external server's data directory), the master key, and every key left.

The attacker knows the code (formats and associated data, Kerckhoffs) and every id a row or journal
entry names; what it lacks is only what was destroyed. It:
- reads the master key file, unseals every KEK of the key vault with it, and unwraps every wrapped
  key the key store still holds (tenant, subject, team, build, group, version and retired keys),
  whatever wraps them, until nothing new opens;
- rebuilds destroyed keys from wrapped copies carved out of files (`recover`): each wanted key id is
  tried with every key able to wrap keys (master, KEKs, tenant keys, group keys, and those rebuilt),
  round after round, so a group key rebuilt from an old WAL record opens the version keys it wrapped;
- carves sealed blobs (PostgreSQL varlena values holding our sealed format) out of files and tries
  every key it has on them under the associated data of its targets (`open_carved`);
- looks for exact byte strings (ciphertexts and wrapped keys taken before the deletion) in every file,
  WAL segments read as their record stream, so a value split by a page header is found too.
"""

from __future__ import annotations

import base64
import hashlib
import json
import mmap
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import psycopg
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from memory_pipelines.lib.forget import wal
from memory_pipelines.lib.memories import crypto

_NONCE = 12
_SEALED_MIN = 1 + _NONCE + 16
WRAPPED_KEY_BYTES = 1 + _NONCE + crypto.KEY_BYTES + 16
# A value stored inline fits one 8 KiB page; a larger one is TOASTed in chunks no carving joins.
_INLINE_MAX = 8192
_WAL_PAGE = 8192
_XLP_LONG_HEADER = 0x0002  # xlp_info of a page whose header is the segment's long one
# Key kinds that wrap other keys (a version key seals texts, a subject key MACs them: neither wraps).
_WRAPPING_KINDS = ("master", "kek", "tenant", "group")


def home_files(home: Path) -> list[Path]:
    """Every regular file under HOME (symlinks not followed), sorted."""
    return sorted(p for p in home.rglob("*") if p.is_file() and not p.is_symlink())


def wal_files(home: Path) -> list[Path]:
    return [p for p in home_files(home) if "pg_wal" in p.parts]


def wal_stream(data: bytes) -> bytes:
    """A WAL segment's records as one stream: the segment is 8 KiB pages, each opening with a header
    (40 bytes on the segment's first page, 24 on the others), and a record longer than what is left
    of its page goes on after the next one, so a value it holds is whole only without the headers."""
    pages = []
    for start in range(0, len(data) - _WAL_PAGE + 1, _WAL_PAGE):
        info = int.from_bytes(data[start + 2 : start + 4], "little")
        pages.append(data[start + (40 if info & _XLP_LONG_HEADER else 24) : start + _WAL_PAGE])
    return b"".join(pages)


def _read(path: Path) -> bytes:
    """A file's bytes; a WAL segment's as its record stream (`wal_stream`), as an attacker would read it."""
    try:
        with path.open("rb") as fh:
            size = path.stat().st_size
            if size == 0:
                return b""
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                data = bytes(mapped)
    except (FileNotFoundError, PermissionError, ValueError):
        return b""
    return wal_stream(data) if wal.is_segment(path.name) and size % _WAL_PAGE == 0 else data


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
            if (
                not _SEALED_MIN <= size <= _INLINE_MAX
                or (length is not None and size != length)
                or p + size > len(data)
            ):
                continue
            if (p, size) not in seen:
                seen.add((p, size))
                yield data[p : p + size]


def _carve_sizes(data: bytes, sizes: set[int]) -> set[bytes]:
    """`sealed_candidates` of the given sizes, vectorised: a varlena header (1-byte, or 4-byte
    uncompressed) announcing one of `sizes`, then our format byte."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if len(raw) < _SEALED_MIN + 4:
        return set()
    ones = np.flatnonzero(raw[4:] == 1) + 4
    found: set[bytes] = set()
    head4 = (
        raw[ones - 4].astype(np.uint32)
        | (raw[ones - 3].astype(np.uint32) << 8)
        | (raw[ones - 2].astype(np.uint32) << 16)
        | (raw[ones - 1].astype(np.uint32) << 24)
    )
    for size in sizes:
        hits = []
        if size + 1 <= 127:
            hits.append(ones[raw[ones - 1] == (((size + 1) << 1) | 1)])
        hits.append(ones[head4 == np.uint32((size + 4) << 2)])
        for p in np.concatenate(hits).tolist():
            if p + size <= len(data):
                found.add(data[p : p + size])
    return found


def carve(files: Iterable[Path], lengths: Iterable[int]) -> set[bytes]:
    """Every distinct sealed-looking blob of `files` of one of `lengths`."""
    sizes = set(lengths)
    found: set[bytes] = set()
    for path in files:
        found |= _carve_sizes(_read(path), sizes)
    return found


def _vault_entries(raw: bytes) -> list[dict[str, str]]:
    """Every KEK entry of every slot of a vault file (lib/memories/key_vault.py: slots of 2,048 bytes, each a
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
    aads = list(aads)
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
    if kind == "version":
        return [crypto.aad("version-key", tenant, key_id)]
    if kind == "retired":
        kind = "subject"  # a retired key was a subject key: it keeps its associated data
    return [crypto.aad(f"{kind}-key", tenant, owner or "", key_id)]


# (kind, the column naming the owner, table): every table of wrapped keys, old and new.
_KEY_TABLES = (
    ("tenant", "NULL", "keystore.tenant_keys"),
    ("subject", "user_id", "keystore.subject_keys"),
    ("team", "team_id", "keystore.team_keys"),
    ("build", "NULL", "keystore.build_keys"),
    ("group", "user_id", "keystore.group_keys"),
    ("version", "NULL", "keystore.version_keys"),
    ("retired", "user_id", "keystore.retired_keys"),
)


class Attacker:
    """Everything `home` and its database give away about one tenant, with the master key."""

    def __init__(self, home: Path, conninfo: str, tenant: str, *, vault: Path | None = None) -> None:
        self.home = home
        self.conninfo = conninfo
        self.tenant = tenant
        self.master = (home / "keys" / "master.key").read_bytes()
        # name ("kind:key_id") -> key: everything the attacker holds.
        self.keys: dict[str, bytes] = {"master:": self.master}
        self.kek_count = 0
        self._load_vault(vault or home / "keys")
        self._load_key_store()

    def wrapping(self) -> list[bytes]:
        """The keys it holds that could wrap another key."""
        return [key for name, key in self.keys.items() if name.partition(":")[0] in _WRAPPING_KINDS]

    def _load_vault(self, directory: Path) -> None:
        """Every KEK sealed in the vault files (any file under the vault directory but the master key)."""
        for path in home_files(directory):
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
        """(kind, owner, key_id, wrapped) of every live wrapped key of the tenant, in tables that exist."""
        rows: list[tuple[str, str | None, str, bytes]] = []
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            for kind, owner, table in _KEY_TABLES:
                try:
                    found = conn.execute(
                        f"SELECT {owner}, key_id, wrapped FROM {table} WHERE tenant_id = %s",
                        (self.tenant,),
                    ).fetchall()
                except psycopg.errors.UndefinedTable:
                    continue
                rows += [(kind, o, key_id, bytes(w)) for o, key_id, w in found if w is not None]
        return rows

    def _load_key_store(self) -> None:
        """Unwrap every live wrapped key with whatever opens it, until nothing new opens."""
        pending = self._rows()
        while pending:
            opened = []
            for kind, owner, key_id, wrapped in pending:
                key = try_open(self.wrapping(), wrapped, key_aads(kind, self.tenant, owner, key_id))
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

    def recover(self, files: Iterable[Path], wanted: Mapping[str, tuple[str, str | None]]) -> dict[str, bytes]:
        """Destroyed keys rebuilt from wrapped copies carved out of `files`: `wanted` maps a key id to
        its (kind, owner); returns key_id -> key. Rounds until no new key opens: a rebuilt key that
        wraps others (a group key) is tried on the rest."""
        blobs = carve(files, [WRAPPED_KEY_BYTES])
        todo = {
            key_id: key_aads(kind, self.tenant, owner, key_id)
            for key_id, (kind, owner) in wanted.items()
            if f"{kind}:{key_id}" not in self.keys
        }
        recovered: dict[str, bytes] = {}
        wrapping = self.wrapping()
        while todo and wrapping:
            ciphers = [AESGCM(key) for key in wrapping]
            found: dict[str, bytes] = {}
            for blob in blobs:
                nonce, body = blob[1 : 1 + _NONCE], blob[1 + _NONCE :]
                for key_id, aads in todo.items():
                    if key_id in found:
                        continue
                    for cipher in ciphers:
                        for aad in aads:
                            try:
                                found[key_id] = cipher.decrypt(nonce, body, aad)
                            except InvalidTag:
                                continue
            recovered.update(found)
            todo = {k: v for k, v in todo.items() if k not in found}
            # Only the new keys are worth trying in the next round.
            wrapping = [key for key_id, key in found.items() if wanted[key_id][0] in _WRAPPING_KINDS]
        return recovered

    def recover_destroyed(self, files: Iterable[Path]) -> dict[str, bytes]:
        """Destroyed subject keys (the journal names them) rebuilt from wrapped copies carved out of `files`."""
        return self.recover(files, {key_id: ("subject", subject) for subject, key_id in self.destroyed_keys()})

    def open_carved(
        self,
        files: Iterable[Path],
        targets: dict[str, bytes],
        keys: Iterable[bytes],
        markers: dict[str, tuple[bytes, ...]] | None = None,
        *,
        lengths: Iterable[int] | None = None,
    ) -> dict[str, str]:
        """Target name -> file, for every target (name -> associated data) a carved blob opens under.
        A target with `markers` counts only when the plaintext holds one of them: a summary's associated
        data names its subject or team, not its build, so the live summary opens under it too.
        `lengths`: only blobs of these sizes are tried (a copy of a sealed text has its length)."""
        keys = list(keys)
        markers = markers or {}
        opened: dict[str, str] = {}
        for path in files:
            data = _read(path)
            blobs = sealed_candidates(data) if lengths is None else iter(_carve_sizes(data, set(lengths)))
            tried: set[bytes] = set()  # digests, not the blobs: a WAL segment holds thousands of candidates
            for blob in blobs:
                digest = hashlib.blake2b(blob, digest_size=16).digest()
                if digest in tried:
                    continue
                tried.add(digest)
                for name, aad in targets.items():
                    if name in opened:
                        continue
                    plain = try_open(keys, blob, [aad])
                    if plain is not None and (name not in markers or any(m in plain for m in markers[name])):
                        opened[name] = str(path)
        return opened
