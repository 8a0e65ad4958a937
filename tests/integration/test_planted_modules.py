"""No child of ours imports from the caller's working directory (issue 34, finding 1).

On e54b03f the analytics sandbox ran `python -m <module>` in the caller's working directory, so a
`duckdb.py` another local user left in a directory everyone can write (as /tmp is) ran as the HOME's
owner on an ordinary `analytics` query; a code server Dagster starts for `--verbose` ran
`python -m dagster` there too. Here `nobody` plants a module of each name the children import in
such a directory, and the owner runs the CLI and the Python API from it.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CLI

pytestmark = pytest.mark.slow

# What the children import first or at all: the sandbox (duckdb, pyarrow, json), code servers and
# run workers (dagster, grpc, psycopg, chromadb, numpy), and any `python -m` of ours.
PLANTED = ("duckdb", "pyarrow", "json", "dagster", "grpc", "psycopg", "chromadb", "numpy", "memory_pipelines")
PLANT = 'import os, sys\nopen(os.path.join({where!r}, "ran-{name}-%d" % os.getpid()), "w").write(repr(sys.argv))\n'


def _plant(where: Path) -> None:
    """A world-writable sticky directory holding `nobody`'s module of each name."""
    where.mkdir(mode=0o777)
    os.chmod(where, 0o1777)
    nobody = pwd.getpwnam("nobody")
    for name in PLANTED:
        module = where / f"{name}.py"
        module.write_text(PLANT.format(where=str(where), name=name))
        os.chown(module, nobody.pw_uid, nobody.pw_gid)


def test_no_child_runs_a_module_planted_in_the_callers_working_directory(
    cli_env: dict[str, Any], tmp_path: Path
) -> None:
    planted = tmp_path / "shared"
    _plant(planted)
    tenant = "t-" + uuid.uuid4().hex[:12]
    env = {**os.environ, **cli_env["env"], "MEMORY_PIPELINES_HOME": str(cli_env["home"])}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(CLI), *args], cwd=planted, env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == 0, f"{args}: {done.stderr[-3000:]}"
        return done

    cli("write", "--tenant", tenant, "--user", "alice", "alice keeps bees")
    cli("materialize", "--tenant", tenant)  # the HOME's warm code server and its run worker
    cli("--verbose", "materialize", "--tenant", tenant)  # a code server Dagster starts from here
    answer = json.loads(cli("analytics", "--tenant", tenant, "--sql", "SELECT count(*) AS n FROM memories").stdout)
    assert answer["rows"] == [[1]]
    # The Python API in a process of the owner whose working directory is the planted one.
    api = textwrap.dedent(
        f"""
        import json, os
        from memory_pipelines import MemoryPlatform
        mp = MemoryPlatform.from_env()
        os.chdir({str(planted)!r})
        print(json.dumps(mp.analytics(tenant_id={tenant!r}, sql="SELECT count(*) AS n FROM memories")["rows"]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-I", "-c", api], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[1]]
    assert sorted(p.name for p in planted.glob("ran-*")) == [], "a planted module ran as the HOME's owner"
