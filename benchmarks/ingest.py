"""Ingest benchmark: N memories through write and every derived store, against raw embedding.

    .venv/bin/python benchmarks/ingest.py            # 10,000 memories
    .venv/bin/python benchmarks/ingest.py --large    # 100,000 memories

Prints per-stage throughput, the raw all-MiniLM-L6-v2 throughput on the same texts measured in the
same run, and the ratio end-to-end / raw (target >= 0.8; raw target >= 500 sentences/s).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.homes import discard, temporary_home
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores.derived import default_embedder, open_derived, sync_embeddings, sync_keywords
from memory_pipelines.lib.stores.embedding import Embedder

TEMPLATES = [
    "Prefers {lang} for {task} and writes tests before refactoring.",
    "Is allergic to {allergen} and keeps {med} in the {place}.",
    "Lives near {place} and commutes by {transport} on {day}s.",
    "Works on the {project} project with a deadline in {month}.",
    "Wants answers in {language}, short and with examples in {lang}.",
    "Has a {pet} named {name} who needs a walk every {day}.",
    "Pays {amount} EUR a month for the {thing} loan until {month}.",
    "Is training for a {race} in {month} and runs on {day}s.",
    "Takes {med} twice a day after meals, prescribed by Dr {name}.",
    "The team ships {project} on {day}s and freezes deploys in {month}.",
]
WORDS = {
    "lang": ["Python", "Rust", "Go", "TypeScript", "Kotlin", "SQL", "Elixir", "Haskell"],
    "task": ["data pipelines", "web backends", "scripts", "embedded work", "ML experiments", "CLIs"],
    "allergen": ["penicillin", "peanuts", "shellfish", "pollen", "latex", "cats"],
    "med": ["an inhaler", "antihistamines", "insulin", "ibuprofen", "an EpiPen"],
    "place": ["the office", "Lyon", "the harbour", "Berlin", "the car", "Porto", "the gym bag"],
    "transport": ["bike", "tram", "train", "car", "ferry"],
    "day": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"],
    "project": ["billing", "search", "onboarding", "mobile app", "data platform", "payments"],
    "month": ["January", "March", "May", "July", "September", "November"],
    "language": ["English", "French", "German", "Portuguese", "Spanish"],
    "pet": ["dog", "cat", "parrot", "rabbit"],
    "name": ["Miso", "Ada", "Kiko", "Bruno", "Lena", "Oscar", "Ines", "Tomas"],
    "amount": ["450", "900", "1,250", "1,850", "2,400"],
    "thing": ["car", "mortgage", "student", "kitchen"],
    "race": ["10k", "half marathon", "marathon", "trail race"],
}


def corpus(n: int, subjects: int, seed: int = 7) -> list[dict[str, Any]]:
    """Deterministic, varied memory texts; every tenth memory is a team memory."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        template = rng.choice(TEMPLATES)
        text = template.format(**{k: rng.choice(v) for k, v in WORDS.items()})
        user = f"user{i % subjects:04d}"
        item: dict[str, Any] = {"user_id": user, "text": f"{text} (note {i})"}
        if i % 10 == 0:
            item["team_id"] = f"team{(i // 10) % 10}"
        if i % 25 == 0:
            item["do_not_sell"] = True
        items.append(item)
    return items


def timed(label: str, fn: Callable[[], Any], results: list[tuple[str, float, Any]]) -> Any:
    start = time.perf_counter()
    value = fn()
    results.append((label, time.perf_counter() - start, value))
    return value


def run_ingest(settings: Settings, embedder: Embedder, *, n: int, subjects: int, tenant: str) -> Ingest:
    """Time raw embedding of the corpus's texts, then its write and every derived store's sync, on a new tenant."""
    items = corpus(n, subjects)
    texts = [item["text"] for item in items]
    embedder.embed(texts[:64])  # build the graph and session outside the timings
    raw_start = time.perf_counter()
    for start in range(0, n, 512):  # the same chunking the vector sync uses
        embedder.embed(texts[start : start + 512])
    raw_seconds = time.perf_counter() - raw_start

    store = open_store(settings)
    store.create_tenant(tenant_id=tenant, sharing_mode="shared_pool")
    for team in range(10):
        for s in range(0, subjects, 10):
            store.add_team_member(tenant_id=tenant, team_id=f"team{team}", user_id=f"user{(s + team) % subjects:04d}")
    derived = open_derived(settings, store, embedder=embedder)
    derived.vectors.client()  # like the model's load, the Chroma client's import (about 1 s) is not ingest
    # Team memories must come from members: give each team item an author in that team.
    teams = store.teams(tenant_id=tenant)
    for i, item in enumerate(items):
        if "team_id" in item:
            members = teams[item["team_id"]]
            item["user_id"] = members[i % len(members)]

    stages: list[tuple[str, float, Any]] = []
    timed(
        "write (bulk, encrypted)",
        lambda: [store.write_many(tenant_id=tenant, items=items[i : i + 2000]) for i in range(0, n, 2000)],
        stages,
    )
    timed("memory_embeddings", lambda: sync_embeddings(store, derived.vectors, tenant_id=tenant), stages)
    timed("keyword_index", lambda: sync_keywords(store, tenant_id=tenant), stages)
    timed("subject_summaries", lambda: derived.summaries.sync(tenant_id=tenant, scope="subject"), stages)
    timed("team_summaries", lambda: derived.summaries.sync(tenant_id=tenant, scope="team"), stages)
    timed("analytics_memories", lambda: derived.analytics.rebuild(store=store, tenant_id=tenant), stages)
    checks = {
        "memory_embeddings": derived.vectors.check(store=store, tenant_id=tenant),
        "keyword_index": derived.keywords.check(tenant_id=tenant),
        "analytics_memories": derived.analytics.check(store=store, tenant_id=tenant),
    }
    store.close()
    return Ingest(n=n, stages=stages, raw_seconds=raw_seconds, checks=checks)


@dataclass
class Ingest:
    n: int
    stages: list[tuple[str, float, Any]]
    raw_seconds: float
    checks: dict[str, dict[str, Any]]

    @property
    def seconds(self) -> float:
        return sum(seconds for _, seconds, _ in self.stages)

    @property
    def ratio(self) -> float:
        """End-to-end rate over raw embedding rate on the same texts."""
        return self.raw_seconds / self.seconds

    def print(self) -> None:
        n = self.n
        print(f"{'stage':28} {'seconds':>9} {'memories/s':>12}")
        for label, seconds, _ in self.stages:
            print(f"{label:28} {seconds:9.2f} {n / seconds:12,.0f}")
        print(f"{'end to end':28} {self.seconds:9.2f} {n / self.seconds:12,.0f}")
        print(f"{'raw embedding (same texts)':28} {self.raw_seconds:9.2f} {n / self.raw_seconds:12,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--large", action="store_true", help="100,000 memories")
    parser.add_argument("--subjects", type=int, default=100)
    parser.add_argument("--home", type=Path, help="data folder (default: a new temporary folder)")
    args = parser.parse_args()
    n = 100_000 if args.large else args.n
    home = args.home or temporary_home("mp-bench-ingest-")
    settings = Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})
    embedder = default_embedder(settings.embedding_model)
    result = run_ingest(settings, embedder, n=n, subjects=args.subjects, tenant="bench")
    print(f"memories: {n:,} from {args.subjects} subjects; model {embedder.name}; home {home}")
    result.print()
    raw_rate = n / result.raw_seconds
    ratio = result.ratio
    print(f"ratio end-to-end / raw embedding: {ratio:.2f} (target >= 0.80: {'met' if ratio >= 0.8 else 'MISSED'})")
    print(f"raw embedding: {raw_rate:,.0f} sentences/s (target >= 500: {'met' if raw_rate >= 500 else 'MISSED'})")
    checks = result.checks
    print("checks:", {name: {k: v for k, v in c.items() if k != "records"} for name, c in checks.items()})
    if args.home is None:
        discard(home)


if __name__ == "__main__":
    main()
