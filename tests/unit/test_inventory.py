"""The inventory of HOME's paths (lib/infra/inventory.py): its matching, and the table in docs/operating.md."""

from __future__ import annotations

from pathlib import Path

from memory_pipelines.lib.infra.inventory import INVENTORY, entry_for, unlisted

OPERATING = Path(__file__).resolve().parents[2] / "docs" / "operating.md"


def test_patterns_cover_their_paths_and_nothing_else():
    found = {
        path: entry_for(Path(path)) for path in ("pg/data/base/1/1259", "keys/vault/.3f2a.artifact", "keys/master.key")
    }
    assert {path: entry.pattern if entry else None for path, entry in found.items()} == {
        "pg/data/base/1/1259": "pg/data/**",
        "keys/vault/.3f2a.artifact": "keys/vault/*",
        "keys/master.key": "keys/master.key",
    }
    assert entry_for(Path("keys/vault/deeper/file")) is None  # `*` stays within one name
    assert entry_for(Path("keys/other.key")) is None
    assert entry_for(Path("stray.txt")) is None
    home = Path("/h")
    assert unlisted(home, [home / "pg", home / "a.out", home / "chroma" / "door.sock"]) == [home / "a.out"]


def test_the_operators_table_is_the_inventory():
    text = OPERATING.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `") and line.count("|") == 5]
    listed = {line.split("|")[1].strip().strip("`"): line for line in rows}
    for entry in INVENTORY:
        line = listed.get(entry.pattern)
        assert line is not None, f"docs/operating.md has no row for {entry.pattern}"
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        assert cells == [f"`{entry.pattern}`", entry.what, entry.hosts or "—", entry.production or "—"], cells
