"""Every file path a doc, comment or docstring names exists: a reorganisation that moves a module
leaves no comment pointing at where it was.

A mention resolves against the repository, the package and its `lib/`, `lib/stores/` and `defs/`
folders, `deploy/`, the naming file's own folder, or an installed package (`dagster/_cli/job.py`).
Placeholders are not paths: a first segment in capitals (`HOME/`, `OUT/`), `NNNN`, `<...>`, and the
files a HOME holds (`chroma/`, `dagster/dagster.yaml`), which exist only at run time.
"""

from __future__ import annotations

import re
import subprocess
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "memory_pipelines"
ROOTS = (ROOT, PACKAGE, PACKAGE / "lib", PACKAGE / "lib" / "stores", PACKAGE / "defs", ROOT / "deploy")
SITE = Path(sysconfig.get_paths()["purelib"])
MENTION = re.compile(r"(?<![\w./<>-])((?:[\w.-]+/)+[\w.-]+\.(?:py|sql|yaml|yml|json|md|toml|png|sh|html))(?![\w])")
# Files under a HOME (`lib/infra/inventory.py` lists them all), named without the HOME/ prefix.
HOME_FILES = ("chroma/", "dagster/dagster.yaml", "dagster/workspace.yaml", "pg/", "keys/", "eval/")
TEXT = (".py", ".md", ".sql", ".yaml", ".yml", ".toml", ".sh")


def _placeholder(path: str) -> bool:
    first = path.split("/", 1)[0]
    return (first.isupper() and len(first) > 1) or "NNNN" in path or path.startswith(HOME_FILES)


def _resolves(path: str, named_in: Path) -> bool:
    roots = (*ROOTS, named_in.parent, SITE)
    return any((root / path).exists() for root in roots)


def test_every_named_path_exists():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    missing = []
    for name in files:
        if not name.endswith(TEXT) or name.startswith("assets/demo/"):
            continue
        source = ROOT / name
        if not source.exists():
            continue
        for match in MENTION.finditer(source.read_text(encoding="utf-8", errors="replace")):
            path = match.group(1)
            if not _placeholder(path) and not _resolves(path, source):
                missing.append(f"{name}: {path}")
    assert missing == []
