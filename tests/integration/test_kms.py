"""The master key from AWS KMS (boto3 against moto's S3/KMS server on 127.0.0.1) end to end."""

from __future__ import annotations

import dataclasses

import psycopg
import pytest

from memory_pipelines.lib.runtime import open_store


def test_store_with_a_kms_master_key(session_settings, endpoints, tenant, kms_key):
    settings = dataclasses.replace(session_settings, kms_key_id=kms_key)
    store = open_store(settings, endpoints)
    written = store.write(tenant_id=tenant, user_id="alice", text="sealed under a KMS data key")
    store.keys.forget_cached()  # the next read must unwrap through KMS again
    assert store.history(tenant_id=tenant, memory_id=written.memory_id)[0]["text"] == "sealed under a KMS data key"
    with psycopg.connect(endpoints.store_conninfo) as conn:
        provider, wrapped = conn.execute(
            "SELECT provider, wrapped FROM keystore.tenant_keys WHERE tenant_id = %s", (tenant,)
        ).fetchone()
    assert provider == f"kms:{kms_key}"
    assert len(bytes(wrapped)) > 32  # a KMS ciphertext blob, never the raw key
    store.close()


def test_a_mismatched_master_key_is_a_clear_error(session_settings, endpoints, store, tenant, kms_key):
    from memory_pipelines.lib.infra.errors import ServiceError

    written = store.write(tenant_id=tenant, user_id="alice", text="sealed under the local master key")
    kms_store = open_store(dataclasses.replace(session_settings, kms_key_id=kms_key), endpoints)
    with pytest.raises(ServiceError) as err:
        kms_store.history(tenant_id=tenant, memory_id=written.memory_id)
    assert err.value.field == "master_key" and "MEMORY_PIPELINES_KMS_KEY_ID" in err.value.message
    kms_store.close()
