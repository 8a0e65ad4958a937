"""Recall benchmark: latency of `Recaller.recall` (use_cache=False) per mode as the user's visible set
grows, against the previous algorithm (load every visible (memory_id, version), then keep the index
hits found in it), measured in the same run on the same tenants and queries.

    .venv/bin/python -m benchmarks.recall                          # 1,000, 10,000 and 100,000 visible
    .venv/bin/python -m benchmarks.recall --sizes 1000,10000       # a quick run
    .venv/bin/python -m benchmarks.recall --home DIR               # keep the tenants; a rerun measures again

Each tenant is progressive (the richest visibility rule): a viewer in team `core` sees N memories
(team memories and members' shareable personal ones) among N + N/10 (members' private memories,
another team's, outsiders' shareable ones), with 1% of the visible memories at a second version.
Setup embeds every memory with all-MiniLM-L6-v2 (7 to 15 minutes for all three sizes on 2 cores);
`--embedder hashing` builds and queries with the test-only hashing embedder instead (quick runs).
Queries are questions over the corpus' vocabulary; each one runs on every size in turn, so load
from elsewhere on the machine weighs on every size alike. k = 5.

Targets: p50 at 100,000 within 2x of p50 at 1,000 for every mode; keyword p50 under 30 ms at 100,000.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.forget import build
from benchmarks.homes import discard, temporary_home
from benchmarks.ingest import WORDS, corpus
from memory_pipelines.lib.infra.errors import NotFoundError
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories import crypto
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import RecallHit
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores.derived import default_embedder, open_derived, sync_embeddings, sync_keywords
from memory_pipelines.lib.stores.embedding import HashingEmbedder
from memory_pipelines.lib.stores.recall import fusion
from memory_pipelines.lib.stores.recall.recall import MODES, Recaller, chroma_where

VIEWER = "user0000"
PERSONAL = "user0001"
TEAM = "core"
MEMBERS = 20
QUESTIONS = [
    "Who is allergic to {allergen}?",
    "Which language does the user prefer for {task}?",
    "Who has a {pet} named {name}?",
    "When is the deadline of the {project} project?",
    "Who commutes by {transport} on {day}s?",
    "Who takes {med} after meals?",
    "Who is training for a {race} in {month}?",
    "How much is the {thing} loan?",
    "Who lives near {place}?",
    "Answers in {language} with examples in {lang}",
]


def old_recall(
    recaller: Recaller,
    *,
    tenant_id: str,
    user_id: str,
    query: str,
    team_id: str | None = None,
    k: int = 5,
    mode: str = "hybrid",
    keyword_cut: int | None = 1000,
) -> list[dict[str, Any]]:
    """The recall this change replaced, as it was (use_cache=False): the baseline measured here and the
    oracle of tests/integration/test_recall_scale.py. Loads every visible (memory_id, version) first.
    With `keyword_cut=None` it keeps every keyword hit before filtering: the exact keyword answer,
    which the old cut at the tenant's best 1,000 missed for a user who sees few of them."""
    store = recaller.store
    scope = store.visible_scope(tenant_id=tenant_id, user_id=user_id, team_id=team_id)
    visible: dict[tuple[str, int], dict[str, Any]] = scope["visible"]
    change_seq = store.change_seq(tenant_id=tenant_id)
    if not visible:
        return []
    with store.transaction() as conn:
        try:
            subkey = store.keys.tenant_subkey(conn, tenant_id, "recall-cache", create=False)
        except NotFoundError:
            return []
        cache_key = crypto.mac(subkey, json.dumps([user_id, team_id, mode, k, query]).encode())
        conn.execute(
            "SELECT change_seq, results FROM derived.recall_cache WHERE tenant_id = %s AND cache_key = %s",
            (tenant_id, cache_key),
        ).fetchone()
    fetch = min(max(4 * k, k + 20), 400)
    semantic: list[tuple[tuple[str, int], float]] = []
    keyword: list[tuple[tuple[str, int], float]] = []
    if mode in ("semantic", "hybrid"):
        where = chroma_where(user_id, team_id, scope["sharing_mode"], scope["members"])
        found = recaller.vectors.query(tenant_id=tenant_id, text=query, limit=fetch, where=where)
        semantic = [h for h in found if h[0] in visible]
    if mode in ("keyword", "hybrid"):
        limit = max(fetch, keyword_cut) if keyword_cut is not None else 10**9
        found = recaller.keywords.search(tenant_id=tenant_id, query=query, limit=limit)
        keyword = [h for h in found if h[0] in visible]
    if mode == "semantic":
        hits = semantic[:k]
    elif mode == "keyword":
        hits = keyword[:k]
    else:
        # Today's fusion (issue 23 replaced reciprocal rank fusion): what is compared is the candidates.
        hits = fusion.fuse(semantic, keyword, k)
    recaller._cache(tenant_id, user_id, cache_key, change_seq, hits)
    texts = store.open_texts(tenant_id=tenant_id, sources=[source for source, _ in hits], visible_only=True)
    return [
        {
            "memory_id": m,
            "version": v,
            "text": texts[(m, v)],
            "score": round(score, 6),
            "user_id": visible[(m, v)]["user_id"],
            "team_id": visible[(m, v)]["team_id"],
            "category": visible[(m, v)]["category"],
            "cached": False,
        }
        for (m, v), score in hits
        if (m, v) in texts
    ]


def items_for(n: int) -> list[dict[str, Any]]:
    """N memories the viewer sees and N/10 it does not (members' private ones, team `other`'s, and
    outsiders' shareable ones), texts from the ingest benchmark's corpus."""
    texts = [item["text"] for item in corpus(n + n // 10, subjects=1, seed=11)]
    items: list[dict[str, Any]] = []
    for i, text in enumerate(texts[:n]):
        author = f"user{i % MEMBERS:04d}"
        if i % 10 == 9:  # a member's shareable personal memory, in the progressive team view
            items.append({"user_id": author, "text": text, "shareable": True})
        else:
            items.append({"user_id": author, "text": text, "team_id": TEAM})
    for i, text in enumerate(texts[n:]):
        member, outsider = f"user{i % MEMBERS:04d}", f"user{MEMBERS + i % 10:04d}"
        items.append(
            [
                {"user_id": member, "text": text},
                {"user_id": outsider, "text": text, "team_id": "other"},
                {"user_id": outsider, "text": text, "shareable": True},
            ][i % 3]
        )
    return items


def ensure_tenant(store: MemoryStore, derived: Any, n: int) -> str:
    """The benchmark tenant with N visible memories, built once per HOME; its indexes synced."""
    tenant = f"recall-{n}"
    built = store.tenant_exists(tenant_id=tenant)
    if not built:
        started = time.perf_counter()
        items = items_for(n)
        ids = build(store, tenant, items)
        store.set_sharing_mode(tenant_id=tenant, sharing_mode="progressive")
        for member in range(MEMBERS):  # authors of shareable memories only are members too
            store.add_team_member(tenant_id=tenant, team_id=TEAM, user_id=f"user{member:04d}")
        for memory_id, item in list(zip(ids, items, strict=True))[:n:100]:  # 1% get a second version
            store.write(tenant_id=tenant, user_id=item["user_id"], memory_id=memory_id, text=item["text"] + " (v2)")
    sync_embeddings(store, derived.vectors, tenant_id=tenant)
    sync_keywords(store, tenant_id=tenant)
    visible = len(store.visible_scope(tenant_id=tenant, user_id=VIEWER, team_id=TEAM)["visible"])
    if visible != n:
        raise SystemExit(f"tenant {tenant} shows {visible:,} memories to {VIEWER}, not {n:,}; use a new --home")
    if not built:
        print(f"setup: {tenant}, {n + n // 10:,} memories ({n:,} visible), {time.perf_counter() - started:.1f} s")
    return tenant


def questions(count: int) -> list[str]:
    rng = random.Random(5)
    return [rng.choice(QUESTIONS).format(**{k: rng.choice(v) for k, v in WORDS.items()}) for _ in range(count)]


def interleaved(
    calls: Sequence[tuple[Callable[[str], Sequence[Mapping[str, Any]]], int]], queries: list[str]
) -> tuple[list[list[float]], list[list[list[Any]]]]:
    """Milliseconds and answers ((memory_id, version) lists) per call and query; a call with bound
    `b` answers the first b queries only. Each query runs through every call in turn (every size,
    new and old), so whatever else the machine does weighs on all of them alike."""
    for fn, _ in calls:
        for query in queries[:3]:  # warm: Chroma's segment, the embedder's session, the caches
            fn(query)
    millis: list[list[float]] = [[] for _ in calls]
    answers: list[list[list[Any]]] = [[] for _ in calls]
    for i, query in enumerate(queries):
        for n, (fn, bound) in enumerate(calls):
            if i >= bound:
                continue
            started = time.perf_counter()
            got = fn(query)
            millis[n].append((time.perf_counter() - started) * 1000)
            answers[n].append([(r["memory_id"], r["version"]) for r in got])
    return millis, answers


def recall_new(recaller: Recaller, kwargs: dict[str, Any], query: str) -> list[RecallHit]:
    return recaller.recall(query=query, use_cache=False, **kwargs)


def recall_old(recaller: Recaller, kwargs: dict[str, Any], query: str) -> list[dict[str, Any]]:
    return old_recall(recaller, query=query, **kwargs)


def recall_exact(recaller: Recaller, kwargs: dict[str, Any], query: str) -> list[dict[str, Any]]:
    return old_recall(recaller, query=query, keyword_cut=None, **kwargs)


def p50_p95(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    return statistics.median(values), statistics.quantiles(values, n=20, method="inclusive")[18]


def measure(
    recaller: Recaller,
    targets: dict[int, dict[str, Any]],
    modes: list[str],
    queries: list[str],
    baseline: list[str],
) -> dict[tuple[int, str], dict[str, Any]]:
    """p50/p95 per size and mode, new and old, and how many of `baseline` both answered alike."""
    results: dict[tuple[int, str], dict[str, Any]] = {}
    for mode in modes:
        per_size = [{**target, "mode": mode} for target in targets.values()]
        calls: list[tuple[Callable[[str], Sequence[Mapping[str, Any]]], int]]
        calls = [(partial(recall_new, recaller, kwargs), len(queries)) for kwargs in per_size]
        calls += [(partial(recall_old, recaller, kwargs), len(baseline)) for kwargs in per_size]
        if mode == "keyword":  # the exact answer (not timed): keyword hits are exact, not approximate
            calls += [(partial(recall_exact, recaller, kwargs), len(baseline)) for kwargs in per_size]
        millis, answers = interleaved(calls, queries)
        for i, n in enumerate(targets):
            new, old = millis[i], millis[len(per_size) + i]
            same = sum(a == b for a, b in zip(answers[i], answers[len(per_size) + i], strict=False))
            row = results[(n, mode)] = {"new": p50_p95(new), "old": p50_p95(old), "same": same}
            exact = ""
            if mode == "keyword":
                row["exact"] = sum(a == b for a, b in zip(answers[i], answers[2 * len(per_size) + i], strict=False))
                exact = f" | exact {row['exact']}/{len(baseline)}"
            print(
                f"  {n:>7,} {mode:8} new p50 {row['new'][0]:7.1f} ms p95 {row['new'][1]:7.1f}"
                f" | old p50 {row['old'][0]:7.1f} ms p95 {row['old'][1]:7.1f} | same {same}/{len(baseline)}{exact}",
                flush=True,
            )
    return results


def table(title: str, results: dict[tuple[int, str], dict[str, Any]], baseline: int) -> None:
    print()
    print(title)
    print(f"{'visible':>9} {'mode':9} {'new p50':>9} {'new p95':>9} {'old p50':>9} {'old p95':>9} {'same':>7}")
    for (n, mode), row in sorted(results.items(), key=lambda item: (MODES.index(item[0][1]), item[0][0])):
        print(
            f"{n:>9,} {mode:9} {row['new'][0]:9.1f} {row['new'][1]:9.1f} {row['old'][0]:9.1f} {row['old'][1]:9.1f}"
            f" {row['same']:>3}/{baseline}" + (f"  exact {row['exact']}/{baseline}" if "exact" in row else "")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,10000,100000", help="visible memories per tenant")
    parser.add_argument("--queries", type=int, default=200, help="recalls per mode and size")
    parser.add_argument("--baseline-queries", type=int, default=40, help="of those, measured with the old one")
    parser.add_argument("--personal-queries", type=int, default=40, help="recalls in a personal view (0: none)")
    parser.add_argument("--modes", default=",".join(MODES), help="recall modes to measure")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--embedder", choices=("minilm", "hashing"), default="minilm")
    parser.add_argument("--home", type=Path, help="data folder (default: a new temporary folder)")
    args = parser.parse_args()
    if not 1 <= args.baseline_queries <= args.queries:
        parser.error("--baseline-queries must be from 1 to --queries")
    sizes = [int(s) for s in args.sizes.split(",")]
    modes = [m for m in MODES if m in args.modes.split(",")]
    home = args.home or temporary_home("mp-bench-recall-")
    settings = Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})
    store = open_store(settings)
    embedder = default_embedder() if args.embedder == "minilm" else HashingEmbedder()
    derived = open_derived(settings, store, embedder=embedder)
    recaller = derived.recaller
    queries = questions(args.queries)
    baseline = queries[: args.baseline_queries]
    print(f"home {home}; {args.embedder} embedder; k={args.k}; viewer {VIEWER} in team {TEAM} (progressive)")

    tenants = {n: ensure_tenant(store, derived, n) for n in sizes}
    team_view = {n: {"tenant_id": t, "user_id": VIEWER, "team_id": TEAM, "k": args.k} for n, t in tenants.items()}
    results = measure(recaller, team_view, modes, queries, baseline)
    personal: dict[tuple[int, str], dict[str, Any]] = {}
    if args.personal_queries:
        print(f"personal view of {PERSONAL} (a small scope: the private memories among the N/10 not visible above)")
        mine = {n: {"tenant_id": t, "user_id": PERSONAL, "team_id": None, "k": args.k} for n, t in tenants.items()}
        asked = queries[: args.personal_queries]
        personal = measure(recaller, mine, modes, asked, asked)

    table(f"team view of {VIEWER}: N visible", results, len(baseline))
    if personal:
        table(f"personal view of {PERSONAL}: about N/600 visible", personal, args.personal_queries)
    print("(milliseconds; new: Recaller.recall with use_cache=False; old: the visible set loaded first)")
    small, large = min(sizes), max(sizes)
    if small != large:
        for mode in modes:
            ratio = results[(large, mode)]["new"][0] / results[(small, mode)]["new"][0]
            old_ratio = results[(large, mode)]["old"][0] / results[(small, mode)]["old"][0]
            print(
                f"team view p50@{large:,} / p50@{small:,} {mode:8}: {ratio:5.2f}x (old {old_ratio:5.2f}x;"
                f" target <= 2x: {'met' if ratio <= 2 else 'MISSED'})"
            )
    if "keyword" in modes:
        keyword = results[(large, "keyword")]["new"][0]
        print(f"keyword p50 at {large:,}: {keyword:.1f} ms (target < 30 ms: {'met' if keyword < 30 else 'MISSED'})")
    store.close()
    if args.home is None:
        discard(home)


if __name__ == "__main__":
    main()
