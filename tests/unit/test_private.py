"""lib/infra/owner_only.py: owner-only modes for what we create, and nothing narrowed that is not ours."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from memory_pipelines.lib.infra.owner_only import private_dir, private_file, restrict_umask, traversable_dir


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


def test_created_levels_are_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        deep = private_dir(tmp_path / "a" / "b" / "c")
        made = tmp_path / "a" / "b" / "c" / "f"
        made.write_text("x")
        private_file(made)
    finally:
        os.umask(old)
    assert [_mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", deep)] == [0o700, 0o700, 0o700]
    assert _mode(made) == 0o600


def test_an_existing_directory_is_narrowed_and_a_shared_one_left_alone(tmp_path: Path) -> None:
    ours = tmp_path / "home"
    ours.mkdir(mode=0o755)
    os.chmod(ours, 0o755)
    assert _mode(traversable_dir(ours, others_traverse=True)) == 0o711
    assert _mode(traversable_dir(ours, others_traverse=False)) == 0o700
    shared = tmp_path / "shared"  # like /tmp given as HOME: sticky and open to all, never ours to narrow
    shared.mkdir()
    os.chmod(shared, 0o1777)
    traversable_dir(shared, others_traverse=True)
    private_dir(shared)
    assert _mode(shared) == 0o1777 and shared.stat().st_mode & stat.S_ISVTX


def test_restrict_umask_returns_the_previous_one() -> None:
    old = os.umask(0o022)
    try:
        assert restrict_umask() == 0o022
        assert os.umask(0o022) == 0o077
    finally:
        os.umask(old)


def test_a_file_replaced_while_another_process_reads_it_is_never_seen_truncated(tmp_path):
    """Two CLI commands at once: one rewrites the warm code server's workspace file while the other,
    given that server a moment before, loads it. Written in place, the reader could find it empty
    ("Could not parse a workspace config", seen in CI); replaced whole, it reads old or new."""
    import subprocess
    import sys
    import time

    from memory_pipelines.lib.infra.owner_only import replace_private_file

    target = tmp_path / "workspace.yaml"
    texts = {"load_from:\n  - a: " + "x" * 4000 + "\n", "load_from:\n  - b: " + "y" * 4000 + "\n"}
    first, second = sorted(texts)
    replace_private_file(target, first)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path\n"
            "from memory_pipelines.lib.infra.owner_only import replace_private_file\n"
            "texts = [sys.argv[2], sys.argv[3]]\n"
            "for n in range(20000): replace_private_file(Path(sys.argv[1]), texts[n % 2])\n",
            str(target),
            first,
            second,
        ]
    )
    seen: set[str] = set()
    try:
        while writer.poll() is None:
            seen.add(target.read_text())
            time.sleep(0)
    finally:
        writer.wait(60)
    assert writer.returncode == 0
    assert seen <= texts and seen, [len(t) for t in seen - texts]
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["workspace.yaml"]  # no temporary file left
