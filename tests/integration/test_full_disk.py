"""A full disk for real (issue 33, finding 5): HOME on a 64 MiB tmpfs of its own, in a mount namespace,
with the session's PostgreSQL and Chroma outside it as managed servers would be, filled to the last
byte after the tenant is written and materialized. A forget then fails with the resource exit code,
names its accepted job and keeps its scope hidden; once space is freed, `deletion retry` completes it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
import uuid
from pathlib import Path

import pytest

from memory_pipelines.lib.infra.services import Endpoints
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories.store import MemoryStore
from tests.conftest import CLI

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """\
    set -u
    mount --make-rprivate /
    mount -t tmpfs -o size=64m,mode=0700 tmpfs "$H"
    mkdir -m 700 "$H/keys" && cp "$KEY" "$H/keys/master.key"
    say() { echo "$1=$2" >> "$OUT/rc"; }
    "$CLI" write --tenant "$T" --user bob "bob mends clocks" > /dev/null; say write $?
    "$CLI" write --tenant "$T" --user alice "alice keeps bees" > /dev/null; say write $?
    "$CLI" materialize --tenant "$T" > /dev/null 2> "$OUT/materialize.err"; say materialize $?
    head -c 100M /dev/zero > "$H/filler" 2> /dev/null
    say free "$(df --output=avail -k "$H" | tail -1 | tr -d ' ')"
    timeout 300 "$CLI" forget --tenant "$T" --subject bob --wait > "$OUT/forget.out" 2> "$OUT/forget.err"
    say forget $?
    "$CLI" list --tenant "$T" --user bob > "$OUT/bob.json" 2> /dev/null; say list $?
    rm -f "$H/filler"
    job=$("$CLI" deletion list --tenant "$T" | python3 -c 'import json,sys; print(json.load(sys.stdin)[0]["job_id"])')
    timeout 300 "$CLI" deletion retry "$job" > "$OUT/retry.out" 2> "$OUT/retry.err"; say retry $?
    "$CLI" list --tenant "$T" --user alice > "$OUT/alice.json" 2> /dev/null
    "$CLI" stop > /dev/null 2>&1
    umount -l "$H"
    """
)


def test_a_full_disk_under_home_is_its_own_exit_names_the_accepted_forget_and_loses_nothing(
    tmp_path: Path, endpoints: Endpoints, session_settings: Settings, store: MemoryStore
) -> None:
    """`store` makes the session's master key, which every process sharing the database holds."""
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    out.mkdir()
    key = tmp_path / "master.key"
    shutil.copy2(session_settings.master_key_path, key)
    env = {
        **os.environ,
        "MEMORY_PIPELINES_HOME": str(home),
        "MEMORY_PIPELINES_PG_URL": endpoints.store_conninfo,
        "MEMORY_PIPELINES_CHROMA_URL": endpoints.chroma_url,
        "MEMORY_PIPELINES_KEY_VAULT": str(session_settings.key_vault_path),
        "H": str(home),
        "OUT": str(out),
        "CLI": str(CLI),
        "KEY": str(key),
        "T": "t-" + uuid.uuid4().hex[:12],
    }
    subprocess.run(["unshare", "-m", "bash", "-c", SCRIPT], env=env, check=True, timeout=900)
    said = dict(line.split("=", 1) for line in (out / "rc").read_text().split())
    assert said["materialize"] == "0", (out / "materialize.err").read_text()[-2000:]
    assert int(said["free"]) == 0, "the control: the disk under HOME is full"
    forget_err = (out / "forget.err").read_text()
    assert said["forget"] == "9", forget_err[-3000:]  # resources exhausted: its own exit code
    assert "No space left on device" in forget_err and "deletion job del_" in forget_err
    assert "was accepted and its scope is hidden" in forget_err
    assert (said["list"], json.loads((out / "bob.json").read_text())) == ("0", [])  # hidden all along
    assert said["retry"] == "0", (out / "retry.err").read_text()[-3000:]
    assert json.loads((out / "retry.out").read_text())["state"] == "COMPLETE"
    assert [m["text"] for m in json.loads((out / "alice.json").read_text())] == ["alice keeps bees"]
