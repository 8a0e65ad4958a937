"""A deletion certificate rendered from a proof alone (lib/forget/certificate.py): pure, no database.
tests/integration/test_certificate.py renders real forgets' proofs."""

from __future__ import annotations

import pytest

from memory_pipelines.lib.forget import certificate

PROOF = {
    "jobId": "del_" + "1" * 32,
    "scope": {"type": "MEMORY", "tenant": "acme"},
    "scopeHash": "ab" * 32,
    "basis": "user-request",
    "state": "COMPLETE",
    "requestedAt": "2026-06-01T10:00:00+00:00",
    "completedAt": "2026-06-01T10:05:00+00:00",
    "deadline": "2026-07-01T10:00:00+00:00",
    "targets": {"chroma": "DONE:2", "backups": "PENDING:crypto-shred", "physical": "PENDING:erasure"},
    "verification": {"exact_id_queries": {"chroma": 0}},
    "pauses": [
        {
            "pausedAt": "2026-06-01T10:01:00+00:00",
            "resumedAt": "2026-06-01T10:03:00+00:00",
            "scope": "tenant",
            "reason": "incident 7",
        }
    ],
    "adapterVersions": {"chroma": "chroma-v2"},
}


def test_a_proof_renders_its_stores_times_and_pauses_and_names_what_it_lacks() -> None:
    md = certificate.render_markdown(PROOF)
    lines = md.splitlines()
    assert lines[0] == f"# Deletion certificate `{PROOF['jobId']}`"
    row = next(line for line in lines if line.startswith("| `chroma` |"))
    assert row.split(" | ")[2:] == ["`chroma-v2`", "`DONE:2`", "`2`", "`passed: 0 left by exact id` |"]
    # A registered store the proof does not name is listed, as not recorded, never left out.
    keyword = next(line for line in lines if line.startswith("| `keyword_index` |"))
    assert keyword.count("`not recorded`") == 4
    assert "- **Paused (tenant: incident 7):** `2026-06-01T10:01:00+00:00 to 2026-06-01T10:03:00+00:00`" in lines
    assert "- **Physically erased:** `PENDING: to be erased by erasure`" in lines
    page = certificate.render_html(PROOF)
    assert "incident 7" in page and "chroma-v2" in page and page.lstrip().lower().startswith("<!doctype html>")


def test_hostile_values_are_escaped_in_html_and_inert_in_markdown():
    # Validation keeps tenants and bases to safe ids, so a hostile proof is built by hand.
    hostile = '<script>alert("x")</script>'
    proof = {
        "jobId": "del_" + "0" * 32,
        "scope": {"type": "SUBJECT", "tenant": hostile},
        "scopeHash": "ab" * 32,
        "basis": hostile,
        "targets": {"chroma": f"DONE:1{hostile}", "backups": hostile},
        "verification": {"exact_id_queries": {"chroma": 0}},
    }
    page = certificate.render_html(proof)
    assert "<script" not in page and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert certificate.h("a<b>&\"'") == "a&lt;b&gt;&amp;&quot;&#x27;"
    md = certificate.render_markdown(proof)
    # Every value sits in a code span, so Markdown renders it as text, never as HTML.
    assert f"- **Basis:** `{hostile}`" in md and f"- **Tenant:** `{hostile}`" in md
    assert certificate.md_code("a|b`c\nd", table=True) == "`a\\|b'c d`"
    with pytest.raises(Exception, match="format"):
        certificate.render(proof, None, "pdf")
