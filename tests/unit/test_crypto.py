import os
import stat

import boto3
import pytest
from moto.server import ThreadedMotoServer

from memory_pipelines.lib.memories import crypto


def test_seal_roundtrip_binds_associated_data():
    key = crypto.new_key()
    aad = crypto.aad("memory-text", "acme", "m_1", 1)
    blob = crypto.seal(key, b"allergic to penicillin", aad)
    assert b"penicillin" not in blob
    assert crypto.open_sealed(key, blob, aad) == b"allergic to penicillin"
    # Same key, another version's associated data: refused.
    with pytest.raises(crypto.DecryptionError):
        crypto.open_sealed(key, blob, crypto.aad("memory-text", "acme", "m_1", 2))
    with pytest.raises(crypto.DecryptionError):
        crypto.open_sealed(crypto.new_key(), blob, aad)


def test_tampered_or_truncated_ciphertext_is_refused():
    key = crypto.new_key()
    blob = bytearray(crypto.seal(key, b"secret", b""))
    blob[-1] ^= 1
    with pytest.raises(crypto.DecryptionError):
        crypto.open_sealed(key, bytes(blob), b"")
    with pytest.raises(crypto.DecryptionError, match="truncated"):
        crypto.open_sealed(key, bytes(blob[:10]), b"")


def test_aad_parts_are_unambiguous():
    assert crypto.aad("ab", "c") != crypto.aad("a", "bc")


def test_local_master_key_is_created_0600_and_reused(tmp_path):
    path = tmp_path / "keys" / "master.key"
    first = crypto.LocalMasterKey(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(path.read_bytes()) == crypto.KEY_BYTES
    key, wrapped = first.new_wrapped_key(tenant_id="acme")
    again = crypto.LocalMasterKey(path)
    assert again.provider == first.provider
    assert again.unwrap(wrapped, tenant_id="acme") == key
    with pytest.raises(crypto.DecryptionError):
        again.unwrap(wrapped, tenant_id="other")


@pytest.fixture(scope="module")
def moto_endpoint():
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def test_kms_master_key_wraps_tenant_keys_through_real_http(moto_endpoint):
    client = boto3.client(
        "kms",
        endpoint_url=moto_endpoint,
        region_name="eu-west-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )
    key_id = client.create_key(Description="memory-pipelines test")["KeyMetadata"]["KeyId"]
    master = crypto.KmsMasterKey(key_id, client)
    key, wrapped = master.new_wrapped_key(tenant_id="acme")
    assert len(key) == 32 and key not in wrapped
    assert master.unwrap(wrapped, tenant_id="acme") == key
    assert master.provider == f"kms:{key_id}"
    # The encryption context binds the data key to its tenant.
    with pytest.raises(Exception, match="kms"):
        master.unwrap(wrapped, tenant_id="other")


def test_keystore_cache_is_bounded_and_least_recently_used_goes_first(tmp_path):
    from memory_pipelines.lib.memories.keys import KeyStore

    keys = KeyStore(crypto.LocalMasterKey(tmp_path / "master.key"), cache_size=2)
    keys.remember("a", b"A")
    keys.remember("b", b"B")
    assert keys.cached("a") == b"A"  # touch a: b is now the oldest
    keys.remember("c", b"C")
    assert (keys.cached("a"), keys.cached("b"), keys.cached("c")) == (b"A", None, b"C")
