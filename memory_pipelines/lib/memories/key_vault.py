"""Per-tenant key-encryption keys (KEKs) in small files outside PostgreSQL, sealed by the master key.

PostgreSQL keeps history: WAL segments, dead tuples, replicas and base backups may hold any row a
tenant's key store ever had. So the keys that open a subject's data are wrapped by a KEK that lives
here instead, where that history cannot reach, and the physical erasure rotates it: every wrapped
key is rewrapped under a new KEK and the old one is overwritten, so a wrapped copy left in WAL opens
nothing. Destroying a tenant overwrites and unlinks its file.

One file per tenant, `<dir>/<sha256 of the tenant id>.kek` (the raw id never names a file), mode
0600 in a 0700 directory, always VAULT_BYTES long: two slots, each a length, a SHA-256 and a JSON
document padded with zeros. A write goes in place (same offsets, same size, then fsync), never to a
new file renamed over the old one: a rename leaves the old blocks as they were, whereas an in-place
write overwrites them (on a filesystem that writes in place; see docs/guarantees.md for the limits). A
change writes the slot not holding the newest valid document first, so a crash mid-write always
leaves one valid slot; a rotation's last step writes both slots, so the old KEK is left in neither.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from memory_pipelines.lib.infra import artifacts, faults
from memory_pipelines.lib.infra.errors import ConflictError, ServiceError
from memory_pipelines.lib.memories import crypto

__all__ = [
    "MAX_KEKS",
    "PURPOSE",
    "VAULT_BYTES",
    "KekUnavailable",
    "KeyVault",
    "retrying",
    "vault_name",
]

VAULT_BYTES = 4096
_SLOT = VAULT_BYTES // 2
_HEADER = 4 + 32  # length, SHA-256 of the document
_FORMAT = "memory-pipelines-key-vault-1"
PURPOSE = "tenant-kek"  # the master key's associated data / encryption context for a KEK
MAX_KEKS = 4  # the current KEK, one being introduced, and leftovers of interrupted rotations


class KekUnavailable(ConflictError):
    """The KEK a wrapped key names is not in the vault (rotated away since it was read, or destroyed)."""


T = TypeVar("T")


def retrying(read: Callable[[], Any], open_row: Callable[[Any], T]) -> T:
    """open_row(read()); if the row's KEK was rotated away between the two, read it once more
    (a new statement sees the rotation's rows) and open that."""
    for attempt in range(2):
        row = read()
        try:
            return open_row(row)
        except KekUnavailable:
            if attempt:
                raise
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class _Document:
    generation: int
    current: str | None
    keks: dict[str, dict[str, Any]]  # kek_id -> {"provider", "wrapped" (base64), "since" (generation)}


def vault_name(tenant_id: str) -> str:
    """The file name of a tenant's vault: a hash, so listing the directory names no tenant."""
    return hashlib.sha256(b"memory-pipelines-kek\x1f" + tenant_id.encode("utf-8")).hexdigest()[:40] + ".kek"


class KeyVault:
    """The KEK files of every tenant in one directory; process-safe (flock) and crash-safe (two slots)."""

    def __init__(self, directory: Path, master: crypto.MasterKey) -> None:
        self.directory = Path(directory)
        self.master = master

    def path(self, tenant_id: str) -> Path:
        return self.directory / vault_name(tenant_id)

    # -- reading -------------------------------------------------------------------------------

    def exists(self, tenant_id: str) -> bool:
        return self._load(tenant_id) is not None

    def current(self, tenant_id: str, *, create: bool) -> tuple[str, bytes]:
        """The tenant's current KEK (id, key); with `create`, made on first use (atomically: one wins)."""
        doc = self._load(tenant_id)
        if doc is None or doc.current is None:
            if not create:
                raise KekUnavailable("key_vault", f"tenant {tenant_id!r} has no key-encryption key")
            doc = self._create(tenant_id)
        assert doc.current is not None
        return doc.current, self._unseal(tenant_id, doc, doc.current)

    def unseal(self, tenant_id: str, kek_id: str) -> bytes:
        """The KEK `kek_id` of the tenant; KekUnavailable when the vault no longer holds it."""
        doc = self._load(tenant_id)
        if doc is None or kek_id not in doc.keks:
            raise KekUnavailable(
                "key_vault",
                f"key-encryption key {kek_id} of tenant {tenant_id!r} is not in the vault (rotated or destroyed)",
            )
        return self._unseal(tenant_id, doc, kek_id)

    def kek_ids(self, tenant_id: str) -> list[str]:
        doc = self._load(tenant_id)
        return [] if doc is None else sorted(doc.keks)

    def _unseal(self, tenant_id: str, doc: _Document, kek_id: str) -> bytes:
        entry = doc.keks[kek_id]
        if entry["provider"] != self.master.provider:
            raise ServiceError(
                "master_key",
                f"tenant {tenant_id!r} keys are wrapped by {entry['provider']}, but the configured master key is "
                f"{self.master.provider}; set MEMORY_PIPELINES_KMS_KEY_ID (or unset it) to match",
            )
        return self.master.unwrap(base64.b64decode(entry["wrapped"]), tenant_id=tenant_id, purpose=PURPOSE)

    def _load(self, tenant_id: str) -> _Document | None:
        try:
            fd = os.open(self.path(tenant_id), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            return _newest(os.pread(fd, VAULT_BYTES, 0))
        finally:
            os.close(fd)  # closing releases the lock

    # -- writing -------------------------------------------------------------------------------

    def _new_entry(self, tenant_id: str) -> tuple[str, bytes, dict[str, Any]]:
        kek_id = "kek_" + secrets.token_hex(12)
        key, wrapped = self.master.new_wrapped_key(tenant_id=tenant_id, purpose=PURPOSE)
        return kek_id, key, {"provider": self.master.provider, "wrapped": base64.b64encode(wrapped).decode("ascii")}

    def _create(self, tenant_id: str) -> _Document:
        """Write a new vault file whole under a temporary name, then link it into place: another
        process creating the same tenant's vault at once either wins or finds this one."""
        self._ensure_directory()
        kek_id, _, entry = self._new_entry(tenant_id)
        doc = _Document(generation=1, current=kek_id, keks={kek_id: {**entry, "since": 1}})
        # Announced (lib/infra/artifacts.py): a copy of a KEK left by a crash here would outlive the
        # KEK's rotation, so the next command's sweep removes it.
        with artifacts.artifact(self.directory, "new-") as temporary:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.pwrite(fd, _slot(doc) + bytes(_SLOT), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            faults.point("vault.create.written")
            with contextlib.suppress(FileExistsError):
                os.link(temporary, self.path(tenant_id))  # fails if another process linked first
        self._sync_directory()
        found = self._load(tenant_id)
        if found is None or found.current is None:
            raise ServiceError("key_vault", f"the vault file of tenant {tenant_id!r} vanished while it was made")
        return found

    def introduce(self, tenant_id: str, *, keep: set[str]) -> tuple[str, bytes]:
        """A rotation's first step, before the key store is rewrapped: a new KEK joins those of `keep`
        (KEKs rows still name) and becomes current. Others (leftovers of interrupted rotations) go."""
        kek_id, key, entry = self._new_entry(tenant_id)
        with self._locked(tenant_id, create=True) as (fd, doc):
            kept = {k: v for k, v in (doc.keks if doc else {}).items() if k in keep}
            if len(kept) >= MAX_KEKS:
                raise ServiceError("key_vault", f"tenant {tenant_id!r} rows name {len(kept)} key-encryption keys")
            generation = (doc.generation if doc else 0) + 1
            new = _Document(generation, current=kek_id, keks={**kept, kek_id: {**entry, "since": generation}})
            _write(fd, new, both=False)
        return kek_id, key

    def keep_only(self, tenant_id: str, kek_id: str) -> None:
        """A rotation's last step, once no row names an older KEK: both slots are overwritten with a
        document holding `kek_id` (and any KEK a later rotation introduced since), and fsynced, so
        the older KEKs are left in neither."""
        with self._locked(tenant_id, create=False) as (fd, doc):
            if doc is None or kek_id not in doc.keks:
                raise KekUnavailable(
                    "key_vault", f"key-encryption key {kek_id} of tenant {tenant_id!r} is not in the vault"
                )
            since = int(doc.keks[kek_id].get("since", 0))
            kept = {k: v for k, v in doc.keks.items() if int(v.get("since", 0)) >= since}
            current = max(kept, key=lambda k: int(kept[k].get("since", 0)))
            _write(fd, _Document(doc.generation + 1, current=current, keks=kept), both=True)

    def destroy(self, tenant_id: str) -> bool:
        """Overwrite the tenant's vault file with zeros in place, fsync, unlink it; False when absent."""
        path = self.path(tenant_id)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = max(os.fstat(fd).st_size, VAULT_BYTES)
            os.pwrite(fd, bytes(size), 0)
            os.fsync(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        finally:
            os.close(fd)
        self._sync_directory()
        return True

    @contextlib.contextmanager
    def _locked(self, tenant_id: str, *, create: bool) -> Iterator[tuple[int, _Document | None]]:
        """The tenant's vault file opened for writing under an exclusive lock, with its newest document."""
        self._ensure_directory()
        path = self.path(tenant_id)
        while True:
            flags = os.O_RDWR | (os.O_CREAT if create else 0)
            try:
                fd = os.open(path, flags, 0o600)
            except FileNotFoundError:
                yield -1, None
                return
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A destroy may have unlinked the file between our open and our lock: start again.
            if os.fstat(fd).st_nlink == 0:
                os.close(fd)
                if not create:
                    yield -1, None
                    return
                continue
            break
        try:
            yield fd, _newest(os.pread(fd, VAULT_BYTES, 0))
        finally:
            os.close(fd)
        if create:
            self._sync_directory()

    def _ensure_directory(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.directory.stat().st_mode & 0o077:
            os.chmod(self.directory, 0o700)

    def _sync_directory(self) -> None:
        with contextlib.suppress(OSError):
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _slot(doc: _Document) -> bytes:
    body = json.dumps(
        {"format": _FORMAT, "generation": doc.generation, "current": doc.current, "keks": doc.keks},
        sort_keys=True,
        separators=(",", ":"),
    ).encode("ascii")
    if len(body) > _SLOT - _HEADER:
        raise ServiceError("key_vault", f"a vault document of {len(body)} bytes does not fit its slot")
    framed = len(body).to_bytes(4, "big") + hashlib.sha256(body).digest() + body
    return framed + bytes(_SLOT - len(framed))


def _parse(slot: bytes) -> _Document | None:
    if len(slot) < _HEADER:
        return None
    length = int.from_bytes(slot[:4], "big")
    body = slot[_HEADER : _HEADER + length]
    if not 0 < length <= _SLOT - _HEADER or hashlib.sha256(body).digest() != slot[4:_HEADER]:
        return None  # zeros (a fresh or destroyed slot) or a write torn by a crash
    try:
        data: Any = json.loads(body)
    except ValueError:
        return None
    if data.get("format") != _FORMAT:
        return None
    return _Document(generation=int(data["generation"]), current=data.get("current"), keks=dict(data["keks"]))


def _slots(raw: bytes) -> list[_Document | None]:
    raw = raw.ljust(VAULT_BYTES, b"\0")
    return [_parse(raw[:_SLOT]), _parse(raw[_SLOT:VAULT_BYTES])]


def _newest(raw: bytes) -> _Document | None:
    found = [doc for doc in _slots(raw) if doc is not None]
    return max(found, key=lambda doc: doc.generation) if found else None


def _write(fd: int, new: _Document, *, both: bool) -> None:
    """Write `new` in place: first into the slot not holding the newest valid document (so a torn
    write leaves that one readable), then, with `both`, into the other slot too; fsync after each."""
    raw = os.pread(fd, VAULT_BYTES, 0)
    slots = _slots(raw)
    newest = max(
        (i for i, doc in enumerate(slots) if doc is not None),
        key=lambda i: slots[i].generation,  # type: ignore[union-attr]
        default=None,
    )
    first = 1 if newest == 0 else 0
    order = [first, 1 - first] if both else [first]
    if len(raw) < VAULT_BYTES:
        os.pwrite(fd, bytes(VAULT_BYTES - len(raw)), len(raw))
    for index in order:
        os.pwrite(fd, _slot(new), index * _SLOT)
        os.fsync(fd)
