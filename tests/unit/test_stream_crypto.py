"""Chunked AES-GCM streams (backups): round trips, and every way of damaging one fails loudly."""

from __future__ import annotations

import io
import os

import pytest

from memory_pipelines.lib.memories import crypto

KEY = bytes(range(32))
AAD = crypto.aad("backup", "tenant-a", "b_1")


def encrypt(data: bytes, chunk: int = 64) -> bytes:
    out = io.BytesIO()
    crypto.encrypt_stream(KEY, io.BytesIO(data), out, AAD, chunk_size=chunk)
    return out.getvalue()


def decrypt(blob: bytes, aad: bytes = AAD, key: bytes = KEY) -> bytes:
    out = io.BytesIO()
    crypto.decrypt_stream(key, io.BytesIO(blob), out, aad)
    return out.getvalue()


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 64 * 3, 1000])
def test_round_trip_at_chunk_boundaries(size):
    data = os.urandom(size)
    blob = encrypt(data)
    assert decrypt(blob) == data
    # A plaintext of a few random bytes occurs in any blob by chance; from 16 bytes on it must not.
    assert size < 16 or data not in blob


def test_each_chunk_is_sealed_separately():
    blob = encrypt(b"x" * 200, chunk=64)
    # 4 chunks: 9-byte magic + 8-byte prefix, then (1 + 4 + len + 16) per chunk.
    assert len(blob) == 17 + 3 * (5 + 64 + 16) + (5 + 8 + 16)


def test_flipped_byte_fails():
    blob = bytearray(encrypt(os.urandom(300)))
    blob[100] ^= 1
    with pytest.raises(crypto.DecryptionError, match="authentication"):
        decrypt(bytes(blob))


@pytest.mark.parametrize("cut", [5, 17, 30, 17 + 85, -1])
def test_truncation_anywhere_fails(cut):
    blob = encrypt(os.urandom(300))
    with pytest.raises(crypto.DecryptionError):
        decrypt(blob[:cut])


def test_dropping_the_final_chunk_at_a_boundary_fails():
    data = os.urandom(64 * 3)
    blob = encrypt(data)
    with pytest.raises(crypto.DecryptionError, match="truncated before its final chunk"):
        decrypt(blob[: 17 + 2 * 85])


def test_reordered_chunks_fail():
    blob = encrypt(os.urandom(64 * 3))
    head, c0, c1, rest = blob[:17], blob[17:102], blob[102:187], blob[187:]
    with pytest.raises(crypto.DecryptionError, match="authentication"):
        decrypt(head + c1 + c0 + rest)


def test_wrong_key_or_associated_data_fails():
    blob = encrypt(b"the backup of tenant-a")
    with pytest.raises(crypto.DecryptionError):
        decrypt(blob, aad=crypto.aad("backup", "tenant-b", "b_1"))
    with pytest.raises(crypto.DecryptionError):
        decrypt(blob, key=bytes(32))


def test_trailing_bytes_fail():
    with pytest.raises(crypto.DecryptionError, match="follow the final chunk"):
        decrypt(encrypt(b"abc") + b"\x00")
