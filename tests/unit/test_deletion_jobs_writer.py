"""One writer of the deletion ledger: of the package's modules, only lib/forget/ledger.py writes
control.deletion_jobs (its states, targets, proofs and erasures), so every change of a job's record
is in one place to read and to audit. The migrations under assets/ are not modules of the package.
Read from the source's string constants (SQL), never from a database."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "memory_pipelines"
WRITER = PACKAGE / "lib" / "forget" / "ledger.py"
# Whitespace and case as SQL allows them; an alias (`control.deletion_jobs j`) changes nothing.
WRITE = re.compile(r"\b(UPDATE|INSERT\s+INTO|DELETE\s+FROM)\s+control\.deletion_jobs\b", re.IGNORECASE)


def writes(path: Path) -> list[str]:
    """The statements of `path` (string constants, f-strings' parts included) that write the jobs' table."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        " ".join(node.value.split())[:100]
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and WRITE.search(node.value)
    ]


def test_writes_are_found_however_the_statement_is_spelled(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        'A = "update control.deletion_jobs j SET x = 1"\n'
        'B = ("INSERT INTO"\n " control.deletion_jobs (job_id) VALUES (%s)")\n'
        'C = f"DELETE  FROM control.deletion_jobs WHERE job_id = {1}"\n'
        'D = "SELECT state FROM control.deletion_jobs WHERE job_id = %s FOR UPDATE"\n'
        "# UPDATE control.deletion_jobs in a comment is no statement\n"
    )
    assert len(writes(module)) == 3


def test_only_the_ledger_writes_deletion_jobs() -> None:
    assert WRITER.exists()
    others = {
        str(path.relative_to(PACKAGE.parent)): found
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != WRITER and (found := writes(path))
    }
    assert others == {}, "control.deletion_jobs is written by lib/forget/ledger.py only; move these there"
    assert writes(WRITER), "the ledger's own writes are found (the search still matches its SQL)"
