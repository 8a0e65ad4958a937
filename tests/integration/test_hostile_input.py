"""Hostile input, table-driven, over every CLI command and the Python API.

Each case asserts the specific exit code (2 bad input, 3 not found, 4 permission denied, 5 conflict),
the field named in the stderr error line, nothing on stdout, no traceback, and that a fingerprint of
the memory, keystore, derived and control schemas and of every file under HOME is unchanged.

Most CLI cases run in-process (`cli.main(argv)`, output captured); a few run through the installed
entry point in a subprocess, where argv and stdin can carry bytes that are not UTF-8.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from memory_pipelines import cli
from memory_pipelines.lib.agent_runs.runs import AgentRuns
from memory_pipelines.lib.backups.service import BackupService
from memory_pipelines.lib.evaluation import evaluator as evaluation
from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.infra.errors import MemoryPipelinesError
from memory_pipelines.lib.infra.services import Endpoints
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.retention import rules as retention
from memory_pipelines.lib.runtime import open_backups, open_store
from memory_pipelines.lib.stores.derived import DerivedStores, open_derived
from memory_pipelines.platform import MemoryPlatform
from tests.conftest import CLI

A, B = "hx-a", "hx-b"  # the two tenants, in a database of their own
SCHEMAS = ("memory", "keystore", "derived", "control")
INJECTION = "x'; DROP TABLE memory.memories; --"
UNION = "' UNION SELECT key FROM keystore.subject_keys --"
BIG = "x" * (64 * 1024 + 1)  # one byte over the text limit
BAD_UTF8 = b"caf\xe9"  # Latin-1 bytes: not UTF-8
AS_ARGV = os.fsdecode(BAD_UTF8)  # what Python makes of them in argv: "caf\udce9"
UNKNOWN_MEMORY = "m_" + "0" * 32


# -- the world: two tenants, a few users, a team, memories, derived stores, leases, a backup -----


@dataclass
class World:
    home: Path
    env: dict[str, str]
    conninfo: str
    store: MemoryStore
    derived: DerivedStores
    runs: AgentRuns
    deletions: DeletionService
    backups: BackupService
    ids: dict[str, str] = field(default_factory=dict)


@pytest.fixture(scope="module")
def world(endpoints: Endpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A HOME of its own and a database of its own on the session server: fingerprints stay small
    and no other test's rows can move them."""
    dbname = "hostile_" + uuid.uuid4().hex[:10]
    admin = make_conninfo(endpoints.store_conninfo, dbname="postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    conninfo = make_conninfo(endpoints.store_conninfo, dbname=dbname)
    home = tmp_path_factory.mktemp("hostile-home")
    env = {
        "MEMORY_PIPELINES_HOME": str(home),
        "MEMORY_PIPELINES_PG_URL": conninfo,
        # No refused command may start a run; should one, it lands in the session's Dagster storage.
        "MEMORY_PIPELINES_DAGSTER_PG_URL": endpoints.dagster_url,
    }
    settings = Settings.from_env(env)
    store = open_store(settings)
    derived = open_derived(settings, store)
    w = World(
        home=home,
        env=env,
        conninfo=conninfo,
        store=store,
        derived=derived,
        runs=AgentRuns(derived),
        deletions=DeletionService(derived),
        backups=open_backups(settings, store),
    )
    _seed(w)
    yield w
    store.close()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(dbname)))


def _seed(w: World) -> None:
    s, ids = w.store, w.ids
    s.create_tenant(tenant_id=A)
    s.add_team_member(tenant_id=A, team_id="core", user_id="alice")
    first = s.write(tenant_id=A, user_id="alice", text="Prefers Python", category="general")
    s.write(tenant_id=A, user_id="alice", text="Prefers Rust", memory_id=first.memory_id)
    ids["alice"] = first.memory_id  # two versions: a rollback is possible
    ids["alice_team"] = s.write(tenant_id=A, user_id="alice", text="Core deploys on Tuesdays", team_id="core").memory_id
    ids["bob"] = s.write(tenant_id=A, user_id="bob", text="Bob waters the ficus", category="medical").memory_id
    ids["carol"] = s.write(tenant_id=B, user_id="carol", text="Carol takes the 7:40 train").memory_id
    ids["dave"] = s.write(tenant_id=B, user_id="dave", text="Dave's locker is number 12").memory_id
    for tenant in (A, B):
        w.derived.sync_all(tenant_id=tenant)
    ids["lease_a"] = w.runs.open(tenant_id=A, subject_id="alice", run_id="run-a", ttl_seconds=3600)
    w.runs.recall(lease_id=ids["lease_a"], query="which language", mode="keyword")
    ids["lease_b"] = w.runs.open(tenant_id=B, subject_id="carol", run_id="run-b", ttl_seconds=3600)
    ids["lease_closed"] = w.runs.open(tenant_id=A, subject_id="bob", run_id="run-closed", ttl_seconds=3600)
    w.runs.gate.revoke(lease_id=ids["lease_closed"])
    ids["backup_b"] = str(w.backups.backup(tenant_id=B)["backup_id"])
    # A job that is accepted but never run: its proof does not exist yet.
    ids["job_b"] = w.deletions.request(tenant_id=B, memory_id=ids["dave"])["job_id"]


# -- fingerprints ---------------------------------------------------------------------------------


def db_fingerprint(conninfo: str) -> dict[str, str]:
    """table -> sha256 over the md5 of every row, in order."""
    out = {}
    with psycopg.connect(conninfo, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT table_schema, table_name FROM information_schema.tables"
            " WHERE table_schema = ANY(%s) AND table_type = 'BASE TABLE' ORDER BY 1, 2",
            (list(SCHEMAS),),
        ).fetchall()
        for schema, name in tables:
            digest = hashlib.sha256()
            query = sql.SQL("SELECT md5(t::text) FROM {}.{} t ORDER BY 1").format(
                sql.Identifier(schema), sql.Identifier(name)
            )
            for (row_md5,) in conn.execute(query):
                digest.update(row_md5.encode())
            out[f"{schema}.{name}"] = digest.hexdigest()
    return out


def _volatile(relative: Path) -> bool:
    """Files that change without any data changing, left out of the fingerprint:

    - `pg/`: PostgreSQL's own data directory (heap pages, WAL, stats); the database is fingerprinted
      by its rows instead (this HOME uses the session server, so it has none anyway);
    - `dagster/` except `dagster.yaml`: Dagster's local storage (run and event logs, schedules,
      telemetry), which bookkeeping may touch; `dagster.yaml` itself is rewritten by every command
      but must keep the same bytes, so it stays in;
    - `*.log`: logs grow with every command.
    Everything else (the master key, Chroma's files, Parquet partitions, the DuckDB views file,
    backups and their manifests, lock files) must be byte-identical after a refused request.
    """
    parts = relative.parts
    if parts[0] == "pg" or relative.suffix == ".log":
        return True
    return parts[0] == "dagster" and relative != Path("dagster", "dagster.yaml")


def file_fingerprint(home: Path) -> dict[str, tuple[int, str]]:
    out = {}
    for path in sorted(home.rglob("*")):
        relative = path.relative_to(home)
        if path.is_file() and not _volatile(relative):
            data = path.read_bytes()
            out[str(relative)] = (len(data), hashlib.sha256(data).hexdigest())
    return out


def fingerprint(w: World) -> tuple[dict[str, str], dict[str, tuple[int, str]]]:
    return db_fingerprint(w.conninfo), file_fingerprint(w.home)


def changes(before: Any, after: Any) -> list[str]:
    (db0, files0), (db1, files1) = before, after
    changed = [t for t in sorted(set(db0) | set(db1)) if db0.get(t) != db1.get(t)]
    changed += [f"file {p}" for p in sorted(set(files0) | set(files1)) if files0.get(p) != files1.get(p)]
    return changed


# -- cases ----------------------------------------------------------------------------------------


def today() -> date:
    """Read when a case runs, not when the list is built: the suite may cross midnight UTC."""
    return datetime.now(UTC).date()


def day_arg(offset: int) -> Callable[[], str]:
    return lambda: (today() + timedelta(days=offset)).isoformat()


Arg = str | bytes | Callable[[], str]


def argv_of(case: Case) -> list[str | bytes]:
    return [a() if callable(a) else a for a in case.argv]


@dataclass(frozen=True)
class Case:
    name: str
    code: int
    field: str
    argv: tuple[Arg, ...] = ()
    stdin: bytes = b""
    api: Callable[[], object] | None = None
    subprocess: bool = False
    # A known bug in a file another change owns: the case documents the contract; its failure is
    # reported, not raised, until that file is fixed (then the mark goes).
    owner_bug: str = ""


def cli_cases(w: World) -> list[Case]:
    ids = w.ids
    key = w.home / "keys" / "master.key"
    pg_files = w.home / "pg" / "data" / "base"
    pwned = w.home / "pwned.txt"
    m_a, m_team, m_bob, m_carol = ids["alice"], ids["alice_team"], ids["bob"], ids["carol"]

    def c(name: str, code: int, fld: str, *argv: Arg, stdin: bytes = b"", **kw: Any) -> Case:
        return Case(name, code, fld, argv=argv, stdin=stdin, **kw)

    write = ("write", "--tenant", A, "--user", "alice")
    recall = ("recall", "--tenant", A, "--user", "alice")
    sql_a = ("analytics", "--tenant", A, "--sql")
    return [
        # write
        c("write tenant injection", 2, "tenant", "write", "--tenant", INJECTION, "--user", "alice", "x"),
        c("write user injection", 2, "user", "write", "--tenant", A, "--user", INJECTION, "x"),
        c("write user union", 2, "user", "write", "--tenant", A, "--user", UNION, "x"),
        c("write team injection", 2, "team", *write, "--team", INJECTION, "x"),
        c("write category injection", 2, "category", *write, "--category", INJECTION, "x"),
        c("write memory-id injection", 2, "memory_id", *write, "--memory-id", INJECTION, "x"),
        c("write tenant unicode", 2, "tenant", "write", "--tenant", "ünï", "--user", "alice", "x"),
        c("write tenant rtl override", 2, "tenant", "write", "--tenant", "a\u202eb", "--user", "alice", "x"),
        c("write tenant empty", 2, "tenant", "write", "--tenant", "", "--user", "alice", "x"),
        c("write user 65 chars", 2, "user", "write", "--tenant", A, "--user", "u" * 65, "x"),
        c("write user sql comment", 2, "user", "write", "--tenant", A, "--user", "a--b", "x"),
        c("write user path", 2, "user", "write", "--tenant", A, "--user", "../etc", "x"),
        c("write text blank", 2, "text", *write, " \t "),
        c("write text oversize argv", 2, "text", *write, BIG),
        c("write text oversize 2-byte chars", 2, "text", *write, "é" * (32 * 1024 + 1)),
        c("write text NUL in argv", 2, "text", *write, "a\x00b"),
        c("write text not UTF-8 in argv", 2, "text", *write, AS_ARGV),
        c("write text lone surrogate", 2, "text", *write, "\ud800"),
        c("write stdin oversize", 2, "text", *write, "-", stdin=BIG.encode()),
        c("write stdin NUL", 2, "text", *write, "-", stdin=b"a\x00b"),
        c("write stdin not UTF-8", 2, "text", *write, "-", stdin=BAD_UTF8),
        c("write stdin UTF-16", 2, "text", *write, "-", stdin="hi".encode("utf-16")),
        c("write stdin empty", 2, "text", *write, "-", stdin=b""),
        c("write confidence negative", 2, "confidence", *write, "--confidence", "-1", "x"),
        c("write confidence huge", 2, "confidence", *write, "--confidence", "1e309", "x"),
        c("write confidence nan", 2, "confidence", *write, "--confidence", "nan", "x"),
        c("write confidence words", 2, "confidence", *write, "--confidence", "high", "x"),
        c("write original-query NUL", 2, "original_query", *write, "--original-query", "a\x00", "x"),
        c("write original-query not UTF-8", 2, "original_query", *write, "--original-query", AS_ARGV, "x"),
        c("write original-query oversize", 2, "original_query", *write, "--original-query", BIG, "x"),
        c("write other tenant's memory", 3, "memory_id", *write, "--memory-id", m_carol, "x"),
        c("write another user's memory", 4, "memory_id", *write, "--memory-id", m_bob, "x"),
        c("write unknown memory", 3, "memory_id", *write, "--memory-id", UNKNOWN_MEMORY, "x"),
        c("write team non-member", 4, "team", "write", "--tenant", A, "--user", "bob", "--team", "core", "x"),
        c("write unknown team", 3, "team", *write, "--team", "nope", "x"),
        c("write missing user", 2, "user", "write", "--tenant", A, "x"),
        # history, rollback
        c("history memory-id injection", 2, "memory_id", "history", "--tenant", A, "--memory-id", INJECTION),
        c("history other tenant's memory", 3, "memory_id", "history", "--tenant", A, "--memory-id", m_carol),
        c("history unknown tenant", 3, "tenant", "history", "--tenant", "ghost", "--memory-id", m_a),
        c("history tenant not UTF-8", 2, "tenant", "history", "--tenant", AS_ARGV, "--memory-id", m_a),
        c("rollback by another user", 4, "user", "rollback", "--tenant", A, "--user", "bob", "--memory-id", m_a),
        c("rollback one version", 5, "memory_id", "rollback", "--tenant", A, "--user", "alice", "--memory-id", m_team),
        c(
            "rollback other tenant",
            3,
            "memory_id",
            "rollback",
            "--tenant",
            A,
            "--user",
            "alice",
            "--memory-id",
            m_carol,
        ),
        c("rollback without user", 2, "user", "rollback", "--tenant", A, "--memory-id", m_a),
        c("rollback user injection", 2, "user", "rollback", "--tenant", A, "--user", INJECTION, "--memory-id", m_a),
        # list, export, team, tenant
        c("list unknown tenant", 3, "tenant", "list", "--tenant", "ghost", "--user", "alice"),
        c("list team of non-member", 4, "team", "list", "--tenant", A, "--user", "bob", "--team", "core"),
        c("list user unicode", 2, "user", "list", "--tenant", A, "--user", "ålice"),
        c("export subject injection", 2, "subject", "export", "--tenant", A, "--subject", INJECTION),
        c("export unknown tenant", 3, "tenant", "export", "--tenant", "ghost", "--subject", "alice"),
        c("export subject not UTF-8", 2, "subject", "export", "--tenant", A, "--subject", AS_ARGV),
        c("team add injection", 2, "team", "team", "add-member", "--tenant", A, "--team", INJECTION, "--user", "bob"),
        c("team add user injection", 2, "user", "team", "add-member", "--tenant", A, "--team", "core", "--user", UNION),
        c(
            "team remove non-member",
            3,
            "user",
            "team",
            "remove-member",
            "--tenant",
            A,
            "--team",
            "core",
            "--user",
            "bob",
        ),
        c("tenant create injection", 2, "tenant", "tenant", "create", "--tenant", INJECTION),
        c("tenant set-test injection", 2, "tenant", "tenant", "set-test", "--tenant", INJECTION),
        c(
            "tenant create bad mode",
            2,
            "sharing_mode",
            "tenant",
            "create",
            "--tenant",
            "hx-new",
            "--sharing-mode",
            "open",
        ),
        c("tenant set-mode injection", 2, "sharing_mode", "tenant", "set-mode", "--tenant", A, "--sharing-mode", UNION),
        c(
            "tenant set-mode unknown",
            3,
            "tenant",
            "tenant",
            "set-mode",
            "--tenant",
            "ghost",
            "--sharing-mode",
            "strict",
        ),
        # do-not-sell
        c("dns other tenant", 3, "memory_id", "do-not-sell", "--tenant", A, "--user", "alice", "--memory-id", m_carol),
        c("dns for someone else", 4, "subject", "do-not-sell", "--tenant", A, "--user", "alice", "--subject", "bob"),
        c("dns another's memory", 4, "user", "do-not-sell", "--tenant", A, "--user", "alice", "--memory-id", m_bob),
        c("dns without user", 2, "user", "do-not-sell", "--tenant", A, "--subject", "alice"),
        c(
            "dns both targets",
            2,
            "subject",
            "do-not-sell",
            "--tenant",
            A,
            "--user",
            "a",
            "--memory-id",
            m_a,
            "--subject",
            "a",
        ),
        c(
            "dns subject injection",
            2,
            "subject",
            "do-not-sell",
            "--tenant",
            A,
            "--user",
            "alice",
            "--subject",
            INJECTION,
        ),
        # recall
        c("recall k zero", 2, "k", *recall, "--k", "0", "q"),
        c("recall k negative", 2, "k", *recall, "--k", "-5", "q"),
        c("recall k huge", 2, "k", *recall, "--k", str(10**12), "q"),
        c("recall k words", 2, "k", *recall, "--k", "all", "q"),
        c("recall mode", 2, "mode", *recall, "--mode", "x", "q"),
        c("recall mode injection", 2, "mode", *recall, "--mode", INJECTION, "q"),
        c("recall query blank", 2, "query", *recall, "   "),
        c("recall query NUL", 2, "query", *recall, "a\x00"),
        c("recall query not UTF-8", 2, "query", *recall, AS_ARGV),
        c("recall query oversize", 2, "query", *recall, BIG),
        c("recall unknown tenant", 3, "tenant", "recall", "--tenant", "ghost", "--user", "alice", "q"),
        c("recall team injection", 2, "team", *recall, "--team", INJECTION, "q"),
        c("recall team non-member", 4, "team", "recall", "--tenant", A, "--user", "bob", "--team", "core", "q"),
        # lineage
        c("lineage record unknown store", 2, "record", "lineage", "--tenant", A, "--record", "nowhere:1"),
        c("lineage record injection", 2, "record", "lineage", "--tenant", A, "--record", INJECTION),
        c("lineage other tenant's memory", 3, "memory_id", "lineage", "--tenant", A, "--memory-id", m_carol),
        c("lineage memory-id injection", 2, "memory_id", "lineage", "--tenant", A, "--memory-id", UNION),
        # analytics: DuckDB escapes and other tenants' rows
        c(
            "analytics EXPLAIN ANALYZE COPY",
            2,
            "sql",
            *sql_a,
            f"EXPLAIN ANALYZE COPY (SELECT 'x') TO '{pwned}' (HEADER false)",
        ),
        c("analytics COPY", 2, "sql", *sql_a, f"COPY (SELECT 'x') TO '{pwned}'"),
        c("analytics COPY via query()", 2, "sql", *sql_a, f"SELECT * FROM query('COPY (SELECT 1) TO ''{pwned}''')"),
        c("analytics EXPLAIN", 2, "sql", *sql_a, "EXPLAIN SELECT * FROM memories"),
        c("analytics ATTACH", 2, "sql", *sql_a, f"ATTACH '{w.home / 'analytics' / 'analytics.duckdb'}' AS v"),
        c("analytics read_text", 2, "sql", *sql_a, "SELECT * FROM read_text('/etc/hostname')"),
        c("analytics read_blob master key", 2, "sql", *sql_a, f"SELECT * FROM read_blob('{key}')"),
        c("analytics read_csv environ", 2, "sql", *sql_a, "SELECT * FROM read_csv('/proc/self/environ')"),
        c("analytics getenv", 2, "sql", *sql_a, "SELECT getenv('MEMORY_PIPELINES_PG_URL')"),
        c("analytics glob", 2, "sql", *sql_a, "SELECT * FROM glob('/*')"),
        c("analytics SET", 2, "sql", *sql_a, "SET enable_external_access = true"),
        c("analytics RESET lock", 2, "sql", *sql_a, "RESET lock_configuration"),
        c("analytics PRAGMA", 2, "sql", *sql_a, "PRAGMA database_list"),
        c("analytics CALL", 2, "sql", *sql_a, "CALL pragma_version()"),
        c("analytics INSTALL", 2, "sql", *sql_a, "INSTALL httpfs"),
        c("analytics LOAD", 2, "sql", *sql_a, "LOAD httpfs"),
        c("analytics EXPORT", 2, "sql", *sql_a, f"EXPORT DATABASE '{w.home / 'export'}'"),
        c("analytics DELETE", 2, "sql", *sql_a, "DELETE FROM memories"),
        c("analytics CREATE", 2, "sql", *sql_a, "CREATE TABLE t AS SELECT * FROM memories"),
        c("analytics two statements", 2, "sql", *sql_a, "SELECT 1; SELECT 2"),
        c("analytics comment hides a DROP", 2, "sql", *sql_a, "SELECT 1 /* ; */; DROP VIEW memories --"),
        c("analytics line comment hides a COPY", 2, "sql", *sql_a, f"SELECT 1 --\n; COPY (SELECT 1) TO '{pwned}'"),
        c(
            "analytics every tenant's rows",
            2,
            "sql",
            *sql_a,
            "SELECT * FROM postgres_scan('', 'derived', 'analytics_rows')",
        ),
        c("analytics PostgreSQL's files", 2, "sql", *sql_a, f"SELECT * FROM read_blob('{pg_files}/*/*')"),
        c("analytics unknown tenant", 3, "tenant", "analytics", "--tenant", "ghost", "--sql", "SELECT 1"),
        c("analytics tenant injection", 2, "tenant", "analytics", "--tenant", f"{B}' OR '1'='1", "--sql", "SELECT 1"),
        c("analytics without tenant", 2, "tenant", "analytics", "--sql", "SELECT * FROM memories"),
        c("analytics empty", 2, "sql", *sql_a, ""),
        c("analytics NUL", 2, "sql", *sql_a, "SELECT '\x00'"),
        c("analytics not UTF-8", 2, "sql", *sql_a, f"SELECT '{AS_ARGV}'"),
        c("analytics oversize", 2, "sql", *sql_a, "SELECT '" + BIG + "'"),
        c("analytics unparsable", 2, "sql", *sql_a, "SELEC 1"),
        # materialize, summaries
        c("materialize unknown asset", 2, "select", "materialize", "--tenant", A, "--select", "memories,nonsense"),
        c("materialize select injection", 2, "select", "materialize", "--tenant", A, "--select", INJECTION),
        c("materialize unknown tenant", 3, "tenant", "materialize", "--tenant", "ghost"),
        c("summary-mode bad mode", 2, "mode", "summary-mode", "--tenant", A, "--subject", "alice", "--mode", "poetry"),
        c(
            "summary-mode unknown tenant",
            3,
            "tenant",
            "summary-mode",
            "--tenant",
            "ghost",
            "--subject",
            "a",
            "--mode",
            "full",
        ),
        c(
            "summary-mode subject injection",
            2,
            "subject",
            "summary-mode",
            "--tenant",
            A,
            "--subject",
            UNION,
            "--mode",
            "full",
        ),
        c("summary unknown team", 3, "team", "summary", "--tenant", A, "--team", "nope"),
        c("summary other tenant's subject", 3, "subject", "summary", "--tenant", A, "--subject", "carol"),
        c(
            "summary subject injection",
            2,
            "subject",
            "summary",
            "--tenant",
            A,
            "--subject",
            INJECTION,
        ),
        # forget, deletion
        c("forget basis injection", 2, "basis", "forget", "--tenant", A, "--memory-id", m_a, "--basis", INJECTION),
        c("forget version zero", 2, "version", "forget", "--tenant", A, "--memory-id", m_a, "--version", "0"),
        c("forget version negative", 2, "version", "forget", "--tenant", A, "--memory-id", m_a, "--version", "-1"),
        c(
            "forget version int32 overflow",
            2,
            "version",
            "forget",
            "--tenant",
            A,
            "--memory-id",
            m_a,
            "--version",
            str(2**31),
        ),
        c("forget version huge", 2, "version", "forget", "--tenant", A, "--memory-id", m_a, "--version", str(10**30)),
        c("forget version words", 2, "version", "forget", "--tenant", A, "--memory-id", m_a, "--version", "last"),
        c("forget version not there", 3, "version", "forget", "--tenant", A, "--memory-id", m_a, "--version", "99"),
        c("forget version with subject", 2, "version", "forget", "--tenant", A, "--subject", "alice", "--version", "1"),
        c("forget unknown subject", 3, "subject", "forget", "--tenant", A, "--subject", "zed"),
        c("forget other tenant's subject", 3, "subject", "forget", "--tenant", A, "--subject", "carol"),
        c("forget other tenant's memory", 3, "memory_id", "forget", "--tenant", A, "--memory-id", m_carol),
        c("forget all without confirm", 2, "confirm", "forget", "--tenant", A, "--all"),
        c("forget all wrong confirm", 2, "confirm", "forget", "--tenant", A, "--all", "--confirm", B),
        c("forget unknown tenant", 3, "tenant", "forget", "--tenant", "ghost", "--subject", "alice"),
        c("deletion status unknown", 3, "job_id", "deletion", "status", "del_" + "0" * 32),
        c("deletion status injection", 2, "job_id", "deletion", "status", INJECTION),
        c("deletion proof not complete", 3, "job_id", "deletion", "proof", ids["job_b"]),
        c("deletion retry unknown", 3, "job_id", "deletion", "retry", "del_nope"),
        c("deletion list bad state", 2, "state", "deletion", "list", "--state", "DONE'--"),
        c(
            "deletion list tenant injection",
            2,
            "tenant",
            "deletion",
            "list",
            "--tenant",
            INJECTION,
        ),
        # backup, restore, keys
        c("backup without tenant", 2, "tenant", "backup"),
        c("backup unknown tenant", 3, "tenant", "backup", "--tenant", "ghost"),
        c("backup list injection", 2, "tenant", "backup", "list", "--tenant", INJECTION),
        c("backup bad action", 2, "backup_command", "backup", "delete", "--tenant", A),
        c("restore unknown backup", 3, "backup", "restore", "--tenant", A, "--backup", "b_nope"),
        c("restore path traversal", 2, "backup", "restore", "--tenant", A, "--backup", "../../etc/passwd"),
        c("restore other tenant's backup", 2, "backup", "restore", "--tenant", A, "--backup", ids["backup_b"]),
        c(
            "restore --wait other tenant's backup",
            2,
            "backup",
            "restore",
            "--tenant",
            A,
            "--backup",
            ids["backup_b"],
            "--wait",
        ),
        c("restore without backup", 2, "backup", "restore", "--tenant", A),
        c(
            "restore reopen unknown tenant",
            3,
            "tenant",
            "restore",
            "--tenant",
            "ghost",
            "--reopen",
        ),
        c("keys shred without confirm", 2, "confirm", "keys", "shred", "--tenant", A),
        c("keys shred wrong confirm", 2, "confirm", "keys", "shred", "--tenant", A, "--confirm", B),
        c("keys shred unknown subject", 3, "subject", "keys", "shred", "--tenant", A, "--subject", "zed"),
        c("keys shred subject injection", 2, "subject", "keys", "shred", "--tenant", A, "--subject", INJECTION),
        # retention
        c("retention sweep far future", 2, "date", "retention", "sweep", "--date", "2099-01-01"),
        c("retention sweep today", 2, "date", "retention", "sweep", "--date", day_arg(0)),
        c(
            "retention sweep tomorrow",
            2,
            "date",
            "retention",
            "sweep",
            "--date",
            day_arg(1),
        ),
        c("retention sweep future --wait", 2, "date", "retention", "sweep", "--date", "2099-01-01", "--wait"),
        c("retention sweep before first day", 2, "date", "retention", "sweep", "--date", "2023-12-31", "--wait"),
        c("retention sweep words", 2, "date", "retention", "sweep", "--date", "tomorrow"),
        c("retention sweep injection", 2, "date", "retention", "sweep", "--date", INJECTION),
        c("retention preview bad month", 2, "date", "retention", "preview", "--date", "2026-13-01"),
        c("retention preview year 99999", 2, "date", "retention", "preview", "--date", "99999-01-01"),
        # issue 21: day 1 minus a policy's years was an OverflowError (exit 1)
        c("retention preview year 1", 2, "date", "retention", "preview", "--date", "0001-01-01"),
        c("retention sweep year 1", 2, "date", "retention", "sweep", "--date", "0001-01-01"),
        c("retention sweep year 1 --wait", 2, "date", "retention", "sweep", "--date", "0001-01-01", "--wait"),
        c("retention preview year 9999", 2, "date", "retention", "preview", "--date", "9999-12-31"),
        # agent runs
        c(
            "run open ttl zero",
            2,
            "ttl_seconds",
            "run",
            "open",
            "--tenant",
            A,
            "--user",
            "alice",
            "--run",
            "r",
            "--ttl",
            "0",
        ),
        c(
            "run open ttl negative",
            2,
            "ttl_seconds",
            "run",
            "open",
            "--tenant",
            A,
            "--user",
            "alice",
            "--run",
            "r",
            "--ttl",
            "-1",
        ),
        c(
            "run open ttl huge",
            2,
            "ttl_seconds",
            "run",
            "open",
            "--tenant",
            A,
            "--user",
            "alice",
            "--run",
            "r",
            "--ttl",
            "9" * 20,
        ),
        c(
            "run open ttl words",
            2,
            "ttl",
            "run",
            "open",
            "--tenant",
            A,
            "--user",
            "alice",
            "--run",
            "r",
            "--ttl",
            "forever",
        ),
        c("run open unknown tenant", 3, "tenant", "run", "open", "--tenant", "ghost", "--user", "alice", "--run", "r"),
        c("run open run injection", 2, "run", "run", "open", "--tenant", A, "--user", "alice", "--run", INJECTION),
        c("run recall unknown lease", 3, "lease", "run", "recall", "--lease", "lease_nope", "q"),
        c("run recall lease injection", 2, "lease", "run", "recall", "--lease", INJECTION, "q"),
        c("run recall k zero", 2, "k", "run", "recall", "--lease", ids["lease_a"], "--k", "0", "q"),
        c(
            "run recall other tenant's team",
            3,
            "team",
            "run",
            "recall",
            "--lease",
            ids["lease_b"],
            "--team",
            "core",
            "q",
        ),
        c(
            "run permit closed lease",
            5,
            "lease",
            "run",
            "permit",
            "--lease",
            ids["lease_closed"],
            "--sink",
            "model_output",
        ),
        c("run permit bad sink", 2, "sink", "run", "permit", "--lease", ids["lease_a"], "--sink", "stdout"),
        c("run permit unknown lease", 3, "lease", "run", "permit", "--lease", "lease_nope", "--sink", "model_output"),
        c("run revoke unknown lease", 3, "lease", "run", "revoke", "--lease", "lease_nope"),
        c("run snapshot unknown lease", 3, "lease", "run", "snapshot", "--lease", "lease_nope", "prompt"),
        c("run snapshot closed lease", 5, "lease", "run", "snapshot", "--lease", ids["lease_closed"], "prompt"),
        c("run snapshot stdin NUL", 2, "prompt", "run", "snapshot", "--lease", ids["lease_a"], "-", stdin=b"a\x00b"),
        c(
            "run snapshot stdin oversize",
            2,
            "prompt",
            "run",
            "snapshot",
            "--lease",
            ids["lease_a"],
            "-",
            stdin=BIG.encode(),
        ),
        c("run snapshot prompt not UTF-8", 2, "prompt", "run", "snapshot", "--lease", ids["lease_a"], AS_ARGV),
        c("explain unknown run", 3, "run", "explain", "--tenant", A, "--run", "nope"),
        c("explain other tenant's run", 3, "run", "explain", "--tenant", A, "--run", "run-b"),
        c("explain run injection", 2, "run", "explain", "--tenant", A, "--run", INJECTION),
        # evaluation, dev, the parser
        c("eval run bad month", 2, "month", "eval", "run", "--month", "2026-13"),
        c("eval run future month", 2, "month", "eval", "run", "--month", "2099-01"),
        c("eval run month injection", 2, "month", "eval", "run", "--month", INJECTION),
        c("eval report bad mode", 2, "mode", "eval", "report", "--mode", "x"),
        c("eval report mode injection", 2, "mode", "eval", "report", "--mode", INJECTION),
        c("dev port zero", 2, "port", "dev", "--port", "0"),
        c("dev port too big", 2, "port", "dev", "--port", "70000"),
        c("unknown command", 2, "command", "drop-everything"),
        c("unknown option", 2, "arguments", "tenants", "--all-of-them"),
        c("home not UTF-8", 2, "home", "--home", AS_ARGV, "tenants"),
        # through the installed entry point: bytes as a shell passes them
        c("sub: write text bytes", 2, "text", *write, BAD_UTF8, subprocess=True),
        c(
            "sub: write tenant bytes",
            2,
            "tenant",
            "write",
            "--tenant",
            b"\xff",
            "--user",
            "alice",
            "x",
            subprocess=True,
        ),
        c("sub: original-query bytes", 2, "original_query", *write, "--original-query", b"\xc3(", "x", subprocess=True),
        c("sub: recall query bytes", 2, "query", *recall, b"\xe2\x82", subprocess=True),
        c("sub: analytics sql bytes", 2, "sql", *sql_a, b"SELECT '\xff'", subprocess=True),
        c("sub: write stdin not UTF-8", 2, "text", *write, "-", stdin=BAD_UTF8, subprocess=True),
        c("sub: write stdin oversize", 2, "text", *write, "-", stdin=BIG.encode(), subprocess=True),
        c(
            "sub: snapshot stdin not UTF-8",
            2,
            "prompt",
            "run",
            "snapshot",
            "--lease",
            ids["lease_a"],
            "-",
            stdin=b"\xff\xfe",
            subprocess=True,
        ),
        c("sub: analytics COPY", 2, "sql", *sql_a, f"EXPLAIN ANALYZE COPY (SELECT 'x') TO '{pwned}'", subprocess=True),
        c("sub: retention future sweep", 2, "date", "retention", "sweep", "--date", "2099-01-01", subprocess=True),
        c("sub: eval report mode", 2, "mode", "eval", "report", "--mode", "x", subprocess=True),
    ]


def api_cases(w: World) -> list[Case]:
    s, ids, recaller = w.store, w.ids, w.derived.recaller
    m_a, m_bob, m_carol = ids["alice"], ids["bob"], ids["carol"]

    def c(name: str, code: int, fld: str, call: Callable[[], object], owner_bug: str = "") -> Case:
        return Case("api: " + name, code, fld, api=call, owner_bug=owner_bug)

    def q(sql_text: str, tenant: str = A) -> Callable[[], object]:
        return lambda: w.derived.analytics.query(sql_text, tenant_id=tenant)

    return [
        c("write text NUL", 2, "text", lambda: s.write(tenant_id=A, user_id="alice", text="a\x00b")),
        c("write text surrogate", 2, "text", lambda: s.write(tenant_id=A, user_id="alice", text="\udcff")),
        c("write text oversize", 2, "text", lambda: s.write(tenant_id=A, user_id="alice", text=BIG)),
        c("write text not a string", 2, "text", lambda: s.write(tenant_id=A, user_id="alice", text=b"bytes")),  # type: ignore[arg-type]
        c(
            "write original_query surrogate",
            2,
            "original_query",
            lambda: s.write(tenant_id=A, user_id="alice", text="ok", original_query="\ud800"),
        ),
        c("write tenant surrogate", 2, "tenant", lambda: s.write(tenant_id="a\udcff", user_id="alice", text="x")),
        c(
            "write confidence inf",
            2,
            "confidence",
            lambda: s.write(tenant_id=A, user_id="alice", text="x", confidence=float("inf")),
        ),
        c(
            "write_many one bad item",
            2,
            "items[1].text",
            lambda: s.write_many(
                tenant_id=A, items=[{"user_id": "alice", "text": "ok"}, {"user_id": "bob", "text": "\x00"}]
            ),
        ),
        c("history other tenant", 3, "memory_id", lambda: s.history(tenant_id=B, memory_id=m_a)),
        c("rollback another's memory", 4, "user", lambda: s.rollback(tenant_id=A, memory_id=m_a, user_id="bob")),
        c(
            "do-not-sell for someone else",
            4,
            "subject",
            lambda: s.set_do_not_sell(tenant_id=A, user_id="alice", subject="bob"),
        ),
        c(
            "do-not-sell another's memory",
            4,
            "user",
            lambda: s.set_do_not_sell(tenant_id=A, user_id="alice", memory_id=m_bob),
        ),
        c("list other tenant's team", 3, "team", lambda: s.list_visible(tenant_id=B, user_id="carol", team_id="core")),
        c("analytics COPY", 2, "sql", q(f"EXPLAIN ANALYZE COPY (SELECT 1) TO '{w.home / 'pwned.csv'}'")),
        c("analytics read_text", 2, "sql", q("SELECT * FROM read_text('/etc/passwd')")),
        c("analytics ATTACH", 2, "sql", q("ATTACH ':memory:' AS x")),
        c("analytics unknown tenant", 3, "tenant", q("SELECT 1", "ghost")),
        c("analytics tenant traversal", 2, "tenant", q("SELECT 1", "../" + B)),
        c("analytics sql not a string", 2, "sql", lambda: w.derived.analytics.query(None, tenant_id=A)),  # type: ignore[arg-type]
        c("retention sweep far future", 2, "date", lambda: retention.sweep(w.deletions, day="2099-01-01")),
        c("retention sweep today", 2, "date", lambda: retention.sweep(w.deletions, day=today())),
        c("retention sweep garbage", 2, "date", lambda: retention.sweep(w.deletions, day="soon")),
        c("eval trend bad mode", 2, "mode", lambda: evaluation.trend(s, tenant_id=A, mode="x")),
        c("recall k negative", 2, "k", lambda: recaller.recall(tenant_id=A, user_id="alice", query="q", k=-1)),
        c("recall k huge", 2, "k", lambda: recaller.recall(tenant_id=A, user_id="alice", query="q", k=10**9)),
        c("recall k bool", 2, "k", lambda: recaller.recall(tenant_id=A, user_id="alice", query="q", k=True)),
        c("recall query NUL", 2, "query", lambda: recaller.recall(tenant_id=A, user_id="alice", query="\x00")),
        c("recall query surrogate", 2, "query", lambda: recaller.recall(tenant_id=A, user_id="alice", query="\udce9")),
        c(
            "recall other tenant's team",
            3,
            "team",
            lambda: recaller.recall(tenant_id=B, user_id="carol", query="q", team_id="core"),
        ),
        c(
            "run open ttl negative",
            2,
            "ttl_seconds",
            lambda: w.runs.open(tenant_id=A, subject_id="alice", run_id="r", ttl_seconds=-1),
        ),
        c(
            "run open ttl huge",
            2,
            "ttl_seconds",
            lambda: w.runs.open(tenant_id=A, subject_id="alice", run_id="r", ttl_seconds=10**12),
        ),
        c(
            "run snapshot prompt NUL",
            2,
            "prompt",
            lambda: w.runs.snapshot_prompt(lease_id=ids["lease_a"], prompt="\x00"),
        ),
        c("run recall unknown lease", 3, "lease", lambda: w.runs.recall(lease_id="lease_nope", query="q")),
        c(
            "run permit closed lease",
            5,
            "lease",
            lambda: w.runs.gate.acquire(lease_id=ids["lease_closed"], sink="tool_dispatch"),
        ),
        c(
            "forget version int32 overflow",
            2,
            "version",
            lambda: w.deletions.request(tenant_id=A, memory_id=m_a, version=2**31),
        ),
        c("forget basis", 2, "basis", lambda: w.deletions.request(tenant_id=A, subject="alice", basis="because")),
        c("forget unknown subject", 3, "subject", lambda: w.deletions.request(tenant_id=A, subject="zed")),
        c("forget other tenant's memory", 3, "memory_id", lambda: w.deletions.request(tenant_id=A, memory_id=m_carol)),
        c("shred unknown subject", 3, "subject", lambda: w.deletions.shred_keys(tenant_id=A, subject="zed")),
        c(
            "deletion status NUL",
            2,
            "job_id",
            lambda: w.deletions.status(job_id="del_\x00"),
        ),
        c(
            "gate revoke NUL",
            2,
            "lease",
            lambda: w.runs.gate.revoke(lease_id="lease_\x00"),
        ),
        c(
            "restore other tenant's backup",
            2,
            "backup",
            lambda: w.backups.restore(tenant_id=A, backup_id=ids["backup_b"]),
        ),
        c("list backups bad tenant", 2, "tenant", lambda: w.backups.list_backups(tenant_id=INJECTION)),
        c("summary mode", 2, "mode", lambda: w.derived.summaries.set_mode(tenant_id=A, subject="alice", mode="x")),
        c("lineage record", 2, "record", lambda: w.derived.sources_of_record(tenant_id=A, record="x")),
        c(
            "lineage other tenant's memory",
            3,
            "memory_id",
            lambda: w.derived.lineage_of_memory(tenant_id=B, memory_id=m_a),
        ),
    ]


def platform_cases(w: World) -> list[Case]:
    """The Python API's column (issue 21): `MemoryPlatform` with wrong types, None, huge values and
    nested junk. Each is refused with the field named and nothing changed, as the CLI refuses."""
    mp = MemoryPlatform(settings=Settings.from_env(w.env), store=w.store, derived=w.derived, backups=w.backups)
    ids = w.ids
    m_a, m_carol = ids["alice"], ids["carol"]
    ok = {"user_id": "alice", "text": "fine"}

    def c(name: str, code: int, fld: str, call: Callable[[], object]) -> Case:
        return Case("py: " + name, code, fld, api=call)

    def write(**kw: Any) -> Callable[[], object]:
        return lambda: mp.write(**{"tenant_id": A, "user_id": "alice", "text": "x", **kw})

    def many(items: Any, tenant: Any = A) -> Callable[[], object]:
        return lambda: mp.write_many(tenant_id=tenant, items=items)

    def recall(**kw: Any) -> Callable[[], object]:
        return lambda: mp.recall(**{"tenant_id": A, "user_id": "alice", "query": "q", **kw})

    def forget(**kw: Any) -> Callable[[], object]:
        return lambda: mp.forget(**{"tenant_id": A, **kw})

    junk: tuple[Any, ...] = ("false", "no", "true", 0, 1, [], {"x": 1}, 0.0)
    categories: tuple[Any, ...] = ("Medical", 5, "x" * 40, [])
    cases = [
        # write: exact types, a bool is a bool
        *(c(f"write shareable {v!r}", 2, "shareable", write(shareable=v)) for v in junk),
        *(c(f"write do_not_sell {v!r}", 2, "do_not_sell", write(do_not_sell=v)) for v in ("yes", 1, [True], b"1")),
        c("write shareable banana on a new version", 2, "shareable", write(memory_id=m_a, shareable="banana")),
        *(
            c(f"write text {label}", 2, "text", write(text=v))
            for label, v in (
                ("None", None),
                ("int", 123),
                ("list", ["a"]),
                ("bytes", b"x"),
                ("empty", ""),
                ("blank", "   "),
                ("oversize", BIG),
                ("dict", {"text": "x"}),
                ("NUL", "a\x00b"),
            )
        ),
        *(
            c(f"write user {label}", 2, "user", write(user_id=v))
            for label, v in (
                ("None", None),
                ("int", 5),
                ("empty", ""),
                ("too long", "a" * 65),
                ("comment marker", "a--b"),
                ("injection", INJECTION),
                ("nested", [["alice"]]),
            )
        ),
        *(
            c(f"write tenant {label}", 2, "tenant", write(tenant_id=v))
            for label, v in (
                ("None", None),
                ("int", 7),
                ("list", [A]),
                ("reserved eval", "eval"),
                ("reserved canary", "canary-x"),
                ("reserved eval-", "eval-acme"),
                ("injection", INJECTION),
                ("huge", "t" * 100_000),
                ("traversal", "../" + B),
            )
        ),
        *(
            c(f"write memory_id {v!r}", 2, "memory_id", write(memory_id=v))
            for v in ("m_x", 123, ["m_"], "M_" + "0" * 32)
        ),
        c("write another tenant's memory", 3, "memory_id", write(memory_id=m_carol)),
        c("write unknown memory", 3, "memory_id", write(memory_id=UNKNOWN_MEMORY)),
        *(c(f"write team {v!r}", 2, "team", write(team_id=v)) for v in (5, "", ["core"], "a b")),
        *(c(f"write category {v!r}", 2, "category", write(category=v)) for v in categories),
        *(
            c(f"write confidence {v!r}", 2, "confidence", write(confidence=v))
            for v in ("0.5", True, float("nan"), 2, -0.1, 1e308, [0.5])
        ),
        *(c(f"write original_query {v!r}", 2, "original_query", write(original_query=v)) for v in (5, "\x00", "")),
        # write_many: items are a list of mappings of known fields with exact types
        *(
            c(f"write_many items {label}", 2, "items", many(v))
            for label, v in (("None", None), ("str", "abc"), ("dict", ok), ("int", 3), ("bytes", b"[]"))
        ),
        *(
            c(f"write_many item {label}", 2, "items[0]", many([v]))
            for label, v in (("int", 1), ("None", None), ("pair list", ["user_id", "x"]), ("str", "alice: x"))
        ),
        c("write_many non-string field name", 2, "items[0]", many([{**ok, 5: "x"}])),
        c("write_many second item a tuple", 2, "items[1]", many((ok, ("user_id", "bob")))),
        *(
            c(f"write_many {key} {v!r}", 2, f"items[0].{key}", many([{**ok, key: v}]))
            for key, v in (
                ("shareable", "no"),
                ("shareable", 1),
                ("do_not_sell", "yes"),
                ("do_not_sell", 0),
                ("confidence", "1"),
                ("confidence", float("inf")),
                ("category", 5),
                ("category", "Bad Category"),
                ("original_query", 3),
                ("original_query", {"q": 1}),
                ("team_id", 7),
                ("text", None),
                ("text", {"nested": ["x"]}),
                ("user_id", None),
                ("user_id", ["alice"]),
            )
        ),
        c("write_many memory_id is not a field", 2, "items[0].memory_id", many([{**ok, "memory_id": m_a}])),
        c("write_many item without text", 2, "items[0].text", many([{"user_id": "alice"}])),
        c("write_many item without user", 2, "items[0].user_id", many([{"text": "x"}])),
        c("write_many second item oversize", 2, "items[1].text", many([ok, {"user_id": "bob", "text": BIG}])),
        c("write_many tenant None", 2, "tenant", many([ok], tenant=None)),
        c("write_many tenant reserved", 2, "tenant", many([ok], tenant="eval")),
        # recall: refused before any index work
        *(c(f"recall k {v!r}", 2, "k", recall(k=v)) for v in ("5", 0, True, None, 5.0, 10**100, -1)),
        *(c(f"recall mode {v!r}", 2, "mode", recall(mode=v)) for v in ("fuzzy", None, ["hybrid"], 1)),
        *(c(f"recall query {v!r}", 2, "query", recall(query=v)) for v in (None, 5, "", "\x00", ["q"])),
        *(c(f"recall sync {v!r}", 2, "sync", recall(sync=v)) for v in ("no", 0, None)),
        c("recall user None", 2, "user", recall(user_id=None)),
        c("recall team int", 2, "team", recall(team_id=5)),
        c("recall tenant reserved", 2, "tenant", recall(tenant_id="eval")),
        c("recall another tenant's team", 3, "team", recall(tenant_id=B, user_id="carol", team_id="core")),
        # reads and versions
        c("list user None", 2, "user", lambda: mp.list(tenant_id=A, user_id=None)),  # type: ignore[arg-type]
        c("list team list", 2, "team", lambda: mp.list(tenant_id=A, user_id="alice", team_id=[])),  # type: ignore[arg-type]
        c("list tenant reserved", 2, "tenant", lambda: mp.list(tenant_id="canary-1", user_id="alice")),
        c("history memory None", 2, "memory_id", lambda: mp.history(tenant_id=A, memory_id=None)),  # type: ignore[arg-type]
        c("history memory not hex", 2, "memory_id", lambda: mp.history(tenant_id=A, memory_id="m_" + "g" * 32)),
        c("history unknown memory", 3, "memory_id", lambda: mp.history(tenant_id=A, memory_id=UNKNOWN_MEMORY)),
        c("rollback user int", 2, "user", lambda: mp.rollback(tenant_id=A, memory_id=m_a, user_id=5)),  # type: ignore[arg-type]
        c("rollback another's memory", 4, "user", lambda: mp.rollback(tenant_id=A, memory_id=m_a, user_id="bob")),
        c("export subject None", 2, "subject", lambda: mp.export(tenant_id=A, subject=None)),  # type: ignore[arg-type]
        c("export subject injection", 2, "subject", lambda: mp.export(tenant_id=A, subject=INJECTION)),
        c("export_json subject int", 2, "subject", lambda: list(mp.export_json(tenant_id=A, subject=5))),  # type: ignore[arg-type]
        c("sync tenant None", 2, "tenant", lambda: mp.sync(tenant_id=None)),  # type: ignore[arg-type]
        c("sync unknown tenant", 3, "tenant", lambda: mp.sync(tenant_id="ghost-tenant")),
        # forget: nothing is accepted on a refusal
        *(c(f"forget all_tenant {v!r}", 2, "all_tenant", forget(all_tenant=v)) for v in ("yes", 1, None, [True])),
        *(c(f"forget subject {v!r}", 2, "subject", forget(subject=v)) for v in (5, "", ["alice"])),
        c("forget nothing named", 2, "scope", forget()),
        c("forget subject and memory", 2, "scope", forget(subject="alice", memory_id=m_a)),
        *(c(f"forget memory_id {v!r}", 2, "memory_id", forget(memory_id=v)) for v in ("x", 5, {"id": m_a})),
        *(
            c(f"forget version {v!r}", 2, "version", forget(memory_id=m_a, version=v))
            for v in ("2", True, 0, 2**63, 1.5)
        ),
        c("forget version without memory", 2, "version", forget(subject="alice", version=1)),
        *(c(f"forget basis {v!r}", 2, "basis", forget(subject="alice", basis=v)) for v in (["x"], None, "because")),
        c("forget confirm int", 2, "confirm", forget(all_tenant=True, confirm=5)),
        c("forget confirm wrong", 2, "confirm", forget(all_tenant=True, confirm=B)),
        c("forget requested_by int", 2, "requested_by", forget(subject="alice", requested_by=5)),
        c("forget unknown subject", 3, "subject", forget(subject="zed")),
        c("forget tenant reserved", 2, "tenant", forget(tenant_id="eval", subject="alice")),
        c("deletion job None", 2, "job_id", lambda: mp.deletion(job_id=None)),  # type: ignore[arg-type]
        c("deletion unknown job", 3, "job_id", lambda: mp.deletion(job_id="del_" + "0" * 32)),
        # backups, lineage, explain
        c("backup tenant None", 2, "tenant", lambda: mp.backup(tenant_id=None)),  # type: ignore[arg-type]
        c("backup tenant reserved", 2, "tenant", lambda: mp.backup(tenant_id="canary-z")),
        *(
            c(f"restore backup {label}", 2, "backup", lambda v=v: mp.restore(tenant_id=A, backup_id=v))  # type: ignore[misc]
            for label, v in (("None", None), ("int", 5), ("other tenant's", ids["backup_b"]), ("traversal", "../x"))
        ),
        c("lineage neither", 2, "memory_id", lambda: mp.lineage(tenant_id=A)),
        c("lineage both", 2, "memory_id", lambda: mp.lineage(tenant_id=A, memory_id=m_a, record="chroma:x")),
        c("lineage memory int", 2, "memory_id", lambda: mp.lineage(tenant_id=A, memory_id=5)),  # type: ignore[arg-type]
        c("lineage record int", 2, "record", lambda: mp.lineage(tenant_id=A, record=5)),  # type: ignore[arg-type]
        c("explain run None", 2, "run", lambda: mp.explain(tenant_id=A, run_id=None)),  # type: ignore[arg-type]
        c("explain run list", 2, "run", lambda: mp.explain(tenant_id=A, run_id=["r"])),  # type: ignore[arg-type]
    ]
    return cases


# -- running them ---------------------------------------------------------------------------------


@dataclass
class Outcome:
    code: int | str
    stdout: str
    stderr: str


def run_in_process(case: Case, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Outcome:
    argv = [os.fsdecode(a) if isinstance(a, bytes) else a for a in argv_of(case)]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(case.stdin), encoding="utf-8"))
    capsys.readouterr()
    code: int | str
    try:
        code = cli.main(argv)
    except BaseException as exc:  # main must return its code: anything escaping it is a failure
        code = f"raised {type(exc).__name__}"
        print(traceback.format_exc(), file=sys.stderr)
    out, err = capsys.readouterr()
    return Outcome(code, out, err)


def run_subprocess(case: Case, env: dict[str, str]) -> Outcome:
    """Like tests.conftest.run_cli, but bytes in and out: argv and stdin need not be UTF-8."""
    result = subprocess.run(
        [str(CLI), *argv_of(case)],
        input=case.stdin,
        capture_output=True,
        env={**os.environ, **env},
        timeout=120,
        check=False,
    )
    return Outcome(
        result.returncode, result.stdout.decode("utf-8", "replace"), result.stderr.decode("utf-8", "replace")
    )


def run_api(case: Case) -> Outcome:
    assert case.api is not None
    try:
        case.api()
    except MemoryPipelinesError as exc:
        return Outcome(exc.exit_code, "", f"memory-pipelines: error: {exc.field}: {exc.message}\n")
    except Exception:
        return Outcome("raised", "", traceback.format_exc())
    return Outcome(0, "", "")


def problems_of(case: Case, outcome: Outcome) -> list[str]:
    found = []
    if outcome.code != case.code:
        found.append(f"exit {outcome.code}, expected {case.code}")
    if outcome.stdout:
        found.append(f"stdout not empty: {outcome.stdout[:200]!r}")
    if "Traceback" in outcome.stderr:
        found.append("traceback on stderr")
    lines = outcome.stderr.strip().splitlines()
    if not lines or not lines[-1].startswith(f"memory-pipelines: error: {case.field}: "):
        found.append(f"error line does not name {case.field!r}: {(lines[-1] if lines else '')[:300]!r}")
    return found


def test_hostile_inputs_are_refused_and_change_nothing(
    world: World, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in world.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("MEMORY_PIPELINES_DEBUG", raising=False)
    monkeypatch.delenv("MEMORY_PIPELINES_KMS_KEY_ID", raising=False)
    monkeypatch.delenv("MEMORY_PIPELINES_CHROMA_URL", raising=False)
    python_api = platform_cases(world)
    cases = cli_cases(world) + api_cases(world) + python_api
    assert len({c.name for c in cases}) == len(cases), "case names must be unique"
    started = time.monotonic()
    failures: dict[str, list[str]] = {}
    known: dict[str, str] = {}
    tracebacks = changed = 0
    py_tracebacks: set[str] = set()
    py_changed: set[str] = set()
    before = fingerprint(world)
    for case in cases:
        if case.api is not None:
            outcome = run_api(case)
        elif case.subprocess:
            outcome = run_subprocess(case, world.env)
        else:
            outcome = run_in_process(case, capsys, monkeypatch)
        after = fingerprint(world)
        found = problems_of(case, outcome)
        moved = changes(before, after)
        if moved:
            found.append(f"changed on refusal: {moved}")
        if case.owner_bug:
            known[case.name] = f"{case.owner_bug} [{'; '.join(found)[:300]}]" if found else "now passes: drop the mark"
        else:
            crashed = "Traceback" in outcome.stderr or outcome.code in ("raised", 1)
            tracebacks += crashed
            changed += bool(moved)
            if crashed:
                py_tracebacks.add(case.name)
            if moved:
                py_changed.add(case.name)
            if found:
                failures[case.name] = found
        before = after
    elapsed = time.monotonic() - started
    with capsys.disabled():
        print(
            f"\nhostile inputs: {len(cases)} cases, {tracebacks} tracebacks, {changed} changes on refusal,"
            f" {len(known)} known bugs owned elsewhere"
            f" ({sum(c.subprocess for c in cases)} through the entry point, {sum(c.api is not None for c in cases)}"
            f" through the API, {elapsed:.1f} s)"
        )
        for name, why in known.items():
            print(f"  known bug, owned elsewhere: {name}: {why}")
        print(
            f"python API (MemoryPlatform): {len(python_api)} cases,"
            f" {sum(name in py_tracebacks for name in (c.name for c in python_api))} tracebacks,"
            f" {sum(name in py_changed for name in (c.name for c in python_api))} changes on refusal,"
            f" {sum(c.name in failures for c in python_api)} failing"
        )
    assert len(cases) >= 100
    assert len(python_api) >= 100
    assert not failures, "\n".join(f"{name}: {'; '.join(why)}" for name, why in failures.items())
