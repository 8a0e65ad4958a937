"""Multi-process concurrency soak with an oracle (issue 11, DESIGN section 9).

Real OS processes (multiprocessing "spawn"), one HOME, the embedded PostgreSQL and a `chroma run`
server (Chroma's embedded client is not process-safe):

    writer     store.write: new memories and new versions, each text with a unique canary
    bulk       store.write_many and store.rollback
    sync       every derived-store sync (vectors, keyword index, analytics, summaries)
    slowsum    summaries by a summarizer that sleeps like an LLM call, vectors by a slow embedder
    agents     agent runs: lease, recall, permits, prompt snapshots
    deleter-a  SUBJECT / MEMORY forgets, TENANT forgets of sacrificial tenants, retention sweeps
    deleter-b  the same on other tenants, backups, physical erasures and restores; before each restore,
               do-not-sell and team membership changes on the restored tenant
    oracle     one long-lived process that decrypts every write when it lands (warm key cache)
               and checks every COMPLETE job in every store

Both deleters also fire identical requests at the same instant ("twins"). Writers and deleters are
adversarial on purpose: right after accepting a deletion the deleter tells the writers what it
hides (write as that subject, roll that memory back, edit it again later), the slow builders tell
the deleter whose text they hold, and writers pile onto a tenant just before it is restored, so
the races issue 11 names are hit within minutes, not by luck.

After every COMPLETE job the oracle checks that job's targets and every logged version its scope
covers: exact ids in every store, rules that follow from the design (nothing the subject wrote
before the job completed survives it; a forgotten memory gets no version; no write is accepted
while its scope is being forgotten; no rollback copies a forgotten version forward), a decrypt
attempt with the oracle's long-lived key cache, paraphrase probes (Chroma, blind index, visible
recall). After each restore it checks every COMPLETE job of that tenant again, scans the tenant's
PostgreSQL files for the ciphertext of every forgotten version whose job is ERASED (each restore
follows an erasure: a restore must not put forgotten bytes back), and checks that every consent and
membership change made before the restore survived it (a removed member's team view stays closed).
At the end, the analytics copy holds no do-not-sell row. Every few seconds
it decrypts every summary and prompt snapshot looking for forgotten canaries and scans every file
under HOME (after a CHECKPOINT) for canaries in plaintext. At the end, with everyone else stopped,
it rebuilds every derived store and checks everything again. Violations must be 0.

    .venv/bin/python -m tests.support.soak --seconds 100 --seed 7     # CI size, about 2 minutes
    .venv/bin/python -m tests.support.soak --seconds 1200 --seed 7    # a 20-minute local run

`--seconds` is the racing phase; setup (services, seeding, model loads) and the final checks add
20-50 s. A hard deadline (seconds + 300 s + 10%) stops everything, as SIGTERM does; children,
Chroma and PostgreSQL are stopped in every case. The exit status is 0 without violations, 1 with,
2 when the harness itself failed (a worker crashed or hung: its PostgreSQL waits are printed).
"""

from __future__ import annotations

import argparse
import atexit
import inspect
import json
import multiprocessing as mp
import os
import queue
import random
import re
import shutil
import signal
import sys
import tempfile
import textwrap
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import psycopg

from memory_pipelines.lib.agent_runs.runs import AgentRuns
from memory_pipelines.lib.backups.service import BackupService
from memory_pipelines.lib.forget.deletion import OPEN_STATES, DeletionBlocked, DeletionService
from memory_pipelines.lib.forget.erasure import ErasureIncomplete, ErasureService
from memory_pipelines.lib.forget.gate import Gate
from memory_pipelines.lib.infra.errors import (
    ConflictError,
    MemoryPipelinesError,
    NotFoundError,
    PermissionDeniedError,
    ServiceError,
)
from memory_pipelines.lib.infra.services import ensure_services, stop_services
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.keys import KeyStore
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.retention import rules as retention
from memory_pipelines.lib.runtime import master_key, open_backups
from memory_pipelines.lib.stores.adapter import postgres_files
from memory_pipelines.lib.stores.chroma.index import VectorStore
from memory_pipelines.lib.stores.derived import DerivedStores, open_derived, sync_embeddings, sync_keywords
from memory_pipelines.lib.stores.embedding import MiniLMEmbedder
from memory_pipelines.lib.stores.summaries.store import ExtractiveSummarizer, SummaryStore
from tests.support.servers import chroma_server

Source = tuple[str, int]

# -- the world ------------------------------------------------------------------------------------

REGULAR = ("soak-a", "soak-b", "soak-c")
RESTORE_TENANT = "soak-c"
SHARING = {"soak-a": "strict", "soak-b": "shared_pool", "soak-c": "progressive"}
SUBJECTS = tuple(f"u{i:02d}" for i in range(10))
TEAMS = {"red": SUBJECTS[:5], "blue": SUBJECTS[5:]}
# A team of the restored tenant that only consent changes touch, of users who never write and are
# never forgotten (writers rejoin their own teams at once and forgets drop memberships, so a removal
# there was seldom the last change a restore met): its removals are judged at every run.
CONSENT_TEAM, CONSENT_MEMBERS = "green", ("c00", "c01", "c02")
DOOMED_SUBJECTS = SUBJECTS[:4]  # sacrificial tenants (TENANT scope) are small: one team, four users
# Which deleter runs the batches of a tenant (one runner per tenant keeps the batches meaningful;
# twins and the final drain still cross over, which the tenant lock must handle).
OWNED = {"deleter-a": ("soak-a",), "deleter-b": ("soak-b", "soak-c")}
OWNER = {"soak-a": "deleter-a", "soak-b": "deleter-b", "soak-c": "deleter-b"}
ROLES = ("writer", "bulk", "sync", "slowsum", "agents", "deleter-a", "deleter-b", "oracle")
EMBEDDING_ROLES = {"sync", "agents", "deleter-a", "deleter-b", "oracle"}
# Refusals the API documents: being forgotten or restored, not found, not allowed, engine down.
EXPECTED = (ConflictError, NotFoundError, PermissionDeniedError, ServiceError)
# A one-day period for travel memories (they are backdated before each sweep: a sweep only takes
# days that have ended) and no retention at all for eu_user memories.
RETENTION_POLICIES = retention.Policies(
    version="soak-retention-1", keep_days={"travel": 1}, immediate=frozenset({"eu_user"})
)
CATEGORIES = (("general", 0.62), ("travel", 0.14), ("medical", 0.10), ("food", 0.10), ("eu_user", 0.04))

CANARY = re.compile(r"cnry[0-9a-f]{16}")
AUTHOR = re.compile(r"\bu\d\d\b")  # every personal template names its author
CANARY_BYTES = re.compile(rb"cnry[0-9a-f]{16}")

# (text, paraphrase): every text carries one canary; the paraphrase shares its meaning, not its words.
PERSONAL = (
    ("{user} keeps the spare house key code {c} under the blue flowerpot.", "Where does {user} hide the house key?"),
    ("{user}'s gym locker combination is {c}.", "What opens {user}'s locker at the gym?"),
    ("{user} booked the night train to Lyon, reservation {c}.", "Which train trip did {user} reserve?"),
    ("{user} is allergic to penicillin, patient file {c}.", "Which medicine must {user} avoid?"),
    ("{user} parks in garage bay {c} at the office.", "Where does {user} leave the car at work?"),
    ("{user} prefers aisle seats, frequent flyer number {c}.", "What seat does {user} like on flights?"),
    ("{user} waters the office ferns every Friday, plant tag {c}.", "Who looks after the office plants?"),
    ("The cabin wifi password {user} uses is {c}.", "How does {user} get online at the cabin?"),
)
TEAM = (
    ("The {team} team's staging deploy token hint is {c}.", "What is the {team} team's staging credential hint?"),
    ("The {team} team meets in room {c} on Tuesdays.", "Where does the {team} team hold its weekly meeting?"),
    ("The {team} team's on-call pager code is {c}.", "How is the {team} team's on-call person paged?"),
)


def template(key: str) -> tuple[str, str]:
    kind, index = key[0], int(key[1:])
    return (PERSONAL if kind == "p" else TEAM)[index]


def compose(key: str, user: str, team: str | None, canary: str) -> str:
    return template(key)[0].format(user=user, team=team or "", c=canary)


def paraphrase(key: str, user: str, team: str | None) -> str:
    return template(key)[1].format(user=user, team=team or "")


def team_of(user: str) -> str:
    return "red" if user in TEAMS["red"] else "blue"


def subjects_of(tenant: str) -> tuple[str, ...]:
    return SUBJECTS if tenant in REGULAR else DOOMED_SUBJECTS


def teams_of(tenant: str) -> dict[str, tuple[str, ...]]:
    return TEAMS if tenant in REGULAR else {"red": DOOMED_SUBJECTS}


def rollback_takes_user() -> bool:
    """The acting user became a parameter of rollback (issue 11); older code rolls back for anyone."""
    return "user_id" in inspect.signature(MemoryStore.rollback).parameters


def relations_of(conninfo: str, paths: Iterable[str]) -> dict[str, str]:
    """The table or index each `base/<database>/<filenode>` path among an erasure's hits now belongs
    to in the store's database: what to look at when the soak finds one (it removes its HOME)."""
    named: dict[str, str] = {}
    try:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            row = conn.execute(
                "SELECT oid::text FROM pg_catalog.pg_database WHERE datname = current_database()"
            ).fetchone()
            database = row[0] if row else ""
            for path in paths:
                found = re.fullmatch(r"base/(\d+)/(\d+)(?:_\w+)?(?:\.\d+)?", path)
                if found is None:
                    continue
                if found.group(1) != database:
                    named[path] = "another database"
                    continue
                relation = conn.execute(
                    "SELECT c.oid::regclass::text || ' (' || c.relkind::text || ')' FROM pg_catalog.pg_class c"
                    " WHERE pg_catalog.pg_relation_filenode(c.oid) = %s",
                    (int(found.group(2)),),
                ).fetchone()
                named[path] = relation[0] if relation else "no relation now"
    except psycopg.Error as exc:  # a diagnosis never ends the soak
        named["error"] = type(exc).__name__
    return named


# -- configuration and schedule -----------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    at: float  # seconds after the racing phase starts
    kind: str  # twin | forget_tenant | retention | backup | erase | restore
    role: str  # the deleter that fires it
    tenant: str
    subject: str | None = None


@dataclass(frozen=True)
class Config:
    seconds: float
    seed: int
    home: Path
    logdir: Path
    conninfo: str
    chroma_url: str
    doomed: tuple[str, ...]
    events: tuple[Event, ...]
    summarizer_delay: float = 0.8
    embedder_delay: float = 5.0
    drain_seconds: float = 35.0
    final_seconds: float = 60.0

    def settings(self) -> Settings:
        return Settings.from_env(
            {"MEMORY_PIPELINES_HOME": str(self.home), "MEMORY_PIPELINES_CHROMA_URL": self.chroma_url}
        )


def make_schedule(seconds: float, seed: int, doomed: tuple[str, ...]) -> tuple[Event, ...]:
    """Fixed-time events, from the seed alone: TENANT forgets, twins, retention, backups, erasures, restores."""
    rng = random.Random(f"{seed}:schedule")
    events: list[Event] = []
    for n, tenant in enumerate(doomed):
        at = seconds * (0.2 + 0.65 * (n + 0.5) / len(doomed)) + rng.uniform(-0.03, 0.03) * seconds
        events.append(Event(at, "forget_tenant", "deleter-a", tenant))
    twins = max(4, round(seconds / 15))
    for n in range(twins):
        at = seconds * (0.1 + 0.8 * (n + rng.random()) / twins)
        subject = rng.choice(SUBJECTS)
        events += [Event(at, "twin", role, "soak-a", subject) for role in ("deleter-a", "deleter-b")]
    sweeps = max(2, round(seconds / 25))
    for n in range(sweeps):
        tenant = ("soak-a", "soak-b")[n % 2]
        events.append(
            Event(seconds * (0.12 + 0.8 * n / sweeps) + rng.uniform(0, 3), "retention", OWNER[tenant], tenant)
        )
    # Restores spread over the second three quarters, each from any backup taken before it (so an
    # older state can follow a newer one); backups from the start on.
    restores = max(4, round(seconds / 20))
    for n in range(restores):
        at = seconds * (0.25 + 0.7 * (n + rng.uniform(0.2, 0.8)) / restores)
        events.append(Event(at, "restore", "deleter-b", RESTORE_TENANT))
        # Each restore follows a physical erasure of the tenant: its jobs are ERASED when it loads an
        # older backup that holds them.
        events.append(Event(max(0.0, at - 4.0), "erase", "deleter-b", RESTORE_TENANT))
    backups = max(2, (restores + 1) // 2)
    for n in range(backups):
        at = seconds * (0.03 + 0.65 * n / backups) + rng.uniform(0, 2)
        events.append(Event(at, "backup", "deleter-b", RESTORE_TENANT))
    events += retention_restore_events(seconds, seed)
    return tuple(sorted(events, key=lambda e: (e.at, e.role, e.kind)))


def retention_restore_events(seconds: float, seed: int) -> list[Event]:
    """Issue 20: retention, then restores of older and newer backups (`Deleter.retention_between_restores`),
    on the restored tenant, once per five minutes of racing (at least once). A random stream of its
    own: the other events' times do not move."""
    rng = random.Random(f"{seed}:retention-restores")
    count = max(1, round(seconds / 300))
    return [
        Event(
            seconds * (0.35 + 0.5 * (n + rng.uniform(0.1, 0.6)) / count),
            "retention_restores",
            "deleter-b",
            RESTORE_TENANT,
        )
        for n in range(count)
    ]


@dataclass
class Ipc:
    """Shared between processes (created from the spawn context, passed at process creation)."""

    stop: Any
    final: Any
    go: Any
    t_start: Any
    ready: Any
    results: Any
    writer_hints: Any
    bulk_hints: Any
    adversary: dict[str, Any]


# -- logs -------------------------------------------------------------------------------------------


class JsonLog:
    """One JSON object per line, flushed per line; a file per process, outside HOME (it holds plaintext)."""

    def __init__(self, path: Path) -> None:
        self.fh = path.open("a", encoding="utf-8", buffering=1)

    def emit(self, ev: str, **fields: Any) -> None:
        self.fh.write(json.dumps({"ev": ev, **fields}) + "\n")


def log_consent(log: JsonLog, tenant: str, kind: str, key: str, value: bool, t0: float) -> None:
    """A consent or access change that committed: memory_dns / subject_dns (the flag), member (present)."""
    log.emit("consent", tenant=tenant, kind=kind, key=key, value=value, t0=t0, t1=time.time())


class LogTail:
    """Reads the complete lines every process appended since the last call."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.offsets: dict[Path, int] = {}

    def read(self) -> Iterator[dict[str, Any]]:
        for path in sorted(self.logdir.glob("*.jsonl")):
            offset = self.offsets.get(path, 0)
            with path.open("rb") as fh:
                fh.seek(offset)
                data = fh.read()
            end = data.rfind(b"\n") + 1
            self.offsets[path] = offset + end
            for line in data[:end].splitlines():
                if line.strip():
                    yield json.loads(line)


# -- tallies ----------------------------------------------------------------------------------------


def _reason(exc: BaseException) -> str:
    """An error's class, field and message with ids blanked, so refusals group by kind."""
    message = str(getattr(exc, "message", exc))
    message = re.sub(r"'[^']*'|\"[^\"]*\"|m_[0-9a-f]{32}|\b\w*_[0-9a-f]{12,}\b|\d+(\.\d+)?", "…", message)
    field_name = getattr(exc, "field", "")
    return f"{type(exc).__name__}({field_name}): {message[:70]}"


@dataclass
class Tally:
    role: str
    ops: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    blocked: Counter[str] = field(default_factory=Counter)
    checks: Counter[str] = field(default_factory=Counter)
    violations: list[dict[str, Any]] = field(default_factory=list)
    notes: Counter[str] = field(default_factory=Counter)
    _seen: dict[str, dict[str, Any]] = field(default_factory=dict)

    def violation(self, kind: str, key: str | None = None, **detail: Any) -> None:
        """Record one violation; the same `key` seen again (a later re-check, the same exception in a
        loop) counts as a repeat of the first finding rather than a new one."""
        dedupe = f"{kind}|{key}"
        if key is not None and dedupe in self._seen:
            self._seen[dedupe]["repeats"] = self._seen[dedupe].get("repeats", 0) + 1
            return
        entry = {"kind": kind, "role": self.role, **detail}
        if key is not None:
            self._seen[dedupe] = entry
        self.violations.append(entry)

    def report(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "ops": dict(self.ops),
            "refusals": dict(self.refusals),
            "blocked": dict(self.blocked),
            "checks": dict(self.checks),
            "notes": dict(self.notes),
            "violations": self.violations,
        }


# -- workers ----------------------------------------------------------------------------------------


class Worker:
    """One OS process: its own connections, key cache, embedder and a seeded random schedule."""

    def __init__(self, role: str, cfg: Config, ipc: Ipc) -> None:
        self.role = role
        self.cfg = cfg
        self.ipc = ipc
        self.rng = random.Random(f"{cfg.seed}:{role}")
        self.tally = Tally(role)
        self.log = JsonLog(cfg.logdir / f"{role}.jsonl")
        self.settings = cfg.settings()
        self.store = MemoryStore(cfg.conninfo, KeyStore(master_key(self.settings)))
        # One ONNX thread per process: five processes embed on two cores.
        self.derived: DerivedStores = open_derived(self.settings, self.store, embedder=MiniLMEmbedder(threads=1))
        self.start = 0.0
        self._role_index = ROLES.index(role)
        self.hammer: tuple[str, float] = ("", 0.0)  # (tenant, until) from a deleter about to restore it
        self.parent = os.getppid()

    # The racing phase's clock: seconds since the start every process shares.
    def now(self) -> float:
        return time.time() - self.start

    def stopping(self) -> bool:
        # An orphan (the parent was killed without its cleanup) stops too, rather than race forever.
        return bool(self.ipc.stop.is_set()) or os.getppid() != self.parent

    def pause(self, seconds: float) -> None:
        self.ipc.stop.wait(seconds)

    def canary(self) -> str:
        # Unique across processes (the role is a digit of it) and reproducible from the seed.
        return f"cnry{self._role_index:x}{self.rng.getrandbits(60):015x}"

    def prepare(self) -> None:
        if self.role in EMBEDDING_ROLES:
            self.derived.vectors.embedder.embed(["warming up the embedding model"])

    def run(self) -> None:
        raise NotImplementedError

    def flag_memory(self, kind: str, tenant: str, cv: Any, value: bool) -> None:
        """Set one memory's do-not-sell flag (counted as `kind`) and log the change once it committed."""
        t0 = time.time()
        flag = partial(self.store.set_do_not_sell, tenant_id=tenant, user_id=cv.user_id, memory_id=cv.memory_id)
        done, _ = self.attempt(kind, partial(flag, value=value))
        if done:
            log_consent(self.log, tenant, "memory_dns", cv.memory_id, value, t0)

    def attempt(self, kind: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """Run one operation; documented refusals are counted, anything else is a violation."""
        try:
            value = fn()
        except DeletionBlocked as exc:
            self.tally.blocked[exc.code] += 1
            self.tally.refusals[f"{kind}: BLOCKED {exc.code}"] += 1
            return False, exc
        except EXPECTED as exc:
            self.tally.refusals[f"{kind}: {_reason(exc)}"] += 1
            return False, exc
        except Exception as exc:
            self.tally.violation(
                "unexpected_exception",
                key=f"{kind}|{_reason(exc)}",
                op=kind,
                error=f"{type(exc).__module__}.{type(exc).__name__}: {str(exc)[:300]}",
                traceback=traceback.format_exc(limit=8)[-2500:],
                t=round(self.now(), 2),
            )
            return False, exc
        self.tally.ops[kind] += 1
        return True, value

    def log_write(
        self,
        op: str,
        t0: float,
        *,
        tenant: str,
        memory_id: str,
        version: int,
        author: str,
        team: str | None,
        text: str,
        tpl: str,
        category: str | None,
        restored_from: int | None = None,
    ) -> None:
        match = CANARY.search(text)
        self.log.emit(
            "write",
            op=op,
            tenant=tenant,
            memory_id=memory_id,
            version=version,
            author=author,
            team=team,
            canary=match.group() if match else None,
            text=text,
            tpl=tpl,
            category=category,
            restored_from=restored_from,
            t0=t0,
            t1=time.time(),
        )

    def category(self) -> str:
        draw, total = self.rng.random(), 0.0
        for name, weight in CATEGORIES:
            total += weight
            if draw < total:
                return name
        return "general"

    def new_text(self, tenant: str, user: str, team: str | None) -> tuple[str, str, str]:
        """(template key, text, canary) for a new memory of `user` (a team memory when `team`)."""
        key = f"t{self.rng.randrange(len(TEAM))}" if team else f"p{self.rng.randrange(len(PERSONAL))}"
        canary = self.canary()
        return key, compose(key, user, team, canary), canary

    def hammering(self) -> bool:
        """True while a restore is about to close `self.hammer[0]`: write there, without pauses."""
        return self.hammer[1] > time.time()

    def pick_tenant(self, tenants: list[str]) -> str:
        if self.hammering() and self.hammer[0] in tenants:
            return self.hammer[0]
        return self.rng.choice(tenants)

    def drain_hints(self, q: Any, limit: int = 4) -> list[tuple[Any, ...]]:
        out = []
        for _ in range(limit):
            try:
                out.append(q.get_nowait())
            except queue.Empty:
                break
        return out

    def report(self) -> dict[str, Any]:
        return self.tally.report()


class Writer(Worker):
    """store.write: new memories, new versions of its own memories, team re-joins; acts on hints."""

    def prepare(self) -> None:
        super().prepare()
        self.tenants = [*REGULAR, *self.cfg.doomed]
        self.mine: dict[tuple[str, str], tuple[str, str | None, str]] = {}

    def run(self) -> None:
        while not self.stopping():
            hints = self.drain_hints(self.ipc.writer_hints)
            for hint in hints:
                if hint[0] == "subject":
                    self.write_new(hint[1], hint[2], hinted=True)
                elif hint[0] == "memory":
                    self.write_version(hint[1], hint[2], hint[3], None, None)
                elif hint[0] == "hammer":
                    self.hammer = (hint[1], hint[2])
            if not hints:
                tenant = self.pick_tenant(self.tenants)
                draw = self.rng.random()
                theirs = sorted(k for k in self.mine if k[0] == tenant)
                if draw < 0.55 or not theirs:
                    self.write_new(tenant, self.rng.choice(subjects_of(tenant)))
                elif draw < 0.92:
                    key = self.rng.choice(theirs)
                    author, team, tpl = self.mine[key]
                    self.write_version(key[0], key[1], author, team, tpl)
                else:
                    self.join_team(tenant, self.rng.choice(subjects_of(tenant)))
            # No pause while hammering a tenant that a restore is about to close.
            self.pause(0.0 if self.hammering() else self.rng.uniform(0.02, 0.1))

    def join_team(self, tenant: str, user: str) -> None:
        """Forgetting a subject drops their team memberships; they come back to write team memories."""
        team = "red" if tenant not in REGULAR else team_of(user)
        t0 = time.time()
        ok, res = self.attempt(
            "team_join", lambda: self.store.add_team_member(tenant_id=tenant, team_id=team, user_id=user)
        )
        if ok and res["added"]:
            log_consent(self.log, tenant, "member", f"{team}/{user}", True, t0)

    def write_new(self, tenant: str, user: str, *, hinted: bool = False) -> None:
        team = (team_of(user) if tenant in REGULAR else "red") if self.rng.random() < 0.25 else None
        tpl, text, canary = self.new_text(tenant, user, team)
        category = self.category()
        query = f"what did I say about {canary}?" if self.rng.random() < 0.3 else None
        t0 = time.time()
        ok, res = self.attempt(
            "write_hinted" if hinted else "write",
            lambda: self.store.write(
                tenant_id=tenant, user_id=user, text=text, team_id=team, category=category, original_query=query
            ),
        )
        if ok:
            self.log_write(
                "write",
                t0,
                tenant=tenant,
                memory_id=res.memory_id,
                version=res.version,
                author=user,
                team=team,
                text=text,
                tpl=tpl,
                category=category,
            )
            self.mine[(tenant, res.memory_id)] = (user, team, tpl)
        elif isinstance(res, NotFoundError) and "was deleted" in res.message and tenant in self.tenants:
            self.tenants.remove(tenant)

    def write_version(self, tenant: str, memory_id: str, author: str, team: str | None, tpl: str | None) -> None:
        tpl = tpl or f"p{self.rng.randrange(len(PERSONAL))}"
        canary = self.canary()
        text = compose(tpl, author, team, canary)
        t0 = time.time()
        ok, res = self.attempt(
            "write_version",
            lambda: self.store.write(tenant_id=tenant, user_id=author, text=text, memory_id=memory_id),
        )
        if ok:
            self.log_write(
                "version",
                t0,
                tenant=tenant,
                memory_id=memory_id,
                version=res.version,
                author=author,
                team=res.team_id,
                text=text,
                tpl=tpl,
                category=None,
            )
        elif isinstance(res, NotFoundError):
            self.mine.pop((tenant, memory_id), None)


class Bulk(Worker):
    """store.write_many batches, new versions and rollbacks; acts on hints."""

    def prepare(self) -> None:
        super().prepare()
        self.tenants = [*REGULAR, *self.cfg.doomed]
        self.mine: dict[tuple[str, str], tuple[str, str | None, str, int]] = {}
        self.with_user = rollback_takes_user()
        self.later: list[tuple[float, str, str, str]] = []  # (when, tenant, memory, author): edit again

    def run(self) -> None:
        while not self.stopping():
            hints = self.drain_hints(self.ipc.bulk_hints)
            for hint in hints:
                if hint[0] == "subject":
                    others = [u for u in subjects_of(hint[1]) if u != hint[2]]
                    self.write_many(hint[1], [hint[2], hint[2], self.rng.choice(others)], hinted=True)
                elif hint[0] == "rollback":
                    self.rollback(hint[1], hint[2], hint[3], hinted=True)
                elif hint[0] == "later":
                    self.later.append((time.time() + hint[4], hint[1], hint[2], hint[3]))
                elif hint[0] == "hammer":
                    self.hammer = (hint[1], hint[2])
            due = [entry for entry in self.later if entry[0] <= time.time()]
            for entry in due:
                # The user edits a memory whose latest version they had forgotten, once that job is done.
                self.later.remove(entry)
                self.new_version((entry[1], entry[2]), author=entry[3], kind="write_version_after_forget")
            if not hints and not due:
                draw = self.rng.random()
                tenant = self.pick_tenant(self.tenants)
                theirs = sorted(k for k in self.mine if k[0] == tenant)
                multi = [k for k in theirs if self.mine[k][3] >= 2]
                if draw < 0.45 or not theirs:
                    users = [self.rng.choice(subjects_of(tenant)) for _ in range(self.rng.randint(2, 5))]
                    self.write_many(tenant, users)
                elif draw < 0.75 or not multi:
                    self.new_version(self.rng.choice(theirs))
                else:
                    key = self.rng.choice(multi)
                    self.rollback(key[0], key[1], self.mine[key][0])
            self.pause(0.0 if self.hammering() else self.rng.uniform(0.05, 0.2))

    def write_many(self, tenant: str, users: list[str], *, hinted: bool = False) -> None:
        items: list[dict[str, Any]] = []
        meta: list[tuple[str, str, str]] = []
        for n, user in enumerate(users):
            team = None
            if n == 0 and self.rng.random() < 0.3:
                team = team_of(user) if tenant in REGULAR else "red"
            tpl, text, _ = self.new_text(tenant, user, team)
            category = self.category()
            items.append({"user_id": user, "text": text, "team_id": team, "category": category})
            meta.append((tpl, text, category))
        t0 = time.time()
        ok, res = self.attempt(
            "write_many_hinted" if hinted else "write_many",
            lambda: self.store.write_many(tenant_id=tenant, items=items),
        )
        if ok:
            for item, (tpl, text, category), written in zip(items, meta, res, strict=True):
                self.log_write(
                    "bulk",
                    t0,
                    tenant=tenant,
                    memory_id=written.memory_id,
                    version=written.version,
                    author=item["user_id"],
                    team=item["team_id"],
                    text=text,
                    tpl=tpl,
                    category=category,
                )
                self.mine[(tenant, written.memory_id)] = (item["user_id"], item["team_id"], tpl, written.version)
        elif isinstance(res, NotFoundError) and "was deleted" in res.message and tenant in self.tenants:
            self.tenants.remove(tenant)

    def new_version(self, key: tuple[str, str], *, author: str | None = None, kind: str = "write_version") -> None:
        tenant, memory_id = key
        known = self.mine.get(key)
        writer = author or (known[0] if known else SUBJECTS[0])
        team, tpl = (known[1], known[2]) if known else (None, "p0")
        canary = self.canary()
        text = compose(tpl, writer, team, canary)
        t0 = time.time()
        ok, res = self.attempt(
            kind, lambda: self.store.write(tenant_id=tenant, user_id=writer, text=text, memory_id=memory_id)
        )
        if ok:
            self.log_write(
                "version",
                t0,
                tenant=tenant,
                memory_id=memory_id,
                version=res.version,
                author=writer,
                team=res.team_id,
                text=text,
                tpl=tpl,
                category=None,
            )
            self.mine[key] = (writer, res.team_id, tpl, res.version)
        elif isinstance(res, NotFoundError):
            self.mine.pop(key, None)

    def rollback(self, tenant: str, memory_id: str, author: str, *, hinted: bool = False) -> None:
        kwargs: dict[str, Any] = {"tenant_id": tenant, "memory_id": memory_id}
        if self.with_user:
            kwargs["user_id"] = author
        t0 = time.time()
        ok, res = self.attempt("rollback_hinted" if hinted else "rollback", lambda: self.store.rollback(**kwargs))
        if ok:
            known = self.mine.get((tenant, memory_id))
            team, tpl = (known[1], known[2]) if known else (None, "p0")
            self.log_write(
                "rollback",
                t0,
                tenant=tenant,
                memory_id=memory_id,
                version=res["version"],
                author=author,
                team=team,
                text=res["text"],
                tpl=tpl,
                category=None,
                restored_from=res["restored_from"],
            )
            self.mine[(tenant, memory_id)] = (author, team, tpl, res["version"])
        elif isinstance(res, NotFoundError):
            self.mine.pop((tenant, memory_id), None)


class Sync(Worker):
    """Every derived-store sync, tenant after tenant (summaries every third pass: slowsum builds them too)."""

    def prepare(self) -> None:
        super().prepare()
        self.tenants = [*REGULAR, *self.cfg.doomed]

    def run(self) -> None:
        passes = 0
        while not self.stopping():
            passes += 1
            for tenant in list(self.tenants):
                if self.stopping():
                    break
                if not self.sync_tenant(tenant, summaries=passes % 3 == 1):
                    self.tenants.remove(tenant)
            self.pause(0.05)

    def sync_tenant(self, tenant: str, *, summaries: bool) -> bool:
        """One pass over the tenant's derived stores; False once the tenant is deleted."""
        derived = self.derived
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("sync_vectors", lambda: sync_embeddings(self.store, derived.vectors, tenant_id=tenant)),
            ("sync_keywords", lambda: sync_keywords(self.store, tenant_id=tenant)),
            ("sync_analytics", lambda: derived.analytics.rebuild(store=self.store, tenant_id=tenant)),
        ]
        if summaries:
            steps += [
                ("sync_summaries", lambda: derived.summaries.sync(tenant_id=tenant, scope="subject")),
                ("sync_summaries", lambda: derived.summaries.sync(tenant_id=tenant, scope="team")),
            ]
        for kind, step in steps:
            ok, res = self.attempt(kind, step)
            if not ok and isinstance(res, NotFoundError) and "was deleted" in res.message:
                return False
        return True


class SlowSummarizer:
    """The extractive summarizer, slow like an LLM call: the window in which a deletion is accepted
    mid-build. It tells the deleter owning the tenant which subject or team it is summarising."""

    name = ExtractiveSummarizer.name  # same output as the default, so both builders agree on hashes

    def __init__(self, delay: float, announce: Callable[[float], None]) -> None:
        self.inner = ExtractiveSummarizer()
        self.delay = delay
        self.announce = announce
        self.calls = 0

    def summarize(self, texts: list[str]) -> str:
        self.calls += 1
        self.announce(self.delay)
        time.sleep(self.delay)
        return self.inner.summarize(texts)


class SlowEmbedder:
    """The embedding model, slow like a remote embedding API: the window in which a deletion is
    accepted while a vector sync holds texts it read. It says whose texts it is embedding."""

    def __init__(self, inner: Any, delay: float, announce: Callable[[list[str], float], None]) -> None:
        self.inner = inner
        self.delay = delay
        self.announce = announce
        self.calls = 0

    @property
    def name(self) -> str:
        return str(self.inner.name)  # the same model: the collection must not be reset for it

    @property
    def dimension(self) -> int:
        return int(self.inner.dimension)

    def embed(self, texts: Any) -> Any:
        self.calls += 1
        vectors = self.inner.embed(texts)
        authors = sorted({m.group() for text in texts if (m := AUTHOR.search(text))})
        if authors:
            self.announce(authors, self.delay)
        time.sleep(self.delay)
        return vectors


class SlowSum(Worker):
    """Slow builders: summaries by a slow summarizer, vectors by a slow embedder, scope by scope."""

    def prepare(self) -> None:
        super().prepare()
        self.tenants = [*REGULAR, *self.cfg.doomed]
        self.current: tuple[str, str, str] = ("", "", "")
        for q in self.ipc.adversary.values():
            q.cancel_join_thread()  # hints are advisory: never block this process's exit on them
        self.summarizer = SlowSummarizer(self.cfg.summarizer_delay, self._announce)
        self.summaries = SummaryStore(self.store, self.summarizer)
        # Longer than a whole cascade (seconds here under load): the upsert lands after COMPLETE.
        self.embedder = SlowEmbedder(self.derived.vectors.embedder, self.cfg.embedder_delay, self._authors)
        self.vectors = VectorStore(embedder=self.embedder, url=self.cfg.chroma_url)

    def _announce(self, delay: float) -> None:
        tenant, scope, scope_id = self.current
        self.ipc.adversary[OWNER.get(tenant, "deleter-a")].put((tenant, scope, scope_id, time.time() + delay))

    def _authors(self, authors: list[str], delay: float) -> None:
        tenant = self.current[0]
        author = authors[int(time.time() * 1000) % len(authors)]  # not the seeded rng: timing decides it
        self.ipc.adversary[OWNER.get(tenant, "deleter-a")].put((tenant, "subject", author, time.time() + delay))

    def run(self) -> None:
        while not self.stopping():
            for tenant in list(self.tenants):
                # A slow vector sync, then a few summaries (rebuilt only where their sources changed).
                self.sync_vectors(tenant)
                if tenant not in self.tenants:
                    continue
                scopes = [("subject", s) for s in subjects_of(tenant)] + [("team", t) for t in teams_of(tenant)]
                for scope, scope_id in self.rng.sample(scopes, 5):
                    if self.stopping() or tenant not in self.tenants:
                        break
                    if not self.sync_one(tenant, scope, scope_id):
                        self.tenants.remove(tenant)
                if self.stopping():
                    break
            self.pause(0.05)

    def sync_vectors(self, tenant: str) -> None:
        self.current = (tenant, "vectors", "")
        ok, res = self.attempt("sync_vectors_slow", lambda: sync_embeddings(self.store, self.vectors, tenant_id=tenant))
        if not ok and isinstance(res, NotFoundError) and "was deleted" in res.message:
            self.tenants.remove(tenant)

    def sync_one(self, tenant: str, scope: str, scope_id: str) -> bool:
        """One summary (only rebuilt when its sources changed); False once the tenant is deleted."""
        self.current = (tenant, scope, scope_id)
        ok, res = self.attempt(
            "sync_summaries_slow", lambda: self.summaries.sync(tenant_id=tenant, scope=scope, scope_ids=[scope_id])
        )
        return ok or not (isinstance(res, NotFoundError) and "was deleted" in res.message)

    def report(self) -> dict[str, Any]:
        self.tally.ops["slow_summarize_calls"] = self.summarizer.calls
        self.tally.ops["slow_embed_calls"] = self.embedder.calls
        return super().report()


class Agents(Worker):
    """Agent runs: a lease, a recall, a streamed answer under a permit, a tool call, a prompt snapshot."""

    def prepare(self) -> None:
        super().prepare()
        self.runs = AgentRuns(self.derived)

    def run(self) -> None:
        n = 0
        while not self.stopping():
            n += 1
            self.one_run(f"soak-{n}")
            self.pause(self.rng.uniform(0.05, 0.25))

    def one_run(self, run_id: str) -> None:
        tenant = self.rng.choice(REGULAR)
        user = self.rng.choice(SUBJECTS)
        key = f"p{self.rng.randrange(len(PERSONAL))}"
        ok, lease = self.attempt(
            "lease", lambda: self.runs.open(tenant_id=tenant, subject_id=user, run_id=run_id, ttl_seconds=60)
        )
        if ok:
            try:
                self.agent_run(lease, paraphrase(key, user, None))
            finally:
                self.attempt("lease_close", lambda: self.runs.gate.close_lease(lease_id=lease))

    def agent_run(self, lease: str, query: str) -> None:
        ok, hits = self.attempt("agent_recall", lambda: self.runs.recall(lease_id=lease, query=query, k=3))
        if not ok or not hits:
            return
        chunks = self.rng.randint(3, 8)

        def stream() -> None:
            buffered: list[str] = []
            with self.runs.gate.permit(lease_id=lease, sink="model_output", on_cancel=[buffered.clear]) as permit:
                for i in range(chunks):
                    buffered.append(f"chunk{i}")
                    time.sleep(0.04)
                    permit.check()  # a deletion closing a fence of this run stops the stream here
                    buffered.clear()

        self.attempt("permit_stream", stream)
        if self.rng.random() < 0.4:
            self.attempt("permit_tool", lambda: self._tool(lease))
        prompt = "Answer using what you remember: " + " | ".join(h["text"] for h in hits)
        self.attempt("snapshot", lambda: self.runs.snapshot_prompt(lease_id=lease, prompt=prompt))

    def _tool(self, lease: str) -> None:
        with self.runs.gate.permit(lease_id=lease, sink="tool_dispatch"):
            time.sleep(0.02)


class Deleter(Worker):
    """Accepts deletions at random moments (and at the schedule's fixed times) and runs them."""

    def prepare(self) -> None:
        super().prepare()
        self.service = DeletionService(self.derived, drain_timeout=5.0)
        self.backups: BackupService | None = (
            open_backups(self.settings, self.store) if self.role == "deleter-b" else None
        )
        self.events = [e for e in self.cfg.events if e.role == self.role]
        self.mine = OWNED[self.role]
        self.backup_ids: list[str] = []
        for q in (self.ipc.writer_hints, self.ipc.bulk_hints):
            q.cancel_join_thread()

    def run(self) -> None:
        while not self.stopping():
            touched: set[str] = set(self.mine)
            event = self.due_event()
            if event is not None:
                self.fire(event)
                touched.add(event.tenant)
            else:
                target = self.adversary_target()
                if target is not None:
                    self.forget_subject(*target, kind="forget_subject_midbuild")
                else:
                    self.random_request(self.rng.choice(self.mine))
                if self.rng.random() < 0.4:
                    self.pause(self.rng.uniform(0.02, 0.3))
                    self.random_request(self.rng.choice(self.mine))
            for tenant in sorted(touched):
                self.run_open(tenant)
            self.pause(self.rng.uniform(0.05, 0.35))
        self.drain()

    # -- choosing -------------------------------------------------------------------------------

    def due_event(self) -> Event | None:
        """The next fixed-time event if it is due within 2.5 s: wait for its instant (twins must
        fire together), rather than start a batch that could run past it."""
        if not self.events or self.events[0].at - self.now() > 2.5:
            return None
        event = self.events.pop(0)
        self.pause(max(0.0, event.at - self.now()))
        return None if self.stopping() else event

    def adversary_target(self) -> tuple[str, str] | None:
        latest = None
        for hint in self.drain_hints(self.ipc.adversary[self.role], limit=64):
            latest = hint
        if latest is None or latest[3] < time.time() + 0.2 or self.rng.random() > 0.7:
            return None
        tenant, scope, scope_id, _ = latest
        if tenant not in self.mine:
            return None
        subject = scope_id if scope == "subject" else self.rng.choice(teams_of(tenant)[scope_id])
        return tenant, subject

    def random_request(self, tenant: str) -> None:
        draw = self.rng.random()
        if draw < 0.4:
            self.forget_subject(tenant, self.rng.choice(subjects_of(tenant)))
            return
        ok, current = self.attempt("list_current", lambda: self.store.current_versions(tenant_id=tenant))
        if not ok or not current:
            return
        multi = [cv for cv in current if cv.version >= 2]
        if draw < 0.7 or not multi:
            cv = self.rng.choice(current)
            job = self.request("forget_memory", tenant, memory_id=cv.memory_id)
            if job is not None and not job["duplicate"]:
                self.ipc.writer_hints.put(("memory", tenant, cv.memory_id, cv.user_id))
            return
        cv = self.rng.choice(multi)
        # Mostly an older version: the one a rollback would copy forward.
        version = self.rng.randint(1, cv.version - 1) if self.rng.random() < 0.75 else cv.version
        job = self.request("forget_version", tenant, memory_id=cv.memory_id, version=version)
        if job is not None and not job["duplicate"]:
            self.ipc.bulk_hints.put(("rollback", tenant, cv.memory_id, cv.user_id))
            self.ipc.writer_hints.put(("memory", tenant, cv.memory_id, cv.user_id))
            if version == cv.version:
                # Later, the user edits that memory again: its next version must not reuse the
                # number of the forgotten one (whose tombstone would hide it).
                self.ipc.bulk_hints.put(("later", tenant, cv.memory_id, cv.user_id, 6.0))

    def forget_subject(self, tenant: str, subject: str, *, kind: str = "forget_subject") -> dict[str, Any] | None:
        job = self.request(kind, tenant, subject=subject)
        if job is not None and not job["duplicate"]:
            self.ipc.writer_hints.put(("subject", tenant, subject))
            self.ipc.bulk_hints.put(("subject", tenant, subject))
        return job

    def request(self, kind: str, tenant: str, **scope: Any) -> dict[str, Any] | None:
        t0 = time.time()
        ok, job = self.attempt(kind, lambda: self.service.request(tenant_id=tenant, **scope))
        if not ok:
            return None
        self.log.emit(
            "accepted",
            job_id=job["job_id"],
            tenant=tenant,
            scope=job["scope"]["type"],
            duplicate=job["duplicate"],
            t0=t0,
            t1=time.time(),
        )
        return dict(job)

    # -- running --------------------------------------------------------------------------------

    def run_open(self, tenant: str, kind: str = "run_batch") -> int:
        ok, pending = self.attempt("list_pending", lambda: self.service.pending(tenant_id=tenant, states=OPEN_STATES))
        ids = pending.get(tenant, []) if ok else []
        if ids:
            self.run_batch(kind, tenant, ids)
        return len(ids)

    def run_batch(self, kind: str, tenant: str, ids: list[str]) -> None:
        started = time.monotonic()
        self.attempt(kind, lambda: self.service.run_batch(tenant_id=tenant, job_ids=ids))
        took = time.monotonic() - started
        notes = self.tally.notes
        notes["run_batch ms (total)"] += round(took * 1000)
        notes["run_batch ms (max)"] = max(notes["run_batch ms (max)"], round(took * 1000))

    def fire(self, event: Event) -> None:
        if event.kind == "twin":
            assert event.subject is not None
            job = self.forget_subject(event.tenant, event.subject, kind="forget_twin")
            if job is not None:
                self.run_batch("run_batch", event.tenant, [job["job_id"]])
        elif event.kind == "forget_tenant":
            self.request("forget_tenant", event.tenant, all_tenant=True, confirm=event.tenant)
        elif event.kind == "retention":
            self.sweep(event.tenant)
        elif event.kind == "backup":
            assert self.backups is not None
            backups = self.backups
            ok, manifest = self.attempt("backup", lambda: backups.backup(tenant_id=event.tenant))
            if ok:
                self.backup_ids.append(manifest["backup_id"])
                self.log.emit("backup", tenant=event.tenant, backup_id=manifest["backup_id"], t=time.time())
        elif event.kind == "erase":
            self.erase(event.tenant)
        elif event.kind == "restore":
            self.restore(event.tenant)
        elif event.kind == "retention_restores":
            self.retention_between_restores(event.tenant)

    def erase(self, tenant: str) -> None:
        """The tenant's physical erasure (as its sensor runs it): a hit of its byte scan is a finding."""

        def run() -> dict[str, Any] | None:
            try:
                return ErasureService(self.derived).erase_tenant(tenant_id=tenant)
            except ErasureIncomplete as exc:
                self.tally.violation(
                    "erasure_incomplete",
                    key=str(sorted(exc.hits)),
                    hits=exc.hits,
                    relations=relations_of(self.cfg.conninfo, exc.hits),
                    t=round(self.now(), 2),
                )
                return None

        ok, report = self.attempt("erase", run)
        if ok and report is not None:
            self.log.emit("erased", tenant=tenant, jobs=report["jobs"], t=time.time())
            waited = report.get("horizon", {})  # absent when nothing was pending
            if waited.get("olderSnapshots"):
                notes = self.tally.notes
                notes["erasures that waited for an older snapshot"] += 1
                notes["erasure snapshot wait ms (max)"] = max(
                    notes["erasure snapshot wait ms (max)"], round(waited["waitedSeconds"] * 1000)
                )

    def change_consent(self, tenant: str) -> None:
        """Do-not-sell flags (two memories, one subject) and one team membership, changed just before a
        restore of an older backup: none of them may be undone by it."""
        ok, current = self.attempt("list_current", lambda: self.store.current_versions(tenant_id=tenant))
        for cv in self.rng.sample(current, min(2, len(current))) if ok else []:
            self.flag_memory("consent_memory", tenant, cv, self.rng.random() < 0.6)
        user, value = self.rng.choice(subjects_of(tenant)), self.rng.random() < 0.5
        t0 = time.time()
        done, _ = self.attempt(
            "consent_subject",
            partial(self.store.set_do_not_sell, tenant_id=tenant, user_id=user, subject=user, value=value),
        )
        if done:
            log_consent(self.log, tenant, "subject_dns", user, value, t0)
        # Every other change (the first included) is in the team only consent changes touch.
        self.consent_changes = getattr(self, "consent_changes", 0) + 1
        ok, teams = self.attempt("list_teams", lambda: self.store.teams(tenant_id=tenant))
        if not ok:
            return
        if tenant == RESTORE_TENANT and self.consent_changes % 2:
            # A removal whenever one is possible: that is the change a restore could undo.
            present = [u for u in CONSENT_MEMBERS if u in teams.get(CONSENT_TEAM, [])]
            team, user = CONSENT_TEAM, self.rng.choice(present or CONSENT_MEMBERS)
        else:
            team, members = self.rng.choice(sorted(teams_of(tenant).items()))
            user = self.rng.choice(members)
        t0 = time.time()
        if user in teams.get(team, []):
            done, _ = self.attempt(
                "member_remove", partial(self.store.remove_team_member, tenant_id=tenant, team_id=team, user_id=user)
            )
            if done:
                log_consent(self.log, tenant, "member", f"{team}/{user}", False, t0)
        else:
            done, res = self.attempt(
                "member_add", partial(self.store.add_team_member, tenant_id=tenant, team_id=team, user_id=user)
            )
            if done and res["added"]:
                log_consent(self.log, tenant, "member", f"{team}/{user}", True, t0)

    def sweep(self, tenant: str) -> None:
        def backdate() -> int:
            # A sweep only takes days that have ended: age this tenant's travel memories by three days.
            with self.store.transaction() as conn:
                return conn.execute(
                    "UPDATE memory.memories m SET created_at = now() - interval '3 days'"
                    " FROM memory.memory_versions v WHERE m.tenant_id = %s AND v.tenant_id = m.tenant_id"
                    " AND v.memory_id = m.memory_id AND v.version = m.current_version AND v.category = 'travel'"
                    " AND m.created_at > now() - interval '1 day'",
                    (tenant,),
                ).rowcount

        self.attempt("retention_backdate", backdate)
        day = (datetime.now(UTC) - timedelta(days=1)).date()
        t0 = time.time()
        ok, result = self.attempt(
            "retention_sweep",
            lambda: retention.sweep(self.service, day=day, policies=RETENTION_POLICIES, tenant_id=tenant, run=False),
        )
        if ok:
            self.log.emit(
                "swept",
                tenant=tenant,
                job_ids=[entry["job_id"] for entry in result["jobs"].values()],
                immediate=result["immediate_forget_jobs"].get(tenant, 0),
                t0=t0,
                t1=time.time(),
            )

    def restore(self, tenant: str) -> None:
        if not self.backup_ids:
            self.tally.notes["restore skipped: no backup yet"] += 1
            return
        backup_id = self.rng.choice(self.backup_ids)
        self.change_consent(tenant)
        # Writers pile onto the tenant: a restore must never meet a write that began before it
        # closed the tenant (section 9), so give it plenty of writes in flight at that moment.
        for q in (self.ipc.writer_hints, self.ipc.bulk_hints):
            q.put(("hammer", tenant, time.time() + 3.0))
        self.pause(1.0)
        self.restore_logged(tenant, backup_id)

    def restore_logged(self, tenant: str, backup_id: str) -> bool:
        """Restore `backup_id`, logged for the oracle; True when COMPLETE. A restore that did not
        complete keeps the gate closed; the soak goes on with the rows as they were (the operator's
        `restore --reopen`)."""
        assert self.backups is not None
        backups = self.backups
        t0 = time.time()
        ok, report = self.attempt(
            "restore", lambda: backups.restore(tenant_id=tenant, backup_id=backup_id, lock_timeout=20)
        )
        state = report.get("state") if ok else f"failed: {type(report).__name__}"
        self.log.emit("restored", tenant=tenant, backup_id=backup_id, state=state, t0=t0, t1=time.time())
        self.tally.notes[f"restore {state}"] += 1
        if state != "COMPLETE":
            self.attempt("restore_reopen", lambda: backups.reopen(tenant_id=tenant))
            return False
        return True

    # -- issue 20: retention, then restores of older and newer backups -------------------------------

    def retention_between_restores(self, tenant: str) -> None:
        """M v1 (past its retention) -> backup B1 -> M v2 -> backup B2 -> restore B1 (drops v2) -> the
        sweep of yesterday removes M -> restore B2 -> restore B1. No restore after the sweep, of the
        newer backup (the only one holding v2) or of the older, may bring any version of M back:
        checked here after each restore and by the oracle (event `swept_then_restored`)."""
        assert self.backups is not None
        user = self.rng.choice(subjects_of(tenant))
        first = self.rr_write(tenant, user, None)
        if first is None:
            return
        memory_id = first.memory_id

        def backdate() -> int:
            with self.store.transaction() as conn:
                return conn.execute(
                    "UPDATE memory.memories SET created_at = now() - interval '3 days'"
                    " WHERE tenant_id = %s AND memory_id = %s",
                    (tenant, memory_id),
                ).rowcount

        older = self.rr_backup(tenant) if self.attempt("rr_backdate", backdate)[0] else None
        second = self.rr_write(tenant, user, memory_id) if older else None
        newer = self.rr_backup(tenant) if second else None
        if older is None or newer is None or not self.rr_restore(tenant, older, memory_id, after_sweep=False):
            self.tally.notes["retention_restores: stopped before the sweep"] += 1
            return
        day = (datetime.now(UTC) - timedelta(days=1)).date()
        t0 = time.time()
        ok, result = self.attempt(
            "retention_restores_sweep",
            lambda: retention.sweep(self.service, day=day, policies=RETENTION_POLICIES, tenant_id=tenant, run=False),
        )
        job_ids = [entry["job_id"] for entry in result["jobs"].values()] if ok else []
        self.log.emit("swept", tenant=tenant, job_ids=job_ids, immediate=0, t0=t0, t1=time.time())
        swept = ok and self.rr_hidden(tenant, memory_id)
        if not swept:
            self.tally.notes["retention_restores: the memory was not swept"] += 1
            return
        ids = job_ids + result["immediate_forget_job_ids"].get(tenant, [])
        self.run_batch("retention_restores_run_batch", tenant, ids)
        for backup_id in (newer, older):
            self.rr_restore(tenant, backup_id, memory_id, after_sweep=True)
        self.log.emit(
            "swept_then_restored",
            tenant=tenant,
            memory_id=memory_id,
            job_ids=job_ids,
            backups=[older, newer],
            t=time.time(),
        )
        self.tally.ops["retention_restores"] += 1

    def rr_write(self, tenant: str, user: str, memory_id: str | None) -> Any:
        """A travel memory of `user` (a new one, or a new version of `memory_id`), logged for the oracle."""
        key, text, _ = self.new_text(tenant, user, None)
        t0 = time.time()
        ok, res = self.attempt(
            "rr_write",
            partial(
                self.store.write, tenant_id=tenant, user_id=user, text=text, memory_id=memory_id, category="travel"
            ),
        )
        if not ok or not res.changed:
            return None
        op = "write" if memory_id is None else "write_version"
        self.log_write(
            op,
            t0,
            tenant=tenant,
            memory_id=res.memory_id,
            version=res.version,
            author=user,
            team=None,
            text=text,
            tpl=key,
            category="travel",
        )
        return res

    def rr_backup(self, tenant: str) -> str | None:
        assert self.backups is not None
        ok, manifest = self.attempt("backup", partial(self.backups.backup, tenant_id=tenant))
        if not ok:
            return None
        self.backup_ids.append(manifest["backup_id"])  # later restores of the tenant may pick it too
        self.log.emit("backup", tenant=tenant, backup_id=manifest["backup_id"], t=time.time())
        return str(manifest["backup_id"])

    def rr_restore(self, tenant: str, backup_id: str, memory_id: str, *, after_sweep: bool) -> bool:
        """Restore `backup_id` (logged as every restore is); after the sweep, the memory has no version."""
        if not self.restore_logged(tenant, backup_id):
            return False
        if after_sweep:
            self.tally.checks["rule:swept_memory_stays_gone_after_restore"] += 1
            versions = self.rr_versions(tenant, memory_id)
            if versions:
                self.tally.violation(
                    "swept_memory_back_after_restore",
                    key=f"{memory_id}|{backup_id}",
                    tenant=tenant,
                    memory_id=memory_id,
                    backup_id=backup_id,
                    versions=versions,
                    t=round(self.now(), 2),
                )
        return True

    def rr_versions(self, tenant: str, memory_id: str) -> list[int] | None:
        """The memory's version numbers in the primary (None: could not be read)."""

        def read() -> list[int]:
            with self.store.transaction() as conn:
                rows = conn.execute(
                    "SELECT version FROM memory.memory_versions WHERE tenant_id = %s AND memory_id = %s ORDER BY 1",
                    (tenant, memory_id),
                ).fetchall()
            return [int(r[0]) for r in rows]

        ok, versions = self.attempt("rr_versions", read)
        return versions if ok else None

    def rr_hidden(self, tenant: str, memory_id: str) -> bool:
        """Whether every version of the memory is tombstoned (the sweep took it)."""

        def read() -> bool:
            with self.store.transaction() as conn:
                row = conn.execute(
                    "SELECT count(*) = 0 FROM memory.memory_versions v WHERE v.tenant_id = %s AND v.memory_id = %s"
                    " AND NOT EXISTS (SELECT 1 FROM control.tombstones t WHERE t.tenant_id = v.tenant_id"
                    " AND t.memory_id = v.memory_id AND t.version = v.version)",
                    (tenant, memory_id),
                ).fetchone()
            return bool(row and row[0])

        ok, hidden = self.attempt("rr_hidden", read)
        return bool(ok and hidden)

    def drain(self) -> None:
        """After the racing phase: run every open job (retrying BLOCKED ones) so they can complete."""
        tenants = set(self.mine) | (set(self.cfg.doomed) if self.role == "deleter-a" else set())
        deadline = time.time() + self.cfg.drain_seconds
        for _ in range(4):
            open_now = [t for t in sorted(tenants) if self.run_open(t, kind="final_run_batch")]
            if not open_now or time.time() > deadline:
                break


# -- the oracle -------------------------------------------------------------------------------------


@dataclass
class WriteRec:
    op: str
    tenant: str
    memory_id: str
    version: int
    author: str
    team: str | None
    canary: str | None
    text: str
    tpl: str
    t0: float
    t1: float
    restored_from: int | None

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.tenant, self.memory_id, self.version)


@dataclass
class Job:
    job_id: str
    tenant: str
    scope: str
    subject: str | None
    memory_id: str | None
    version: int | None
    basis: str
    created_at: float
    completed_at: float
    targets: set[Source]
    canaries: set[str] = field(default_factory=set)
    covered: list[WriteRec] = field(default_factory=list)  # see Oracle.covered; refreshed at every check
    reused: set[Source] = field(default_factory=set)  # targets whose number a later write took again

    @property
    def covered_pairs(self) -> set[Source]:
        return {(w.memory_id, w.version) for w in self.covered}


_PAIRS = "JOIN unnest(%s::text[], %s::int[]) AS w(m, v)"
_EXACT = {
    "primary": "SELECT x.memory_id, x.version, x.text_ct FROM memory.memory_versions x "
    + _PAIRS
    + " ON x.memory_id = w.m AND x.version = w.v WHERE x.tenant_id = %s",
    "keyword_index": "SELECT DISTINCT x.memory_id, x.version FROM derived.keyword_postings x "
    + _PAIRS
    + " ON x.memory_id = w.m AND x.version = w.v WHERE x.tenant_id = %s",
    "lineage": "SELECT x.store, x.record_id, x.source_memory_id, x.source_version FROM derived.lineage x "
    + _PAIRS
    + " ON x.source_memory_id = w.m AND x.source_version = w.v WHERE x.tenant_id = %s",
    "recall_cache": "SELECT DISTINCT e->>0, (e->>1)::int FROM derived.recall_cache c"
    " CROSS JOIN LATERAL jsonb_array_elements(c.results) e "
    + _PAIRS
    + " ON e->>0 = w.m AND (e->>1)::int = w.v WHERE c.tenant_id = %s",
}
_TENANT_LEFT = {
    "memory.memories": "SELECT count(*) FROM memory.memories WHERE tenant_id = %s",
    "memory.memory_versions": "SELECT count(*) FROM memory.memory_versions WHERE tenant_id = %s",
    "memory.subjects": "SELECT count(*) FROM memory.subjects WHERE tenant_id = %s",
    "memory.teams": "SELECT count(*) FROM memory.teams WHERE tenant_id = %s",
    "memory.team_members": "SELECT count(*) FROM memory.team_members WHERE tenant_id = %s",
    "derived.keyword_postings": "SELECT count(*) FROM derived.keyword_postings WHERE tenant_id = %s",
    "derived.lineage": "SELECT count(*) FROM derived.lineage WHERE tenant_id = %s",
    "derived.summaries": "SELECT count(*) FROM derived.summaries WHERE tenant_id = %s",
    "derived.prompt_snapshots": "SELECT count(*) FROM derived.prompt_snapshots WHERE tenant_id = %s",
    "derived.recall_cache": "SELECT count(*) FROM derived.recall_cache WHERE tenant_id = %s",
    "keystore.tenant_keys": "SELECT count(*) FROM keystore.tenant_keys WHERE tenant_id = %s",
    "keystore.subject_keys": "SELECT count(*) FROM keystore.subject_keys WHERE tenant_id = %s",
    "keystore.team_keys": "SELECT count(*) FROM keystore.team_keys WHERE tenant_id = %s",
}


def _source(record_id: str) -> Source:
    memory_id, _, version = record_id.rpartition(":")
    return memory_id, int(version)


def _opens(key: bytes, ct: bytes, aad: bytes) -> bool:
    try:
        crypto.open_sealed(key, ct, aad)
    except crypto.DecryptionError:
        return False
    return True


def pair_arrays(sources: Iterable[Source]) -> tuple[list[str], list[int]]:
    listed = sorted(sources)
    return [m for m, _ in listed], [v for _, v in listed]


def scan_for_canaries(root: Path) -> tuple[dict[str, set[str]], int, int]:
    """canary -> files under `root` holding it as raw bytes; plus files and bytes read."""
    found: dict[str, set[str]] = {}
    files = size = 0
    for folder, _, names in os.walk(root):  # os.walk ignores folders that vanish mid-walk
        for name in names:
            path = Path(folder) / name
            try:
                if path.is_symlink() or not path.is_file():
                    continue
                data = path.read_bytes()
            except OSError:
                continue
            files += 1
            size += len(data)
            if b"cnry" not in data:  # a fast substring test first; the regex only where it can match
                continue
            for match in CANARY_BYTES.finditer(data):
                found.setdefault(match.group().decode(), set()).add(str(path.relative_to(root)))
    return found, files, size


class Oracle(Worker):
    """The long-lived checker. Its MemoryStore (and key cache) lives for the whole soak and has
    decrypted every version when it was written; a second store with a cleared cache reads
    summaries and snapshots as a fresh process would."""

    def prepare(self) -> None:
        super().prepare()
        self.fresh = MemoryStore(self.cfg.conninfo, KeyStore(master_key(self.settings)))
        self.tail = LogTail(self.cfg.logdir)
        # Every logged write, indexed the ways the checks look them up.
        self.recs: dict[tuple[str, str, int], list[WriteRec]] = {}
        self.by_canary: dict[str, list[WriteRec]] = {}
        self.by_author: dict[tuple[str, str], list[WriteRec]] = {}
        self.by_memory: dict[tuple[str, str], list[WriteRec]] = {}
        self.by_tenant: dict[str, list[WriteRec]] = {}
        self.rollbacks: dict[tuple[str, str, int], list[WriteRec]] = {}  # by the version they copied
        self.kept: dict[tuple[str, str, int], tuple[str, bytes]] = {}  # ciphertext seen before any deletion
        self.accepted: dict[str, float] = {}  # job -> earliest moment a requester saw it accepted
        self.sweeps: list[dict[str, Any]] = []
        self.jobs: dict[str, Job] = {}
        self.dead: set[str] = set()  # canaries of COMPLETE jobs with no carrier left anywhere
        self.unfetched: list[WriteRec] = []
        # Ciphertext of each version as stored, by (tenant, memory, version, canary): one incarnation of
        # a version number (read right after the write and decrypted, so the canary names which).
        self.ct_of: dict[tuple[str, str, int, str], bytes] = {}
        # Consent and access changes that committed, by (tenant, kind, key), and restores to check against them.
        self.consent: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        self.restored: list[dict[str, Any]] = []
        self.next_content = 0.0
        self.next_scan = 0.0
        self.scan_seconds = 0.0

    def run(self) -> None:
        while not self.ipc.final.is_set() and os.getppid() == self.parent:
            started = time.monotonic()
            self.step("ingest", self.ingest)
            self.step("check_new_jobs", self.check_new_jobs)
            self.step("after_restores", self.after_restores)
            now = time.monotonic()
            if now >= self.next_content:
                self.step("content_checks", self.content_checks)
                self.next_content = time.monotonic() + 4.0
            if now >= self.next_scan:
                self.step("byte_scan", self.byte_scan)
                # At most a fifth of the oracle's time goes to scanning; every 6 s when it is cheap.
                self.next_scan = time.monotonic() + max(6.0, 5 * self.scan_seconds)
            self.ipc.final.wait(max(0.0, 0.4 - (time.monotonic() - started)))
        self.final_pass()

    def step(self, name: str, fn: Callable[[], Any]) -> bool:
        """Run one oracle step. A documented refusal (tenant being restored, Chroma mid-rebuild)
        defers it; any other exception raised through the library is a finding, and the oracle
        goes on checking."""
        try:
            fn()
        except (MemoryPipelinesError, psycopg.OperationalError) as exc:
            self.tally.notes[f"{name} deferred: {_reason(exc)}"] += 1
            return False
        except Exception as exc:
            self.tally.violation(
                "unexpected_exception",
                key=f"oracle:{name}|{_reason(exc)}",
                op=f"oracle:{name}",
                error=f"{type(exc).__module__}.{type(exc).__name__}: {str(exc)[:300]}",
                traceback=traceback.format_exc(limit=8)[-2500:],
                t=round(self.now(), 2),
            )
            return False
        return True

    # -- what happened ---------------------------------------------------------------------------

    def ingest(self) -> None:
        for rec in self.tail.read():
            ev = rec["ev"]
            if ev == "write":
                w = WriteRec(
                    rec["op"],
                    rec["tenant"],
                    rec["memory_id"],
                    rec["version"],
                    rec["author"],
                    rec["team"],
                    rec["canary"],
                    rec["text"],
                    rec["tpl"],
                    rec["t0"],
                    rec["t1"],
                    rec.get("restored_from"),
                )
                self.recs.setdefault(w.key, []).append(w)
                if w.canary:
                    self.by_canary.setdefault(w.canary, []).append(w)
                self.by_author.setdefault((w.tenant, w.author), []).append(w)
                self.by_memory.setdefault((w.tenant, w.memory_id), []).append(w)
                self.by_tenant.setdefault(w.tenant, []).append(w)
                if w.op == "rollback" and w.restored_from is not None:
                    self.rollbacks.setdefault((w.tenant, w.memory_id, w.restored_from), []).append(w)
                self.unfetched.append(w)
            elif ev == "accepted":
                self.accepted[rec["job_id"]] = min(rec["t1"], self.accepted.get(rec["job_id"], rec["t1"]))
            elif ev == "swept":
                self.sweeps.append(rec)
            elif ev == "restored":
                # A restore must not resurrect anything forgotten: every COMPLETE job of it, again.
                self.recheck(rec["tenant"], why="restore")
                if rec["state"] == "COMPLETE":
                    self.restored.append(rec)  # its files and the consent changes: checked after ingesting
            elif ev == "swept_then_restored":
                self.note_swept_then_restored(rec)
            elif ev == "consent":
                self.consent.setdefault((rec["tenant"], rec["kind"], rec["key"]), []).append(rec)
        self.fetch_and_decrypt()

    def fetch_and_decrypt(self) -> None:
        """Read each new version's ciphertext and decrypt it with the long-lived store, as a
        serving process would: its key cache is warm before any deletion of that subject."""
        by_tenant: dict[str, list[WriteRec]] = {}
        for w in self.unfetched:
            by_tenant.setdefault(w.tenant, []).append(w)
        self.unfetched = []
        for tenant, recs in by_tenant.items():
            wanted = {(w.memory_id, w.version) for w in recs}
            try:
                with self.store.transaction() as conn:
                    rows = conn.execute(
                        "SELECT x.memory_id, x.version, x.key_id, x.text_ct FROM memory.memory_versions x "
                        + _PAIRS
                        + " ON x.memory_id = w.m AND x.version = w.v WHERE x.tenant_id = %s",
                        (*pair_arrays(wanted), tenant),
                    ).fetchall()
                for memory_id, version, key_id, text_ct in rows:
                    self.kept.setdefault((tenant, memory_id, version), (key_id, bytes(text_ct)))
                texts = self.store.open_texts(
                    tenant_id=tenant, sources=sorted((m, v) for m, v, _, _ in rows), skip_unreadable=True
                )
                for memory_id, version, _, text_ct in rows:
                    found = CANARY.search(texts.get((memory_id, version), ""))
                    if found:
                        self.ct_of.setdefault((tenant, memory_id, version, found.group()), bytes(text_ct))
            except MemoryPipelinesError:
                self.tally.notes["decrypt_before: store busy, skipped"] += 1
                continue
            self.tally.checks["decrypt_before"] += len(texts)
            self.tally.notes["decrypt_before: gone before the oracle read it"] += len(wanted) - len(rows)

    # -- jobs ---------------------------------------------------------------------------------------

    def check_new_jobs(self) -> None:
        with self.store.transaction() as conn:
            rows = conn.execute(
                "SELECT job_id, tenant_id, scope, subject_id, memory_id, version, basis,"
                " extract(epoch from created_at), extract(epoch from completed_at)"
                " FROM control.deletion_jobs WHERE state = 'COMPLETE' AND NOT (job_id = ANY(%s))"
                " ORDER BY completed_at",
                (sorted(self.jobs),),
            ).fetchall()
            jobs = []
            for job_id, tenant, scope, subject, memory_id, version, basis, created, completed in rows:
                targets = {
                    (m, v)
                    for m, v in conn.execute(
                        "SELECT memory_id, version FROM control.deletion_targets WHERE job_id = %s", (job_id,)
                    )
                }
                jobs.append(
                    Job(
                        job_id,
                        tenant,
                        scope,
                        subject,
                        memory_id,
                        version,
                        basis,
                        float(created),
                        float(completed),
                        targets,
                    )
                )
        for job in jobs:
            self.jobs[job.job_id] = job
        self.check_jobs(jobs, probes=8)

    def recheck(self, tenant: str, *, why: str) -> None:
        """After a restore: the primary, the rules and the keys of every COMPLETE job of the tenant
        (a restore loads primary rows only; the derived stores are checked at the end)."""
        jobs = [job for job in self.jobs.values() if job.tenant == tenant]
        self.tally.checks[f"recheck_after_{why}"] += len(jobs)
        self.check_jobs(jobs, probes=0, derived=False)

    def accepted_at(self, job: Job) -> float | None:
        """When a requester saw the job accepted (its acceptance committed before that)."""
        if job.job_id in self.accepted:
            return self.accepted[job.job_id]
        for sweep in self.sweeps:  # a retention sweep's jobs: accepted before the sweep returned
            if sweep["tenant"] == job.tenant and sweep["t0"] - 1 <= job.created_at <= sweep["t1"]:
                return float(sweep["t1"])
        return None

    def covered(self, job: Job) -> list[WriteRec]:
        """Logged versions this job must have removed, beyond its fixed targets: everything the
        subject (or tenant) wrote, and every version of a wholly forgotten memory, committed before
        the job completed (a write that returned before COMPLETE was committed before it)."""
        pool: list[WriteRec] = []
        if job.scope == "SUBJECT":
            pool = self.by_author.get((job.tenant, job.subject or ""), [])
        elif job.scope == "TENANT":
            pool = self.by_tenant.get(job.tenant, [])
        elif self.whole_memories(job):
            pool = [w for m in self.whole_memories(job) for w in self.by_memory.get((job.tenant, m), [])]
        return [w for w in pool if w.t1 < job.completed_at]

    @staticmethod
    def whole_memories(job: Job) -> list[str]:
        """Memories a job forgets with every version (MEMORY without a version, RETENTION)."""
        if job.scope == "RETENTION" or (job.scope == "MEMORY" and job.version is None):
            return sorted({m for m, _ in job.targets} | ({job.memory_id} if job.memory_id else set()))
        return []

    def check_jobs(self, jobs: list[Job], *, probes: int, derived: bool = True) -> None:
        """Every check of these COMPLETE jobs, batched: one query per table and tenant whatever the
        number of jobs (a restore re-checks every job of its tenant, the final pass every job)."""
        by_tenant: dict[str, list[Job]] = {}
        for job in jobs:
            self.prepare_job(job)
            by_tenant.setdefault(job.tenant, []).append(job)
        for tenant, group in sorted(by_tenant.items()):
            self.step("check_primary", partial(self.check_primary, tenant, group))
            if derived:
                self.step("check_derived", partial(self.check_derived, tenant, group))
            self.step("check_decrypt", partial(self.check_decrypt, tenant, group))
        for job in jobs:
            self.tally.checks["jobs_checked"] += 1
            self.check_log_rules(job)
            if job.scope == "TENANT":
                self.step("check_tenant_empty", partial(self.check_tenant_empty, job))
            if probes:
                self.step("check_probes", partial(self.check_probes, job, probes))

    def prepare_job(self, job: Job) -> None:
        job.covered = self.covered(job)
        # A version number can be written more than once (a restore rolls numbers back): the target is
        # the incarnation that existed when the job was accepted, the last one written before that.
        before = self.accepted_at(job) or job.completed_at
        for m, v in job.targets:
            earlier = [w for w in self.recs.get((job.tenant, m, v), []) if w.t1 < before]
            if earlier and earlier[-1].canary:
                job.canaries.add(str(earlier[-1].canary))
        job.canaries |= {w.canary for w in job.covered if w.canary}

    def v(self, kind: str, job: Job, item: str, **detail: Any) -> None:
        self.tally.violation(
            kind,
            key=f"{job.job_id}|{item}",
            job=job.job_id,
            scope=job.scope,
            tenant=job.tenant,
            subject=job.subject,
            memory_id=job.memory_id,
            version=job.version,
            t=round(self.now(), 2),
            **detail,
        )

    def check_primary(self, tenant: str, group: list[Job]) -> None:
        """The primary: no target row left; nothing the scope covers survives (a version committed
        before COMPLETE that is not gone was written while the scope was being forgotten, or came
        back with a restore); a wholly forgotten memory has no version at all."""
        pairs = set().union(*(job.targets | job.covered_pairs for job in group))
        memories = sorted(set().union(*(self.whole_memories(job) for job in group)))
        with self.store.transaction() as conn:
            rows = conn.execute(_EXACT["primary"], (*pair_arrays(pairs), tenant)).fetchall() if pairs else []
            versions = (
                conn.execute(
                    "SELECT memory_id, version FROM memory.memory_versions WHERE tenant_id = %s"
                    " AND memory_id = ANY(%s)",
                    (tenant, memories),
                ).fetchall()
                if memories
                else []
            )
        alive = {(m, v): bytes(ct) for m, v, ct in rows}
        for job in group:
            self.tally.checks["exact_id:primary"] += len(job.targets)
            for memory_id, version in sorted(job.targets & alive.keys()):
                kept = self.kept.get((tenant, memory_id, version))
                later = [w for w in self.recs.get((tenant, memory_id, version), []) if w.t0 > job.completed_at]
                reused = bool(later) or (kept is not None and kept[1] != alive[(memory_id, version)])
                if reused:
                    job.reused.add((memory_id, version))
                self.v(
                    "version_number_reused" if reused else "exact_id:primary",
                    job,
                    f"{memory_id}:{version}",
                    record=f"{memory_id}:{version}",
                    detail="a new version took the number of a forgotten one (its tombstone hides it)"
                    if reused
                    else "the forgotten version's row is still there",
                )
            accepted = self.accepted_at(job)
            self.tally.checks["rule:covered_versions_gone"] += len(job.covered_pairs)
            for w in job.covered:
                source = (w.memory_id, w.version)
                if source in alive and source not in job.targets:
                    self.v(
                        "survived_its_forget",
                        job,
                        f"{w.memory_id}:{w.version}",
                        record=f"{w.memory_id}:{w.version}",
                        written_by=w.op,
                        author=w.author,
                        wrote_from_acceptance=None if accepted is None else round(w.t0 - accepted, 3),
                        committed_before_complete=round(job.completed_at - w.t1, 3),
                    )
            mine = set(self.whole_memories(job))
            self.tally.checks["rule:forgotten_memory_has_no_version"] += len(mine)
            for memory_id, version in versions:
                if memory_id in mine:
                    by = [w.op for w in self.recs.get((tenant, memory_id, version), [])]
                    self.v(
                        "forgotten_memory_has_a_version",
                        job,
                        f"{memory_id}:{version}",
                        record=f"{memory_id}:{version}",
                        written_by=by,
                    )

    def check_derived(self, tenant: str, group: list[Job]) -> None:
        """Exact ids in every derived store (PostgreSQL tables, Chroma, the analytics partition) of the
        targets and of every other version the scope covers: one a restore removed before the job
        fixed its targets still had derived records, and the forget must not leave them behind."""
        pairs = set().union(*(job.targets | job.covered_pairs for job in group))
        if not pairs:
            return
        with self.store.transaction() as conn:
            found = {
                name: conn.execute(query, (*pair_arrays(pairs), tenant)).fetchall()
                for name, query in _EXACT.items()
                if name != "primary"
            }
        chroma: set[Source] | None = None
        try:
            col = self.derived.vectors.existing(tenant)
            ids = sorted(f"{m}:{v}" for m, v in pairs)
            chroma = set()
            for start in range(0, len(ids), 2000):
                if col is not None:
                    chroma |= {_source(r) for r in col.get(ids=ids[start : start + 2000], include=[])["ids"]}
        except Exception as exc:  # Chroma mid-rebuild: checked again at the next restore and at the end
            self.tally.notes[f"chroma check deferred: {type(exc).__name__}"] += 1
            chroma = None
        analytics: set[Source] | None = None
        try:
            table = self.derived.analytics.read_partition(tenant)
            analytics = (
                set(zip(table["memory_id"].to_pylist(), table["version"].to_pylist(), strict=True))
                if table is not None
                else set()
            )
        except Exception as exc:  # the partition replaced mid-read
            self.tally.notes[f"analytics check deferred: {type(exc).__name__}"] += 1
        hits: dict[str, set[Source]] = {name: {(str(r[-2]), int(r[-1])) for r in rows} for name, rows in found.items()}
        if chroma is not None:
            hits["chroma"] = chroma
        if analytics is not None:
            hits["analytics"] = analytics & pairs
        for job in group:
            mine = job.targets | job.covered_pairs
            for name, sources in hits.items():
                self.tally.checks[f"exact_id:{name}"] += len(mine)
                left = sorted(sources & mine)
                if left:
                    of = "target" if set(left) <= job.targets else "covered by the scope, not a fixed target"
                    sample = [f"{m}:{v}" for m, v in left[:4]]
                    self.v(f"exact_id:{name}", job, name, count=len(left), of=of, sample=sample)

    def check_decrypt(self, tenant: str, group: list[Job]) -> None:
        """Decrypt attempts from this long-lived process, whose key cache was warm before the jobs."""
        targets = set().union(*(job.targets for job in group))
        texts = self.store.open_texts(tenant_id=tenant, sources=sorted(targets), skip_unreadable=True)
        for job in group:
            self.tally.checks["decrypt:targets_unreadable"] += len(job.targets)
            # The text the target had when the job was accepted (restores and forgets can let a number
            # be written again later: that is reported by check_primary, not here).
            before = self.accepted_at(job) or job.completed_at
            forgotten = sorted(
                source
                for source in (job.targets & texts.keys()) - job.reused
                if [w.text for w in self.recs.get((tenant, *source), []) if w.t1 < before][-1:] == [texts[source]]
            )
            if forgotten:
                sample = [f"{m}:{v}" for m, v in forgotten[:3]]
                self.v("decrypt:forgotten_text_readable", job, "texts", count=len(forgotten), sample=sample)
        shredding = [job for job in group if job.scope in ("SUBJECT", "TENANT")]
        if not shredding:
            return
        # Their keys are destroyed: the cache of a process that used them must not outlive that.
        sealed: dict[str, dict[str, tuple[bytes, str, int]]] = {}  # job -> key id -> a ciphertext under it
        for job in shredding:
            mine: dict[str, tuple[bytes, str, int]] = {}
            for m, v in sorted(job.targets | job.covered_pairs):
                if (tenant, m, v) in self.kept:
                    key_id, ct = self.kept[(tenant, m, v)]
                    mine.setdefault(key_id, (ct, m, v))
            sealed[job.job_id] = mine
        usable: dict[str, bytes] = {}
        key_ids = sorted(set().union(*(set(mine) for mine in sealed.values())))
        with self.store.transaction() as conn:
            stored = {
                r[0]
                for r in conn.execute(
                    "SELECT key_id FROM keystore.subject_keys WHERE tenant_id = %s AND key_id = ANY(%s)",
                    (tenant, key_ids),
                )
            }
            for key_id in key_ids:
                try:
                    usable[key_id] = self.store.keys.key_by_id(conn, tenant, key_id)
                except NotFoundError:
                    continue
            current = {}
            for job in shredding:
                if job.scope == "SUBJECT" and job.subject is not None:
                    try:
                        current[job.job_id] = self.store.keys.subject_key(conn, tenant, job.subject, create=False)[1]
                    except NotFoundError:
                        pass
        for job in shredding:
            for key_id, (ct, m, v) in sorted(sealed[job.job_id].items()):
                self.tally.checks["decrypt:destroyed_key_refused"] += 1
                aad = crypto.aad("memory-text", tenant, m, v)
                if key_id in usable:
                    self.v(
                        "decrypt:destroyed_key_still_usable",
                        job,
                        key_id,
                        key_id=key_id,
                        decrypted_forgotten_text=_opens(usable[key_id], ct, aad),
                        detail="the key store still holds this key"
                        if key_id in stored
                        else "key_by_id answered from this process's cache after the key was destroyed",
                    )
                if job.job_id in current:
                    self.tally.checks["decrypt:new_key_opens_nothing_old"] += 1
                    if _opens(current[job.job_id], ct, aad):
                        self.v("decrypt:old_ciphertext_opens_with_current_key", job, key_id, record=f"{m}:{v}")

    def check_tenant_empty(self, job: Job) -> None:
        """A deleted tenant keeps nothing: no row in any table, no vector, no analytics partition."""
        with self.store.transaction() as conn:
            left = {name: conn.execute(q, (job.tenant,)).fetchone()[0] for name, q in _TENANT_LEFT.items()}  # type: ignore[index]
        self.tally.checks["rule:deleted_tenant_empty"] += len(left)
        for name, count in left.items():
            if count:
                self.v("deleted_tenant_not_empty", job, name, table=name, rows=count)
        try:
            col = self.derived.vectors.existing(job.tenant)
            vectors = col.count() if col is not None else 0
        except Exception as exc:
            self.tally.notes[f"chroma check deferred: {type(exc).__name__}"] += 1
        else:
            self.tally.checks["rule:deleted_tenant_empty"] += 1
            if vectors:
                self.v("deleted_tenant_not_empty", job, "chroma", table="chroma collection", rows=vectors)
        if self.derived.analytics.read_partition(job.tenant) is not None:
            self.v("deleted_tenant_not_empty", job, "analytics", table="analytics partition", rows=-1)

    def check_log_rules(self, job: Job) -> None:
        """What the write log shows against the acceptance (section 9: every write path is ordered
        against it): writes that started after a requester saw the job accepted and returned before it
        completed were accepted while their scope was being forgotten; no rollback copies a version
        being forgotten forward."""
        accepted = self.accepted_at(job)
        if accepted is None:
            return
        for w in job.covered:
            self.tally.checks["rule:no_write_while_forgetting"] += 1
            if w.t0 > accepted and w.op != "seed":
                self.v(
                    "write_accepted_while_forgetting",
                    job,
                    f"write {w.memory_id}:{w.version}",
                    record=f"{w.memory_id}:{w.version}",
                    written_by=w.op,
                    author=w.author,
                    started_after_acceptance=round(w.t0 - accepted, 3),
                )
        for m, v in sorted(job.targets):
            for w in self.rollbacks.get((job.tenant, m, v), []):
                self.tally.checks["rule:no_rollback_of_forgotten"] += 1
                if w.t0 > accepted:
                    self.v(
                        "rollback_copied_forgotten_version",
                        job,
                        f"rollback {w.memory_id}:{w.version}",
                        record=f"{w.memory_id}:{w.version}",
                        copied=f"{w.memory_id}:{w.restored_from}",
                        started_after_acceptance=round(w.t0 - accepted, 3),
                    )

    def check_probes(self, job: Job, limit: int) -> None:
        """Paraphrase probes: the texts and their paraphrases against Chroma and the blind index,
        and a visible recall as the author, expecting no target and no forgotten canary."""
        recs = [
            w for m, v in sorted(job.targets) for w in self.recs.get((job.tenant, m, v), []) if w.t1 < job.completed_at
        ]
        if not recs or job.scope == "TENANT":
            return
        rng = random.Random(job.job_id)
        recs = rng.sample(recs, min(limit, len(recs)))
        texts = [w.text for w in recs] + [paraphrase(w.tpl, w.author, w.team) for w in recs]
        try:
            vectors = list(self.derived.vectors.embedder.embed(texts))
            nearest = self.derived.vectors.query_vectors(tenant_id=job.tenant, vectors=vectors, limit=10)
            hits = sorted({f"{m}:{v}" for row in nearest for m, v in row if (m, v) in job.targets})
            keyword_hits = self.derived.keywords.probe_hits(tenant_id=job.tenant, texts=texts, sources=job.targets)
        except MemoryPipelinesError as exc:
            self.tally.notes[f"probe deferred: {_reason(exc)}"] += 1
        else:
            self.tally.checks["probe:chroma"] += len(texts)
            self.tally.checks["probe:keyword"] += len(texts)
            if hits:
                self.v("probe:chroma", job, "chroma_probe", count=len(hits), sample=hits[:4])
            if keyword_hits:
                self.v("probe:keyword", job, "keyword_probe", postings=keyword_hits)
        for w in recs[:3]:
            for query in (w.text, paraphrase(w.tpl, w.author, w.team)):
                self.step("recall_probe", partial(self.recall_probe, job, w, query))

    def recall_probe(self, job: Job, w: WriteRec, query: str) -> None:
        """The author's own recall (their team's view for a team memory), bypassing the cache."""
        answer = self.derived.recaller.recall(
            tenant_id=job.tenant, user_id=w.author, team_id=w.team, query=query, k=10, use_cache=False
        )
        self.tally.checks["probe:recall"] += 1

        def carriers() -> set[Source]:
            return {(c.memory_id, c.version) for c in self.by_canary.get(w.canary or "", [])}

        for hit in answer:
            source = (hit["memory_id"], hit["version"])
            if source in job.targets:
                self.v("probe:recall_returned_forgotten", job, f"recall {source}", record=f"{source[0]}:{source[1]}")
            elif w.canary and w.canary in hit["text"] and source not in carriers():
                # A rollback copies text forward: only a copy nobody logged (after the logs settle)
                # states the forgotten text from somewhere it should not be.
                self.settle()
                if source not in carriers():
                    self.v(
                        "probe:recall_returned_forgotten",
                        job,
                        f"recall {source}",
                        record=f"{source[0]}:{source[1]}",
                        detail="the text, from a version nobody wrote",
                    )

    # -- content ------------------------------------------------------------------------------------

    def refresh_dead(self, candidates: set[str] | None = None) -> set[str]:
        """Canaries of COMPLETE jobs with no carrier version left now: no store may state them.

        Recomputed every time rather than accumulated: a restore may remove a carrier that no job
        forgot (it was written after the backup) and a later restore of a newer backup brings it back.
        """
        if candidates is None:
            self.dead = self.refresh_dead({c for job in self.jobs.values() for c in job.canaries})
            return self.dead
        carriers: dict[str, set[Source]] = {}
        for c in candidates:
            for w in self.by_canary.get(c, []):
                carriers.setdefault(w.tenant, set()).add((w.memory_id, w.version))
        alive: set[tuple[str, str, int]] = set()
        with self.store.transaction() as conn:
            for tenant, sources in carriers.items():
                for m, v, _ in conn.execute(_EXACT["primary"], (*pair_arrays(sources), tenant)).fetchall():
                    alive.add((tenant, m, v))
        return {c for c in candidates if not any(w.key in alive for w in self.by_canary.get(c, []))}

    def confirmed(self, canaries: set[str]) -> set[str]:
        """Those of `canaries` still without a carrier once the logs settled: a finding made while
        others race (a rollback copying the text forward a moment ago) is checked again."""
        if not canaries:
            return set()
        self.settle()
        return self.refresh_dead(set(canaries))

    def settle(self) -> None:
        """Let writers that have committed finish logging (they log right after), then read the logs."""
        if not self.ipc.final.is_set():
            time.sleep(0.3)
        self.ingest()

    def canary_jobs(self, canary: str) -> list[str]:
        return sorted(j.job_id for j in self.jobs.values() if canary in j.canaries)[:3]

    def content_checks(self) -> None:
        """Decrypt every summary and prompt snapshot as a fresh process would; none may state a
        forgotten canary (the summary rebuilt with forgotten text after COMPLETE)."""
        dead = self.refresh_dead()
        if not dead:
            return
        # Read, then decrypt, then confirm, each in transactions of their own: a transaction left
        # open while this process queries through another connection would queue a cascade's
        # VACUUM FULL behind it, and every other process behind that (a wait PostgreSQL cannot see).
        with self.fresh.transaction() as conn:
            summaries = conn.execute(
                "SELECT tenant_id, scope, scope_id, summary_ct, key_id FROM derived.summaries"
            ).fetchall()
            snapshots = conn.execute(
                "SELECT tenant_id, snapshot_id, prompt_ct, key_id FROM derived.prompt_snapshots"
            ).fetchall()
        self.fresh.keys.forget_cached()
        suspects: list[tuple[str, str, str, set[str]]] = []
        for tenant, scope, scope_id, ct, key_id in summaries:
            aad = crypto.aad("summary", tenant, scope, scope_id)
            text = self._open(tenant, key_id, bytes(ct), aad, team=scope_id if scope == "team" else None)
            self.tally.checks["content:summary"] += 1
            found = set(CANARY.findall(text or "")) & dead
            if found:
                suspects.append(("summary_states_forgotten_text", tenant, f"{scope}:{scope_id}", found))
        for tenant, snapshot_id, ct, key_id in snapshots:
            text = self._open(tenant, key_id, bytes(ct), crypto.aad("prompt-snapshot", tenant, snapshot_id))
            self.tally.checks["content:prompt_snapshot"] += 1
            found = set(CANARY.findall(text or "")) & dead
            if found:
                suspects.append(("snapshot_states_forgotten_text", tenant, snapshot_id, found))
        self.report_content(suspects)

    def report_content(self, suspects: list[tuple[str, str, str, set[str]]]) -> None:
        for kind, tenant, record, found in suspects:
            for c in sorted(self.confirmed(found)):
                self.tally.violation(
                    kind,
                    key=f"{tenant}|{record}|{c}",
                    tenant=tenant,
                    record=record,
                    canary=c,
                    jobs=self.canary_jobs(c),
                    t=round(self.now(), 2),
                )

    def _open(self, tenant: str, key_id: str, ct: bytes, aad: bytes, team: str | None = None) -> str | None:
        """Decrypt with the fresh store (its cache cleared before each pass); None when unreadable."""
        try:
            with self.fresh.transaction() as conn:
                if team is not None and not key_id.startswith("bk_"):  # a team summary from before build keys
                    found_id, key = self.fresh.keys.team_key(conn, tenant, team, create=False)
                    if found_id != key_id:
                        return None
                else:
                    key = self.fresh.keys.key_by_id(conn, tenant, key_id)
            return crypto.open_sealed(key, ct, aad).decode()
        except (MemoryPipelinesError, crypto.DecryptionError):
            self.tally.checks["content:unreadable"] += 1  # sealed under a destroyed key: shredded
            return None

    def byte_scan(self) -> None:
        """Every file under HOME, after a CHECKPOINT, for canaries as raw bytes: text is sealed
        everywhere at rest, so any plaintext canary is a leak, and a forgotten one doubly so."""
        started = time.monotonic()
        try:
            with psycopg.connect(self.cfg.conninfo, autocommit=True) as conn:
                conn.execute("CHECKPOINT")
        except psycopg.Error:
            self.tally.notes["checkpoint failed before a scan"] += 1
        dead = self.refresh_dead()
        found, files, size = scan_for_canaries(self.cfg.home)
        self.tally.checks["byte_scan:files"] += files
        self.tally.checks["byte_scan:passes"] += 1
        self.tally.checks["byte_scan:canaries_sought"] += len(dead)
        for canary, where in sorted(found.items()):
            if canary in dead and not self.confirmed({canary}):
                dead = dead - {canary}
            kind = "byte_scan:forgotten_canary_on_disk" if canary in dead else "byte_scan:plaintext_canary_on_disk"
            self.tally.violation(
                kind,
                key=canary,
                canary=canary,
                files=sorted(where)[:5],
                jobs=self.canary_jobs(canary),
                t=round(self.now(), 2),
            )
        self.scan_seconds = time.monotonic() - started
        self.tally.notes["byte_scan: MB in the last scan"] = round(size / 1e6)

    def primary_scan(self) -> None:
        """Every row left in the primary, decrypted: none may hold a forgotten canary."""
        dead = self.refresh_dead()
        with self.fresh.transaction() as conn:
            rows = conn.execute(
                "SELECT tenant_id, memory_id, version, key_id, text_ct FROM memory.memory_versions"
            ).fetchall()
        self.fresh.keys.forget_cached()
        suspects: list[tuple[str, str, str, set[str]]] = []
        for tenant, memory_id, version, key_id, ct in rows:
            text = self._open(tenant, key_id, bytes(ct), crypto.aad("memory-text", tenant, memory_id, version))
            self.tally.checks["content:primary_row"] += 1
            found = set(CANARY.findall(text or "")) & dead
            if found:
                suspects.append(("primary_states_forgotten_text", tenant, f"{memory_id}:{version}", found))
        self.report_content(suspects)

    def final_sync(self, tenant: str) -> None:
        ok, res = self.attempt("final_sync_all", lambda: self.derived.sync_all(tenant_id=tenant))
        if not ok:
            self.tally.notes[f"final sync_all skipped: {_reason(res)}"] += 1

    def final_opt_out(self, tenant: str) -> None:
        """One memory opted out of sale before the final rebuild, so the analytics check has a row to
        look for whatever the race left (its flags may all be off, or their memories forgotten)."""
        ok, current = self.attempt("list_current", lambda: self.store.current_versions(tenant_id=tenant))
        if not ok or not current:
            return
        self.flag_memory("consent_final_opt_out", tenant, self.rng.choice(current), True)

    def final_pass(self) -> None:
        """Everyone else has stopped: rebuild every derived store from what is left, then check every
        COMPLETE job again, every summary, snapshot and primary row, and every file."""
        for tenant in REGULAR:
            self.step("final_opt_out", partial(self.final_opt_out, tenant))
        self.step("ingest", self.ingest)
        for tenant in [*REGULAR, *self.cfg.doomed]:
            self.final_sync(tenant)
        self.step("check_new_jobs", self.check_new_jobs)
        # Exact ids, rules and decrypt attempts of every job again (probes ran at each first check:
        # after the rebuild, a resurrected vector or posting shows as an exact id anyway).
        self.tally.checks["final_recheck"] += len(self.jobs)
        self.check_jobs(list(self.jobs.values()), probes=0)
        self.step("after_restores", self.after_restores)
        for tenant in REGULAR:
            self.step("consent_final", partial(self.check_consent, tenant, before=time.time()))
            self.step("analytics_do_not_sell", partial(self.check_analytics_do_not_sell, tenant))
        self.step("content_checks", self.content_checks)
        self.step("primary_scan", self.primary_scan)
        self.step("byte_scan", self.byte_scan)
        self.step("gate_audit", self.gate_audit)
        self.step("swept_stay_gone", self.check_swept_stay_gone)
        self.tally.notes["dead canaries (forgotten, no carrier left)"] = len(self.dead)

    # -- restores after erasure; consent and access after restores ------------------------------------

    # -- issue 20: a memory swept between restores stays gone -------------------------------------

    def swept_between_restores(self) -> list[dict[str, Any]]:
        """Memories `Deleter.retention_between_restores` swept, then restored over (logged events)."""
        if not hasattr(self, "_swept_between_restores"):
            self._swept_between_restores: list[dict[str, Any]] = []
        return self._swept_between_restores

    def note_swept_then_restored(self, rec: dict[str, Any]) -> None:
        self.swept_between_restores().append(rec)
        self.step("swept_stay_gone", self.check_swept_stay_gone)

    def check_swept_stay_gone(self) -> None:
        """A memory a retention sweep removed has no version, now or at any later moment: a restore of
        a backup taken before the sweep (older or newer than a restore made before it) replays the
        sweep for every version of the memory, not only the versions the store held that day."""
        for rec in self.swept_between_restores():
            with self.store.transaction() as conn:
                versions = [
                    int(r[0])
                    for r in conn.execute(
                        "SELECT version FROM memory.memory_versions WHERE tenant_id = %s AND memory_id = %s",
                        (rec["tenant"], rec["memory_id"]),
                    )
                ]
            self.tally.checks["rule:swept_between_restores_stays_gone"] += 1
            if versions:
                self.tally.violation(
                    "swept_memory_back",
                    key=f"{rec['memory_id']}|{versions}",
                    tenant=rec["tenant"],
                    memory_id=rec["memory_id"],
                    job_ids=rec["job_ids"],
                    versions=versions,
                    t=round(self.now(), 2),
                )

    def after_restores(self) -> None:
        """For each COMPLETE restore logged since the last pass: its tenant's files, then its consent."""
        while self.restored:
            rec = self.restored.pop(0)
            self.step("erased_stay_erased", partial(self.check_erased_files, rec["tenant"]))
            self.step("consent_after_restore", partial(self.check_consent, rec["tenant"], before=rec["t0"]))

    def erased_jobs(self, tenant: str) -> set[str]:
        with self.store.transaction() as conn:
            rows = conn.execute(
                "SELECT job_id FROM control.deletion_jobs WHERE tenant_id = %s AND state = 'COMPLETE'"
                " AND erased_at IS NOT NULL",
                (tenant,),
            ).fetchall()
        return {r[0] for r in rows}

    def forgotten_incarnations(self, job: Job) -> list[tuple[str, str, int, str]]:
        """(tenant, memory, version, canary) of each version incarnation the job forgot: the one each
        target had when the job was accepted, and every version its scope covers. A version the job did
        not forget may carry the same text (a rollback copies it) and be dropped by a restore legitimately."""
        before = self.accepted_at(job) or job.completed_at
        found = []
        for m, v in sorted(job.targets):
            earlier = [w for w in self.recs.get((job.tenant, m, v), []) if w.t1 < before]
            if earlier and earlier[-1].canary:
                found.append((job.tenant, m, v, str(earlier[-1].canary)))
        found += [(job.tenant, w.memory_id, w.version, w.canary) for w in job.covered if w.canary]
        return found

    def check_erased_files(self, tenant: str) -> None:
        """No file of the tenant's PostgreSQL partitions holds the ciphertext of a forgotten version
        whose job is ERASED (before and after the scan), as an attacker reading HOME would look for it."""
        with psycopg.connect(self.cfg.conninfo, autocommit=True) as conn:
            conn.execute("CHECKPOINT")
        erased = self.erased_jobs(tenant)
        dead = self.refresh_dead()
        wanted: dict[bytes, str] = {}
        for job_id in sorted(erased):
            job = self.jobs.get(job_id)
            for key in self.forgotten_incarnations(job) if job is not None else []:
                if key[3] in dead and key in self.ct_of:
                    wanted[self.ct_of[key]] = key[3]
        if not wanted:
            return
        with self.store.transaction() as conn:
            files = postgres_files(conn, tenant)
        found: dict[str, set[str]] = {}
        for path in files:
            try:
                data = path.read_bytes()
            except OSError:
                continue  # rewritten while listed: the new file is in the next scan
            for ct, canary in wanted.items():
                if ct in data:
                    found.setdefault(canary, set()).add(path.name)
        self.tally.checks["byte_scan:erased_after_restore"] += len(wanted)
        still = erased & self.erased_jobs(tenant)
        for canary, where in sorted(found.items()):
            jobs = [j for j in sorted(still) if canary in self.jobs[j].canaries]
            if jobs and self.confirmed({canary}):
                self.tally.violation(
                    "byte_scan:erased_ciphertext_back_after_restore",
                    key=canary,
                    tenant=tenant,
                    canary=canary,
                    files=sorted(where)[:5],
                    jobs=jobs[:3],
                    t=round(self.now(), 2),
                )

    def check_consent(self, tenant: str, *, before: float) -> None:
        """Every do-not-sell flag and membership changed (and committed) before `before` (a restore's
        start, or the end of the soak) is as last changed: a restore restores content, never older
        consent or access. Keys changed since, or by overlapping changes, are not judged."""
        read_at = time.time()
        with self.store.transaction() as conn:
            memories = dict(
                conn.execute("SELECT memory_id, do_not_sell FROM memory.memories WHERE tenant_id = %s", (tenant,))
            )
            subjects = dict(
                conn.execute("SELECT user_id, do_not_sell FROM memory.subjects WHERE tenant_id = %s", (tenant,))
            )
            rows = conn.execute("SELECT team_id, user_id FROM memory.team_members WHERE tenant_id = %s", (tenant,))
            members = {f"{t}/{u}" for t, u in rows}
            forgets = conn.execute(
                "SELECT subject_id, extract(epoch from created_at) FROM control.deletion_jobs WHERE tenant_id = %s"
                " AND scope = 'SUBJECT'",
                (tenant,),
            ).fetchall()
        self.settle()  # changes that committed before the reads above are logged by now
        closed: list[tuple[str, str]] = []
        for (where, kind, key), entries in sorted(self.consent.items()):
            if where != tenant or not entries:
                continue
            ordered = sorted(entries, key=lambda e: e["t1"])
            last = ordered[-1]
            if last["t0"] >= before or last["t1"] >= before or not any(e["t1"] < before for e in ordered):
                continue
            if len(ordered) > 1 and ordered[-2]["t1"] > last["t0"]:
                continue  # two changes overlapped: which committed last is unknown
            if kind == "memory_dns":
                if key not in memories:
                    continue  # forgotten, or written after the restored backup: nothing to hold the flag
                actual: bool | None = bool(memories[key])
            elif kind == "subject_dns":
                actual = bool(subjects.get(key, False))
            else:
                user = key.split("/", 1)[1]
                if last["value"] and any(s == user and float(t) >= last["t0"] - 1 for s, t in forgets):
                    continue  # forgotten since it joined: the forget removes the membership
                actual = key in members
                if not last["value"]:
                    closed.append((key.split("/", 1)[0], user))
            self.tally.checks[f"consent:{kind}"] += 1
            if actual != bool(last["value"]):
                self.tally.violation(
                    "consent:change_undone",
                    key=f"{tenant}|{kind}|{key}|{last['t1']}",
                    tenant=tenant,
                    change=kind,
                    record=key,
                    expected=last["value"],
                    actual=actual,
                    changed_at=round(last["t1"] - self.start, 2),
                    t=round(self.now(), 2),
                )
        for team, user in closed[:4]:
            self.tally.checks["consent:team_view_closed"] += 1
            try:
                self.store.list_visible(tenant_id=tenant, user_id=user, team_id=team)
            except PermissionDeniedError:
                continue
            if self.joined_since(tenant, f"{team}/{user}", read_at):
                continue  # an actor added them back after the read above (CI of 51352f7): theirs to see
            self.tally.violation(
                "consent:removed_member_sees_team",
                key=f"{tenant}|{team}|{user}|{before}",
                tenant=tenant,
                team=team,
                user=user,
                t=round(self.now(), 2),
            )

    def joined_since(self, tenant: str, key: str, since: float) -> bool:
        """Whether a logged change made `key` (team/user) a member again after `since`; a writer logs
        right after its commit, so a busy machine's may be a few seconds late: waited for up to 10 s."""
        deadline = time.monotonic() + 10
        while True:
            self.settle()
            entries = self.consent.get((tenant, "member", key), [])
            if any(e["value"] and e["t1"] >= since for e in entries):
                return True
            if self.ipc.final.is_set() or time.monotonic() > deadline:
                return False

    def check_analytics_do_not_sell(self, tenant: str) -> None:
        """After the final rebuild: the analytics copy holds no row of a do-not-sell memory or subject."""
        table = self.derived.analytics.read_partition(tenant, columns=["memory_id"])
        copied = set(table["memory_id"].to_pylist()) if table is not None else set()
        with self.store.transaction() as conn:
            opted_out = {
                r[0]
                for r in conn.execute(
                    "SELECT m.memory_id FROM memory.memories m JOIN memory.subjects s ON s.tenant_id = m.tenant_id"
                    " AND s.user_id = m.user_id WHERE m.tenant_id = %s AND (m.do_not_sell OR s.do_not_sell)",
                    (tenant,),
                )
            }
        self.tally.checks["consent:analytics_excludes_do_not_sell"] += len(opted_out)
        for memory_id in sorted(copied & opted_out):
            self.tally.violation(
                "consent:analytics_holds_do_not_sell", key=f"{tenant}|{memory_id}", tenant=tenant, record=memory_id
            )

    def gate_audit(self) -> None:
        audit = Gate(self.store).audit()
        self.tally.checks["gate_audit"] += 1
        self.tally.notes["gate audit: permits"] = audit["permits"]
        self.tally.notes["gate audit: closures"] = audit["closures"]
        if audit["permits_after_closure"]:
            self.tally.violation("gate:permits_after_closure", count=audit["permits_after_closure"])


ROLE_CLASSES: dict[str, type[Worker]] = {
    "writer": Writer,
    "bulk": Bulk,
    "sync": Sync,
    "slowsum": SlowSum,
    "agents": Agents,
    "deleter-a": Deleter,
    "deleter-b": Deleter,
    "oracle": Oracle,
}


def worker_main(role: str, cfg: Config, ipc: Ipc) -> None:
    """Entry point of every child process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when everyone stops
    report: dict[str, Any]
    worker: Worker | None = None
    try:
        worker = ROLE_CLASSES[role](role, cfg, ipc)
        worker.prepare()
        ipc.ready.put(role)
        if not ipc.go.wait(300):
            raise RuntimeError("the racing phase never started")
        worker.start = ipc.t_start.value
        worker.run()
        report = worker.report()
    except BaseException:
        report = {"role": role, "harness_error": traceback.format_exc()[-4000:]}
        if worker is not None:
            try:
                report = {**worker.report(), **report}
            except Exception:  # a worker that failed half-prepared has nothing more to say
                pass
    ipc.results.put(report)


# -- the parent ---------------------------------------------------------------------------------


def seed_world(cfg: Config, store: MemoryStore, derived: DerivedStores) -> int:
    """Tenants, teams and a few memories per subject (half with a second version), then every
    derived store, before anyone races."""
    rng = random.Random(f"{cfg.seed}:seed")
    log = JsonLog(cfg.logdir / "seed.jsonl")
    written = 0
    for tenant in (*REGULAR, *cfg.doomed):
        store.create_tenant(tenant_id=tenant, sharing_mode=SHARING.get(tenant, "shared_pool"))
        for team_id, members in teams_of(tenant).items():
            for user in members:
                store.add_team_member(tenant_id=tenant, team_id=team_id, user_id=user)
        if tenant == RESTORE_TENANT:
            for user in CONSENT_MEMBERS:
                store.add_team_member(tenant_id=tenant, team_id=CONSENT_TEAM, user_id=user)
        for user in subjects_of(tenant):
            for n in range(4):
                team: str | None = (team_of(user) if tenant in REGULAR else "red") if n == 3 else None
                key = f"t{rng.randrange(len(TEAM))}" if team else f"p{rng.randrange(len(PERSONAL))}"
                memory_id: str | None = None
                for _ in range(1 if rng.random() < 0.5 else 2):
                    canary = f"cnryf{rng.getrandbits(60):015x}"
                    text = compose(key, user, team, canary)
                    t0 = time.time()
                    res = store.write(
                        tenant_id=tenant,
                        user_id=user,
                        text=text,
                        team_id=team,
                        memory_id=memory_id,
                    )
                    memory_id = res.memory_id
                    log.emit(
                        "write",
                        op="seed",
                        tenant=tenant,
                        memory_id=res.memory_id,
                        version=res.version,
                        author=user,
                        team=team,
                        canary=canary,
                        text=text,
                        tpl=key,
                        category="general",
                        restored_from=None,
                        t0=t0,
                        t1=time.time(),
                    )
                    written += 1
        derived.sync_all(tenant_id=tenant)
    return written


def collect(
    ipc: Ipc, roles: set[str], reports: dict[str, dict[str, Any]], procs: dict[str, Any], timeout: float
) -> None:
    """Read reports until `roles` have all reported, their processes died, or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while roles - set(reports) and time.monotonic() < deadline:
        try:
            report = ipc.results.get(timeout=0.5)
        except queue.Empty:
            if all(not procs[r].is_alive() for r in roles - set(reports)):
                # Dead without a report (killed, crashed hard): one last look, then give up on them.
                try:
                    report = ipc.results.get(timeout=2)
                except queue.Empty:
                    break
            else:
                continue
        reports[report["role"]] = report


def finish(
    ipc: Ipc,
    roles: set[str],
    reports: dict[str, dict[str, Any]],
    procs: dict[str, Any],
    budget: float,
    conninfo: str,
    result: dict[str, Any],
) -> None:
    """Collect the reports of `roles` and join them, all within `budget` seconds; whoever is still
    running then is stopped, with what PostgreSQL sessions were waiting on (a hang is a finding too)."""
    deadline = time.monotonic() + budget
    collect(ipc, roles, reports, procs, budget)
    for role in sorted(roles):
        procs[role].join(max(0.1, deadline - time.monotonic()))
    stuck = sorted(r for r in roles if procs[r].is_alive())
    if not stuck:
        return
    try:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            activity = conn.execute(
                "SELECT pid, state, wait_event_type, wait_event, left(query, 160) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid() AND state <> 'idle'"
            ).fetchall()
    except psycopg.Error as exc:
        activity = [("pg_stat_activity unavailable", str(exc))]
    result.setdefault("stuck", []).append({"roles": stuck, "sessions": [list(map(str, row)) for row in activity]})
    for role in stuck:
        procs[role].terminate()
        procs[role].join(5)


def run_soak(seconds: float, seed: int, home: Path | None, keep: bool) -> dict[str, Any]:
    wall = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="soak-"))
    if not keep:
        # Registered before the embedded PostgreSQL starts, so it runs after that library's own exit
        # handler (atexit runs last-in first-out), which takes a lock file under HOME once more.
        atexit.register(shutil.rmtree, scratch, True)
    home = (home or scratch / "home").resolve()
    logdir = scratch / "logs"  # plaintext canaries live here: outside HOME, never scanned
    logdir.mkdir(parents=True)
    base = Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})
    ctx = mp.get_context("spawn")
    procs: dict[str, Any] = {}
    reports: dict[str, dict[str, Any]] = {}
    phases: dict[str, float] = {}
    result: dict[str, Any] = {"seed": seed, "seconds": seconds, "home": str(home), "logs": str(logdir)}
    chroma_proc: Any = None
    try:
        endpoints = ensure_services(base)
        # An external server (its URL in the settings), so its files are outside HOME, as an external
        # server's are: under HOME they would be scanned by every erasure, which rewrites only a
        # Chroma it knows the files of (HOME's own), and refused for the forgotten vectors they keep.
        with chroma_server(scratch / "chroma") as (chroma_url, chroma_proc):
            doomed = tuple(f"soak-z{n}" for n in range(max(2, round(seconds / 35))))
            cfg = Config(
                seconds=seconds,
                seed=seed,
                home=home,
                logdir=logdir,
                conninfo=endpoints.store_conninfo,
                chroma_url=chroma_url,
                doomed=doomed,
                events=make_schedule(seconds, seed, doomed),
                # Re-checking every COMPLETE job at the end grows with the run (about 150 jobs a minute).
                final_seconds=max(60.0, 0.1 * seconds),
            )
            store = MemoryStore(cfg.conninfo, KeyStore(master_key(cfg.settings())))
            derived = open_derived(cfg.settings(), store, embedder=MiniLMEmbedder(threads=1))
            result["seeded_versions"] = seed_world(cfg, store, derived)
            ipc = Ipc(
                stop=ctx.Event(),
                final=ctx.Event(),
                go=ctx.Event(),
                t_start=ctx.Value("d", 0.0),
                ready=ctx.Queue(),
                results=ctx.Queue(),
                writer_hints=ctx.Queue(),
                bulk_hints=ctx.Queue(),
                adversary={"deleter-a": ctx.Queue(), "deleter-b": ctx.Queue()},
            )
            for role in ROLES:
                procs[role] = ctx.Process(target=worker_main, args=(role, cfg, ipc), name=f"soak-{role}", daemon=True)
                procs[role].start()
            ready: set[str] = set()
            deadline = time.monotonic() + 180
            while ready != set(ROLES):
                try:
                    ready.add(ipc.ready.get(timeout=1))
                except queue.Empty:
                    dead = [r for r, p in procs.items() if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        collect(ipc, set(dead), reports, procs, 5)
                        raise RuntimeError(  # noqa: B904 - not caused by the empty queue
                            f"workers failed to start: {dead or sorted(set(ROLES) - ready)}: "
                            + "; ".join(r.get("harness_error", "")[-600:] for r in reports.values())
                        )
            phases["setup"] = time.monotonic() - wall
            ipc.t_start.value = time.time() + 0.2
            ipc.go.set()
            racing = time.monotonic()
            ipc.stop.wait(seconds + 0.2)
            ipc.stop.set()
            phases["racing"] = time.monotonic() - racing
            ending = time.monotonic()
            others = set(ROLES) - {"oracle"}
            finish(ipc, others, reports, procs, cfg.drain_seconds + 40, cfg.conninfo, result)
            ipc.final.set()
            finish(ipc, {"oracle"}, reports, procs, cfg.final_seconds + 60, cfg.conninfo, result)
            phases["final"] = time.monotonic() - ending
            result["deletions"] = deletion_figures(cfg.conninfo)
            store.close()
    except BaseException as exc:
        result["harness_error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    finally:
        signal.alarm(0)  # the cleanup itself must not be cut short by the deadline
        for proc in procs.values():
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if chroma_proc is not None and chroma_proc.poll() is None:
            chroma_proc.kill()
        try:
            stop_services(base)
        except Exception as exc:  # a server that will not stop is worth saying, not hiding
            result.setdefault("harness_error", f"stop_services: {exc}")
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)  # now; the exit handler removes what comes back
    phases["wall"] = time.monotonic() - wall
    result["phases"] = {k: round(v, 1) for k, v in phases.items()}
    result["reports"] = reports
    missing = set(ROLES) - set(reports)
    crashed = {r: rep["harness_error"] for r, rep in reports.items() if "harness_error" in rep}
    if missing or crashed:
        errors = [f"{r}: no report" for r in sorted(missing)] + [f"{r}: {e[-800:]}" for r, e in crashed.items()]
        errors += [f"stuck: {json.dumps(entry)[:3000]}" for entry in result.get("stuck", [])]
        result.setdefault("harness_error", "\n".join(errors))
    return summarise(result)


def deletion_figures(conninfo: str) -> dict[str, Any]:
    with psycopg.connect(conninfo) as conn:
        by = conn.execute("SELECT scope, state, count(*) FROM control.deletion_jobs GROUP BY 1, 2").fetchall()
        ever_blocked = conn.execute(
            "SELECT count(DISTINCT job_id) FROM control.audit WHERE event = 'blocked'"
        ).fetchone()[0]  # type: ignore[index]
        restores = conn.execute("SELECT state, count(*) FROM control.restores GROUP BY 1").fetchall()
        backups = conn.execute("SELECT count(*) FROM control.backups").fetchone()[0]  # type: ignore[index]
    accepted: Counter[str] = Counter()
    complete: Counter[str] = Counter()
    open_at_end: Counter[str] = Counter()
    for scope, state, count in by:
        accepted[scope] += count
        if state == "COMPLETE":
            complete[scope] += count
        else:
            open_at_end[f"{scope}:{state}"] += count
    return {
        "accepted": sum(accepted.values()),
        "complete": sum(complete.values()),
        "accepted_by_scope": dict(accepted),
        "complete_by_scope": dict(complete),
        "open_at_end": dict(open_at_end),
        "blocked_at_least_once": int(ever_blocked),
        "restores": dict(restores),
        "backups": int(backups),
    }


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    ops: Counter[str] = Counter()
    refusals: Counter[str] = Counter()
    blocked: Counter[str] = Counter()
    checks: Counter[str] = Counter()
    notes: Counter[str] = Counter()
    violations: list[dict[str, Any]] = []
    for report in result["reports"].values():
        ops.update(report.get("ops", {}))
        refusals.update(report.get("refusals", {}))
        blocked.update(report.get("blocked", {}))
        checks.update(report.get("checks", {}))
        notes.update({f"{report['role']}: {k}": v for k, v in report.get("notes", {}).items()})
        violations += report.get("violations", [])
    result.update(
        operations=sum(ops.values()),
        ops=dict(sorted(ops.items())),
        refusals=dict(refusals.most_common()),
        blocked_codes=dict(blocked.most_common()),
        oracle_checks=sum(checks.values()),
        checks=dict(sorted(checks.items())),
        notes=dict(sorted(notes.items())),
        violations=violations,
    )
    result.pop("reports")
    return result


PRINTED_PER_KIND = 12


def print_summary(result: dict[str, Any], out: Any = sys.stdout) -> None:
    def line(text: str = "") -> None:
        print(text, file=out)

    def group(counts: dict[str, Any]) -> None:
        text = ", ".join(f"{k} {v}" for k, v in counts.items())
        for row in textwrap.wrap(text, width=116, initial_indent="    ", subsequent_indent="    "):
            line(row)

    deletions = result.get("deletions", {})
    phases = result.get("phases", {})
    line(f"== soak: seed {result['seed']}, racing {result['seconds']:g} s, {len(ROLES)} worker processes ==")
    line(f"operations: {result.get('operations', 0)}")
    group(result.get("ops", {}))
    line(f"refused as documented: {sum(result.get('refusals', {}).values())}")
    for reason, count in list(result.get("refusals", {}).items())[:14]:
        line(f"    {count:5d}  {reason}")
    line(f"deletions accepted: {deletions.get('accepted', 0)}")
    group(deletions.get("accepted_by_scope", {}))
    line(f"deletions complete: {deletions.get('complete', 0)}")
    group(deletions.get("complete_by_scope", {}))
    line(f"deletions blocked at least once (then retried): {deletions.get('blocked_at_least_once', 0)}")
    group(result.get("blocked_codes", {}))
    line(f"deletions open at the end: {sum(deletions.get('open_at_end', {}).values())}")
    group(deletions.get("open_at_end", {}))
    line(f"backups: {deletions.get('backups', 0)}, restores: {deletions.get('restores', {})}")
    line(f"oracle checks: {result.get('oracle_checks', 0)}")
    group(result.get("checks", {}))
    notes = result.get("notes", {})
    if notes:
        line("notes:")
        for key, value in notes.items():
            line(f"    {key}: {value}")
    violations = result.get("violations", [])
    repeats = sum(v.get("repeats", 0) for v in violations)
    line(f"violations: {len(violations)}" + (f" (seen {len(violations) + repeats} times)" if repeats else ""))
    kinds = Counter(v["kind"] for v in violations)
    for kind, count in kinds.most_common():
        line(f"  {kind}: {count}")
        shown = [v for v in violations if v["kind"] == kind]
        for v in shown[:PRINTED_PER_KIND]:
            detail = {k: val for k, val in v.items() if k not in ("kind", "traceback")}
            line(f"      {json.dumps(detail, default=str)[:400]}")
            if "traceback" in v:
                frames = [f.strip() for f in v["traceback"].splitlines() if f.strip().startswith("File ")]
                ours = [f for f in frames if "memory_pipelines" in f] or frames  # the library's frame first
                line(f"        at {ours[-1][:200] if ours else '?'}")
        if len(shown) > PRINTED_PER_KIND:
            line(f"      ... and {len(shown) - PRINTED_PER_KIND} more of this kind (all of them in the --json report)")
    if "harness_error" in result:
        line(f"harness error: {result['harness_error']}")
    line(
        f"wall time: {phases.get('wall', 0):.1f} s (setup {phases.get('setup', 0):.1f} s, "
        f"racing {phases.get('racing', 0):.1f} s, final checks {phases.get('final', 0):.1f} s)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=100.0, help="length of the racing phase (CI: 100)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--home", type=Path, default=None, help="MEMORY_PIPELINES_HOME (default: a fresh tempdir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the full report here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary HOME and the canary logs")
    args = parser.parse_args(argv)

    def terminated(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through run_soak's cleanup

    signal.signal(signal.SIGTERM, terminated)
    # The hard deadline: setup, racing, drain and final checks never take longer than this together.
    signal.signal(signal.SIGALRM, terminated)
    signal.alarm(int(args.seconds + 300 + 0.1 * args.seconds))
    result = run_soak(args.seconds, args.seed, args.home, args.keep)
    print_summary(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    if "harness_error" in result:
        return 2
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
