"""Deletion certificates and data-map pictures: rendered from a real forget's proof, every registered
store listed, nothing of the memories' text, every value escaped."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from memory_pipelines.defs.forget.ops import job_key
from memory_pipelines.lib.forget import certificate, deployment
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.erasure import ErasureService
from memory_pipelines.lib.stores import registry
from tests.conftest import run_cli

pytestmark = pytest.mark.slow


def seed(store, derived, tenant):
    """alice (personal and team) and bob, every derived store materialized; returns the canary, the
    texts written and bob's memory id (which a forget of alice keeps)."""
    canary = f"canary-{uuid.uuid4().hex[:10]}"
    store.add_team_member(tenant_id=tenant, team_id="core", user_id="alice")
    texts = {
        "alice_personal": f"Alice hides {canary} licorice in the drawer",
        "alice_team": f"Core freeze {canary} starts Friday",
        "bob": f"Bob keeps a sourdough starter {canary}",
    }
    store.write(tenant_id=tenant, user_id="alice", text=texts["alice_personal"])
    store.write(tenant_id=tenant, user_id="alice", text=texts["alice_team"], team_id="core")
    bob = store.write(tenant_id=tenant, user_id="bob", text=texts["bob"])
    derived.sync_all(tenant_id=tenant)
    derived.recaller.recall(tenant_id=tenant, user_id="alice", query="licorice")
    return canary, texts, bob.memory_id


def assert_no_text(document: str, canary: str, texts: dict[str, str]) -> None:
    assert canary not in document
    for text in texts.values():
        assert text not in document
    for word in ("licorice", "sourdough", "drawer"):
        assert word not in document


def test_a_real_forgets_certificate_in_markdown_and_html(store, derived, tenant):
    canary, texts, _ = seed(store, derived, tenant)
    before = certificate.data_map(store, tenant)
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice", basis="gdpr-art17")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    after = certificate.data_map(store, tenant)
    # The data map counts records per registered store by lineage: alice's two memories leave.
    assert set(before) == set(after) == set(registry.names())
    assert before["primary"] == 3 and after["primary"] == 1
    assert before["chroma"] == 3 and after["chroma"] == 1
    assert before["keyword_index"] == 3 and after["keyword_index"] == 1
    assert before["key_store"] > after["key_store"]  # alice's subject key is destroyed

    proof = service.proof(job_id=job["job_id"])
    status = service.status(job_id=job["job_id"])
    pending_md = certificate.render_markdown(proof, status)
    assert "PENDING: to be erased by" in pending_md and "PENDING_SHRED: 0 live backup(s)" in pending_md
    assert certificate.DEPLOYMENT_PENDING in pending_md

    ErasureService(derived).erase_tenant(tenant_id=tenant)
    proof = service.proof(job_id=job["job_id"])
    status = service.status(job_id=job["job_id"])
    md = certificate.render_markdown(proof, status)
    page = certificate.render_html(proof, status)
    for document in (md, page):
        assert job["job_id"] in document and tenant in document
        assert "gdpr-art17" in document and proof["scopeHash"] in document and proof["deadline"] in document
        for spec in registry.stores():
            assert spec.name in document, spec.name
        assert "SHREDDED" in document and "ERASED" in document and "COMPLETE" in document
        assert "alice" not in document  # the proof holds the scope hash only, never the subject's id
        assert certificate.NOT_RECORDED not in document  # a fresh proof records every store
        assert_no_text(document, canary, texts)
    # One table row per registered store, with its records deleted and its verification.
    stores_table = md[md.index("## Stores") : md.index("## Verification")]
    rows = [line for line in stores_table.splitlines() if line.startswith("| `")]
    assert [row.split("|")[1].strip(" `") for row in rows] == [spec.name for spec in registry.stores()]
    # Which guarantee held, per store: the primary's texts and the keys are sealed under keys the
    # SUBJECT scope destroyed and their files were scanned (both); Chroma's vectors are in the clear,
    # so only the scan speaks for them.
    table = md[md.index("## Guarantees") : md.index("## What this deployment proves")]
    cells = [line.split("|") for line in table.splitlines() if line.startswith("| `")]
    held = {row[1].strip(" `"): row[5].strip(" `") for row in cells}
    assert set(held) == set(registry.names())
    assert held["primary"].startswith("both") and held["key_store"].startswith("both"), held
    assert held["chroma"].startswith("physical") and held["subject_summaries"].startswith("both"), held
    assert proof["guarantees"]["primary"]["cryptographic"] == f"KEY_DESTROYED:{proof['erasure']['erasedAt']}"
    primary = next(row for row in rows if row.startswith("| `primary`"))
    assert "`DONE:2`" in primary and "| `2` |" in primary and "passed: 0 left by exact id" in primary
    # This suite's deployment: every service embedded, so each target's embedded line, and nothing else.
    assert proof["erasure"]["deployment"] == dict.fromkeys(deployment.PARTS, deployment.EMBEDDED)
    section = md[md.index("## What this deployment proves") : md.index("## Physical erasure")]
    lines = [line for line in section.splitlines() if line.startswith("| `")]
    assert [line.split("|")[2].strip(" `") for line in lines] == [deployment.EMBEDDED] * 4
    assert "a byte scan of the data directory and pg_wal found no fingerprint" in section
    assert "not scanned" not in section.lower() and certificate.DEPLOYMENT_PENDING not in md
    assert "What this deployment proves" in page
    scan = proof["erasure"]["byteScan"]
    assert f"- **Files scanned:** `{scan['files']}`" in md and f"- **Fingerprints:** `{scan['fingerprints']}`" in md
    assert "- **Hits:** `0`" in md and f"- **Physically erased:** `{proof['erasure']['erasedAt']}`" in md
    assert page.startswith("<!DOCTYPE html>") and "<style>" in page
    assert "http://" not in page and "https://" not in page and "<script" not in page and "<link" not in page


def test_a_store_the_proof_lacks_is_listed_as_not_recorded(store, derived, tenant):
    seed(store, derived, tenant)
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="bob")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])
    proof = service.proof(job_id=job["job_id"])
    del proof["targets"]["analytics"]
    del proof["verification"]["exact_id_queries"]["analytics"]
    md = certificate.render_markdown(proof)
    row = next(line for line in md.splitlines() if line.startswith("| `analytics`"))
    assert row.count("`not recorded`") == 3  # target, records deleted, verification


def test_the_forget_run_attaches_the_certificate_and_the_data_map(store, derived, tenant, session_settings):
    import dagster as dg

    from memory_pipelines.definitions import defs
    from memory_pipelines.defs.forget.jobs import forget_run_config

    canary, texts, _ = seed(store, derived, tenant)
    job = DeletionService(derived).request(tenant_id=tenant, subject="alice", basis="ccpa")
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("tenants", [tenant])
        os.environ["MEMORY_PIPELINES_HOME"] = str(session_settings.home)
        result = (
            defs()
            .resolve_job_def("forget")
            .execute_in_process(
                instance=instance, partition_key=tenant, run_config=forget_run_config(job_ids=[job["job_id"]])
            )
        )
        assert result.success
        [deletions] = [
            e.step_materialization_data.materialization
            for e in result.get_asset_materialization_events()
            if e.asset_key.to_user_string() == "memory_deletions"
        ]
    metadata = deletions.metadata
    md = metadata[job_key("certificate", job["job_id"])].value
    assert isinstance(metadata[job_key("certificate", job["job_id"])], dg.MarkdownMetadataValue)
    assert job["job_id"] in md and "ccpa" in md and all(spec.name in md for spec in registry.stores())
    assert metadata["data_map_before"].value["primary"] == 3 and metadata["data_map_after"].value["primary"] == 1
    assert metadata["data_map_before"].value["chroma"] == 3 and metadata["data_map_after"].value["chroma"] == 1
    picture = metadata["data_map"].value
    assert "| `primary` | 3 | 1 | 2 |" in picture and "](data:image/png;base64,iVBORw0KGgo" in picture
    for value in metadata.values():
        assert_no_text(json.dumps(str(value.value)), canary, texts)


def cli(cli_env, *args):
    return run_cli(*args, home=cli_env["home"], env=cli_env["env"])


def test_cli_proof_formats_output_file_and_lineage_picture(cli_env, store, derived, tenant, tmp_path):
    canary, texts, memory_id = seed(store, derived, tenant)
    service = DeletionService(derived)
    job = service.request(tenant_id=tenant, subject="alice")
    service.run_batch(tenant_id=tenant, job_ids=[job["job_id"]])

    default = cli(cli_env, "deletion", "proof", job["job_id"])
    assert default.returncode == 0, default.stderr
    assert json.loads(default.stdout) == service.proof(job_id=job["job_id"])  # json stays the default

    md = cli(cli_env, "deletion", "proof", job["job_id"], "--format", "md")
    assert md.returncode == 0, md.stderr
    assert md.stdout.startswith(f"# Deletion certificate `{job['job_id']}`")
    assert "user-request" in md.stdout and all(spec.name in md.stdout for spec in registry.stores())
    assert_no_text(md.stdout, canary, texts)

    target = tmp_path / "certificate.html"
    written = cli(cli_env, "deletion", "proof", job["job_id"], "--format", "html", "--output", str(target))
    assert written.returncode == 0, written.stderr
    assert json.loads(written.stdout) == {"written": str(target)}
    page = target.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and job["job_id"] in page
    assert_no_text(page, canary, texts)

    unknown = cli(cli_env, "deletion", "proof", job["job_id"], "--format", "pdf")
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert "memory-pipelines: error: format: " in unknown.stderr and "Traceback" not in unknown.stderr

    picture = tmp_path / "lineage.png"
    drawn = cli(
        cli_env, "lineage", "--tenant", tenant, "--memory-id", memory_id, "--format", "png", "--output", str(picture)
    )
    assert drawn.returncode == 0, drawn.stderr
    assert json.loads(drawn.stdout) == {"written": str(picture)}
    assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and picture.stat().st_size > 1000
    no_file = cli(cli_env, "lineage", "--tenant", tenant, "--memory-id", memory_id, "--format", "png")
    assert no_file.returncode == 2 and "memory-pipelines: error: output: " in no_file.stderr
