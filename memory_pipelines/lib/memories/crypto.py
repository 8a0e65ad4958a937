"""Envelope encryption (AES-256-GCM): master key -> tenant KEK (a file of the key vault) -> tenant,
subject, team and per-build keys (PostgreSQL) -> memory text, summaries, prompt snapshots.

The master key is a local key file by default, or an AWS KMS key; it seals each tenant's
key-encryption key (lib/memories/key_vault.py), which wraps the keys kept in PostgreSQL (lib/memories/keys.py).
Every wrap binds its position in the hierarchy as associated data, so a wrapped key copied to
another row does not unwrap.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from memory_pipelines.lib.infra.errors import ServiceError

__all__ = [
    "KEY_BYTES",
    "STREAM_CHUNK",
    "STREAM_MAGIC",
    "TENANT_KEY",
    "DecryptionError",
    "KmsMasterKey",
    "LocalMasterKey",
    "MasterKey",
    "aad",
    "decrypt_stream",
    "derive_key",
    "encrypt_stream",
    "mac",
    "new_key",
    "open_sealed",
    "seal",
    "sealer",
]

KEY_BYTES = 32
_NONCE_BYTES = 12
_FORMAT = b"\x01"


class DecryptionError(Exception):
    """Ciphertext failed authentication: wrong key, wrong associated data, or tampering."""


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """AES-256-GCM with a random nonce; output is format byte + nonce + ciphertext/tag."""
    nonce = secrets.token_bytes(_NONCE_BYTES)
    return _FORMAT + nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def sealer(key: bytes) -> Callable[[bytes, bytes], bytes]:
    """`seal` under one key for many plaintexts: (plaintext, aad) -> blob, the cipher set up once
    (a bulk write wraps up to 256 version keys under one group key)."""
    cipher = AESGCM(key)

    def seal_one(plaintext: bytes, aad: bytes) -> bytes:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        return _FORMAT + nonce + cipher.encrypt(nonce, plaintext, aad)

    return seal_one


def open_sealed(key: bytes, blob: bytes, aad: bytes) -> bytes:
    if len(blob) < 1 + _NONCE_BYTES + 16 or blob[:1] != _FORMAT:
        raise DecryptionError("ciphertext is truncated or of an unknown format")
    nonce = blob[1 : 1 + _NONCE_BYTES]
    try:
        return AESGCM(key).decrypt(nonce, blob[1 + _NONCE_BYTES :], aad)
    except InvalidTag as exc:
        raise DecryptionError("ciphertext failed authentication") from exc


def derive_key(key: bytes, purpose: bytes) -> bytes:
    """A sub-key for one purpose (e.g. text MACs), so one key never serves two algorithms."""
    return HKDF(algorithm=SHA256(), length=KEY_BYTES, salt=None, info=purpose).derive(key)


def mac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


def aad(*parts: str | int) -> bytes:
    """Associated data from unambiguous, length-prefixed parts."""
    out = bytearray()
    for part in parts:
        raw = str(part).encode("utf-8")
        out += len(raw).to_bytes(4, "big") + raw
    return bytes(out)


STREAM_MAGIC = b"MPSTREAM1"
STREAM_CHUNK = 1 << 20


def encrypt_stream(key: bytes, source: BinaryIO, sink: BinaryIO, aad: bytes, *, chunk_size: int = STREAM_CHUNK) -> int:
    """AES-256-GCM over a stream in independently sealed chunks, so memory stays flat; returns bytes written.

    Layout: magic, 8-byte random nonce prefix, then per chunk a final flag (1 byte), the sealed
    length (4 bytes) and the sealed bytes. Each chunk's nonce is the prefix plus its index, and its
    associated data binds `aad`, the index and the flag: chunks cannot be reordered, dropped,
    or cut off after the last one without failing authentication.
    """
    prefix = secrets.token_bytes(8)
    cipher = AESGCM(key)
    written = sink.write(STREAM_MAGIC + prefix)
    # Two input buffers (read one chunk ahead to know which is final) and one output buffer,
    # reused for every chunk: no per-chunk allocation or copy beyond the cipher itself.
    buffers, out = _stream_buffers(chunk_size)
    index = 0
    filled = _fill(source, buffers[0])
    while True:
        following = _fill(source, buffers[(index + 1) % 2])
        final = following == 0
        current = memoryview(buffers[index % 2])[:filled]
        sealed_len = filled + 16
        cipher.encrypt_into(
            prefix + index.to_bytes(4, "big"), current, _chunk_aad(aad, index, final), memoryview(out)[:sealed_len]
        )
        written += sink.write(bytes([final]) + sealed_len.to_bytes(4, "big"))
        written += sink.write(memoryview(out)[:sealed_len])
        if final:
            return written
        index += 1
        filled = following


_BUFFERS = threading.local()


def _stream_buffers(chunk_size: int) -> tuple[list[bytearray], bytearray]:
    """Per-thread buffers, allocated once: zeroing 3 MiB per call cost more than sealing a small backup."""
    cached: dict[int, tuple[list[bytearray], bytearray]] | None = getattr(_BUFFERS, "by_size", None)
    if cached is None:
        cached = _BUFFERS.by_size = {}
    if chunk_size not in cached:
        cached[chunk_size] = ([bytearray(chunk_size), bytearray(chunk_size)], bytearray(chunk_size + 16))
    return cached[chunk_size]


def _fill(source: BinaryIO, buffer: bytearray) -> int:
    """Read until `buffer` is full or the source ends; returns the bytes read."""
    view = memoryview(buffer)
    total = 0
    while total < len(buffer):
        got = source.readinto(view[total:])  # type: ignore[attr-defined]
        if not got:
            break
        total += got
    return total


def decrypt_stream(key: bytes, source: BinaryIO, sink: BinaryIO, aad: bytes) -> int:
    """Inverse of encrypt_stream; raises DecryptionError on any tampering or truncation. Returns plaintext bytes."""
    head = source.read(len(STREAM_MAGIC) + 8)
    if len(head) < len(STREAM_MAGIC) + 8 or not head.startswith(STREAM_MAGIC):
        raise DecryptionError("not an encrypted stream of this format, or truncated in its header")
    prefix = head[len(STREAM_MAGIC) :]
    cipher = AESGCM(key)
    index = 0
    plain = 0
    while True:
        frame = source.read(5)
        if len(frame) < 5:
            raise DecryptionError(f"stream truncated before its final chunk (after chunk {index})")
        final, length = frame[0], int.from_bytes(frame[1:], "big")
        if final not in (0, 1) or length > STREAM_CHUNK * 64 + 16:
            raise DecryptionError(f"chunk {index} has a corrupt frame")
        sealed = source.read(length)
        if len(sealed) < length:
            raise DecryptionError(f"stream truncated inside chunk {index}")
        try:
            data = cipher.decrypt(prefix + index.to_bytes(4, "big"), sealed, _chunk_aad(aad, index, bool(final)))
        except InvalidTag as exc:
            raise DecryptionError(f"chunk {index} failed authentication") from exc
        plain += sink.write(data)
        if final:
            if source.read(1):
                raise DecryptionError("bytes follow the final chunk")
            return plain
        index += 1


def _chunk_aad(aad: bytes, index: int, final: bool) -> bytes:
    return aad + index.to_bytes(4, "big") + bytes([final])


TENANT_KEY = "tenant-key"


class MasterKey(Protocol):
    """Wraps and unwraps keys bound to a tenant and a purpose: tenant keys (`tenant-key`, of tenants
    made before key vaults) and the tenants' key-encryption keys (`tenant-kek`, lib/memories/key_vault.py).
    `provider` is recorded beside every key it wraps."""

    provider: str

    def new_wrapped_key(self, *, tenant_id: str, purpose: str = TENANT_KEY) -> tuple[bytes, bytes]: ...

    def unwrap(self, wrapped: bytes, *, tenant_id: str, purpose: str = TENANT_KEY) -> bytes: ...


class LocalMasterKey:
    """A 32-byte key file created with mode 0600 on first use (development and single-host use)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._key = self._load_or_create(path)
        self.provider = "local:" + hashlib.sha256(self._key).hexdigest()[:16]

    @staticmethod
    def _load_or_create(path: Path) -> bytes:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return LocalMasterKey._load(path)
        key = new_key()
        with os.fdopen(fd, "wb") as fh:
            fh.write(key)
            fh.flush()
            os.fsync(fh.fileno())
        return key

    @staticmethod
    def _load(path: Path) -> bytes:
        """Read an existing key file, refusing one that anyone but its owner can read or write.

        Whoever can read the master key can unwrap every tenant key (and so read every memory and
        every backup); whoever can write it can swap it. The mode is checked on the open file
        (fstat), so it is the file actually read that was checked.
        """
        with open(path, "rb") as fh:
            mode = os.fstat(fh.fileno()).st_mode
            if mode & 0o077:
                raise ServiceError(
                    "master_key",
                    f"{path} is readable or writable by group or others (mode {stat.S_IMODE(mode):04o});"
                    f" it must be private to its owner: chmod 600 {path}",
                )
            key = fh.read(KEY_BYTES + 1)
        if len(key) != KEY_BYTES:
            raise ServiceError("master_key", f"{path} is not a {KEY_BYTES}-byte key file")
        return key

    def new_wrapped_key(self, *, tenant_id: str, purpose: str = TENANT_KEY) -> tuple[bytes, bytes]:
        key = new_key()
        return key, seal(self._key, key, aad(purpose, tenant_id))

    def unwrap(self, wrapped: bytes, *, tenant_id: str, purpose: str = TENANT_KEY) -> bytes:
        return open_sealed(self._key, wrapped, aad(purpose, tenant_id))


class KmsMasterKey:
    """Tenant keys are KMS data keys under `key_id`, bound to the tenant by encryption context."""

    def __init__(self, key_id: str, client: Any) -> None:
        self.key_id = key_id
        self._client = client
        self.provider = "kms:" + key_id

    @staticmethod
    def _context(tenant_id: str, purpose: str) -> dict[str, str]:
        # Tenant keys made before key vaults were bound by the tenant alone: their context stays.
        return {"tenant_id": tenant_id} if purpose == TENANT_KEY else {"tenant_id": tenant_id, "purpose": purpose}

    def new_wrapped_key(self, *, tenant_id: str, purpose: str = TENANT_KEY) -> tuple[bytes, bytes]:
        try:
            answer = self._client.generate_data_key(
                KeyId=self.key_id, KeySpec="AES_256", EncryptionContext=self._context(tenant_id, purpose)
            )
        except Exception as exc:  # botocore raises many types; all mean the master key is unusable
            raise ServiceError("kms", f"generate_data_key failed: {type(exc).__name__}: {exc}") from exc
        return bytes(answer["Plaintext"]), bytes(answer["CiphertextBlob"])

    def unwrap(self, wrapped: bytes, *, tenant_id: str, purpose: str = TENANT_KEY) -> bytes:
        try:
            answer = self._client.decrypt(
                KeyId=self.key_id, CiphertextBlob=wrapped, EncryptionContext=self._context(tenant_id, purpose)
            )
        except Exception as exc:
            raise ServiceError("kms", f"decrypt failed: {type(exc).__name__}: {exc}") from exc
        return bytes(answer["Plaintext"])
