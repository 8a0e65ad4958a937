"""The docs build strictly: the README stays short and links every page of docs/, and every relative
link of the README and docs/ reaches a file, and a heading of it when it names one (`page.md#heading`,
GitHub's anchors). Our plain equivalent of `mkdocs build --strict`, without a site to build."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
README_MAX_LINES = 250


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings: lowercase, punctuation dropped, spaces to hyphens."""
    found = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [m.group(1) or m.group(2) for m in LINK.finditer(text)]


def test_the_readme_is_short_and_links_every_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.count("\n") <= README_MAX_LINES
    linked = {target.split("#")[0] for target in links(ROOT / "README.md")}
    assert {f"docs/{p.name}" for p in PAGES[1:]} <= linked


def test_every_relative_link_reaches_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in links(page):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto, data: not ours to check here
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []
