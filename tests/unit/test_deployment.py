"""What a proof claims per deployment (lib/forget/deployment.py): one line per target whatever the
deployment, chosen by the settings, and the operators' table (docs/operating.md)."""

from __future__ import annotations

from pathlib import Path

from memory_pipelines.lib.forget import deployment
from memory_pipelines.lib.infra.settings import Settings

OPERATING = Path(__file__).resolve().parents[2] / "docs" / "operating.md"
TARGETS = list(dict.fromkeys(row.target for row in deployment.ROWS))


def test_every_target_has_one_line_in_every_deployment():
    for mode in (deployment.EMBEDDED, deployment.EXTERNAL):
        chosen = deployment.rows(dict.fromkeys(deployment.PARTS, mode))
        assert [row.target for row in chosen] == TARGETS and {row.mode for row in chosen} == {mode}
    mixed = deployment.rows({"postgres": deployment.EXTERNAL, "chroma": deployment.EMBEDDED})
    assert [(row.target, row.mode) for row in mixed] == [(TARGETS[0], "external"), (TARGETS[1], "embedded")]
    # What is not proven in a deployment says so, and names the setting the operator has.
    for row in deployment.ROWS:
        assert row.operator_bounds and row.settings
        assert ("not scanned" in row.proven) == (row.mode == deployment.EXTERNAL and row.part != "masterKey")


def test_the_settings_choose_the_lines():
    home = Path("/h")
    local = deployment.of(Settings(home=home), postgres_files_ours=True)
    assert local == dict.fromkeys(deployment.PARTS, deployment.EMBEDDED)
    production = Settings(
        home=home, pg_url="postgresql://u:p@db/x", chroma_url="http://chroma:8000", s3_bucket="b", kms_key_id="k"
    )
    assert deployment.of(production, postgres_files_ours=False) == dict.fromkeys(deployment.PARTS, deployment.EXTERNAL)
    # A URL to a server whose files are readable here (the embedded one by URL) is scanned: ours.
    assert deployment.of(production, postgres_files_ours=True)["postgres"] == deployment.EMBEDDED


def test_the_operators_table_is_the_module():
    text = OPERATING.read_text()
    for row in deployment.ROWS:
        line = f"| {row.target} | {row.mode} | {row.proven} | {row.operator_bounds} | {row.settings} |"
        assert line in text, f"docs/operating.md lacks the {row.mode} line of {row.target}"
