"""Recall quality: precision@K and recall@K of semantic, keyword and hybrid recall at K = 1, 5 and 10,
against reciprocal rank fusion (RRF, k=60: the hybrid fusion issue 23 replaced) fused from the same
two lists in the same run, on real engines (embedded PostgreSQL, Chroma, all-MiniLM-L6-v2).

    .venv/bin/python -m benchmarks.recall_quality                      # every corpus, one to two minutes
    .venv/bin/python -m benchmarks.recall_quality --corpora eval,demo  # the two the target is set on
    .venv/bin/python -m benchmarks.recall_quality --home DIR           # keep the tenants; a rerun measures again

Corpora:
- `eval`: the project's evaluation set (`assets/eval/memory_eval_set.json`, 114 queries) seeded as
  `memory_eval` seeds it; each query asked in its user's (or team's) view.
- `demo`: the demo corpus (`assets/demo/corpus.json`) written as the demo writes it, in a
  progressive tenant, with the labelled queries of `assets/eval/demo_queries.json` (34).
- `pooled` (a stress case, not a product scope): the evaluation set's memories all written by one
  user, each query prefixed with its asker's name ("Ana: what am I allergic to?") and asked in that
  one view: 132 candidates a query, near-duplicates told apart by a name, as in a long conversation.

Semantic, keyword and hybrid are `evaluator.evaluate` (what `memory_eval` and `eval report` show, the
label judge); RRF fuses `Recaller.ranked_lists`, the lists hybrid fuses, and the run checks that the
hybrid it measured is `fusion.fuse` of those same lists. Everything is deterministic: a rerun on the
same model gives the same figures (no timing, no sampling).

Target (issue 23): hybrid at least max(semantic, keyword) in recall@K at every K, and in precision@1,
on `eval` and `demo`. Precision at K > 1 is the seed's useful / recalled (not useful / K): a mode that
returns fewer than K answers (keyword, when few memories share a word with the query) is not charged
for the slots it leaves empty, so it is reported, not targeted.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.homes import discard, temporary_home
from memory_pipelines import demo
from memory_pipelines.lib.evaluation import evaluator as ev
from memory_pipelines.lib.infra.paths import ASSETS_DIR
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores.derived import DerivedStores, open_derived
from memory_pipelines.lib.stores.embedding import HashingEmbedder
from memory_pipelines.lib.stores.recall import fusion

DEMO_QUERIES = ASSETS_DIR / "eval" / "demo_queries.json"
CORPORA = ("eval", "demo", "pooled")
KS = (1, 5, 10)
RRF_K = 60  # Cormack et al.'s constant, as the replaced fusion used it
POOLED_TENANT, POOLED_USER = "quality-pooled", "pool"
ROWS = ("semantic", "keyword", "hybrid-rrf", "hybrid")


def rrf(semantic: fusion.Ranked, keyword: fusion.Ranked, k: int) -> fusion.Ranked:
    """Reciprocal rank fusion of the two lists, as hybrid recall fused them before issue 23 (the
    baseline here only: no recall mode uses it)."""
    fused: dict[tuple[str, int], float] = {}
    for ranked in (semantic, keyword):
        for rank, (source, _) in enumerate(ranked):
            fused[source] = fused.get(source, 0.0) + 1.0 / (RRF_K + rank + 1)
    return sorted(fused.items(), key=lambda item: (-item[1], item[0]))[:k]


@dataclass(frozen=True)
class Corpus:
    name: str
    eval_set: ev.EvalSet
    ids: dict[str, tuple[str, int]]


def demo_corpus(store: MemoryStore, derived: DerivedStores, tenant: str = "demo") -> Corpus:
    """The demo corpus in `tenant` (written once, as `demo` writes it: the editor memory updated and
    rolled back), progressive, indexed; its labelled queries with their keys' current ids."""
    corpus = {**json.loads(demo.CORPUS.read_text(encoding="utf-8")), "tenant": tenant}
    labelled = json.loads(DEMO_QUERIES.read_text(encoding="utf-8"))
    if not store.tenant_exists(tenant_id=tenant):
        demo.seed(store, corpus)
        demo.show_versions(store, corpus)
    store.set_sharing_mode(tenant_id=tenant, sharing_mode=labelled["sharing_mode"])
    derived.sync_all(tenant_id=tenant)
    by_text: dict[str, tuple[str, int]] = {}
    views = [(user, None) for user in {m["user"] for m in corpus["memories"]}]
    views += [(user, corpus["team"]) for user in corpus["members"]]
    for user, team in views:
        for m in store.list_visible(tenant_id=tenant, user_id=user, team_id=team):
            by_text[m["text"]] = (m["memory_id"], m["version"])
    missing = sorted(key for key, text in labelled["memories"].items() if text not in by_text)
    if missing:
        raise SystemExit(f"{DEMO_QUERIES.name}: no current memory of the demo corpus reads as {missing}")
    ids = {key: by_text[text] for key, text in labelled["memories"].items()}
    return Corpus("demo", ev.EvalSet(tenant, 1, {}, [], labelled["queries"]), ids)


def pooled_corpus(store: MemoryStore, derived: DerivedStores, eval_set: ev.EvalSet) -> Corpus:
    """The evaluation set's memories as one user's (written once), its queries prefixed with the
    asker's name and asked in that user's view."""
    ids: dict[str, tuple[str, int]] = {}
    if store.tenant_exists(tenant_id=POOLED_TENANT):  # written by an earlier run: each key's current version
        visible = store.list_visible(tenant_id=POOLED_TENANT, user_id=POOLED_USER)
        by_text = {m["text"]: (m["memory_id"], m["version"]) for m in visible}
        ids = {m["key"]: by_text[m["text"]] for m in eval_set.memories if m["text"] in by_text}
    else:
        store.create_tenant(tenant_id=POOLED_TENANT, sharing_mode="strict")
        for memory in eval_set.memories:
            previous = ids.get(memory["key"]) if memory.get("supersedes") else None
            written = store.write(
                tenant_id=POOLED_TENANT,
                user_id=POOLED_USER,
                text=memory["text"],
                category=memory["category"],
                memory_id=previous[0] if previous else None,
            )
            ids[memory["key"]] = (written.memory_id, written.version)
    derived.sync_all(tenant_id=POOLED_TENANT)
    queries = []
    for query in eval_set.queries:
        asker = f"Team {query['team'].capitalize()}" if query.get("team") else query["user"].capitalize()
        queries.append({**query, "user": POOLED_USER, "team": None, "query": f"{asker}: {query['query']}"})
    return Corpus("pooled", ev.EvalSet(POOLED_TENANT, eval_set.k, {}, [], queries), ids)


Figures = dict[int, dict[str, float]]  # K -> precision, recall


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0


def rrf_figures(derived: DerivedStores, corpus: Corpus, ks: tuple[int, ...]) -> tuple[Figures, int, int]:
    """RRF's precision and recall per K (label judge) on the lists hybrid fuses; and how many hybrid
    recalls were exactly `fusion.fuse` of those same lists, of how many."""
    recaller = derived.recaller
    scored: dict[int, list[tuple[float, float]]] = {k: [] for k in ks}
    same = asked = 0
    for query in corpus.eval_set.queries:
        useful = {corpus.ids[key][0] for key in query["useful"] if key in corpus.ids}
        if not useful:
            continue
        for k in ks:
            kwargs: dict[str, Any] = {
                "tenant_id": corpus.eval_set.tenant,
                "user_id": query["user"],
                "team_id": query.get("team"),
                "query": query["query"],
                "k": k,
            }
            semantic, keyword = recaller.ranked_lists(**kwargs)
            retrieved = [memory_id for (memory_id, _), _ in rrf(semantic, keyword, k)]
            scored[k].append((ev.precision_at_k(retrieved, useful, k), ev.recall_at_k(retrieved, useful, k)))
            hybrid = recaller.recall(mode="hybrid", use_cache=False, **kwargs)
            fused = [source for source, _ in fusion.fuse(semantic, keyword, k)]
            same += [(h["memory_id"], h["version"]) for h in hybrid] == fused
            asked += 1
    figures = {
        k: {"precision": _mean([p for p, _ in v]), "recall": _mean([r for _, r in v])} for k, v in scored.items()
    }
    return figures, same, asked


def ratio(value: float, base: float) -> str:
    return f"{value / base:6.3f}" if base else "     -"


def report(name: str, rows: dict[str, Figures], ks: tuple[int, ...]) -> bool:
    """Print one corpus' table and ratios; whether hybrid met the target on it."""
    cols = [(k, metric) for k in ks for metric in ("precision", "recall")]
    print(f"{'':24}" + "".join(f"{metric[0].upper()}@{k:<5}" for k, metric in cols))
    for row in ROWS:
        label = f"{row} (baseline)" if row == "hybrid-rrf" else row
        print(f"{label:24}" + "".join(f"{rows[row][k][metric]:<8.3f}" for k, metric in cols))

    def best(k: int, metric: str) -> float:
        return max(rows["semantic"][k][metric], rows["keyword"][k][metric])

    for label, value, base in (
        ("hybrid / max(parts)", "hybrid", None),
        ("hybrid-rrf / max(parts)", "hybrid-rrf", None),
        ("hybrid / hybrid-rrf", "hybrid", "hybrid-rrf"),
    ):
        cells = [
            ratio(rows[value][k][metric], best(k, metric) if base is None else rows[base][k][metric])
            for k, metric in cols
        ]
        print(f"{label:24}" + "".join(f"{cell.strip():<8}" for cell in cells))
    met = all(rows["hybrid"][k]["recall"] >= best(k, "recall") for k in ks)
    met = met and (1 not in ks or rows["hybrid"][1]["precision"] >= best(1, "precision"))
    print(f"target on {name} (hybrid >= max(parts): recall@K at every K, precision@1): {'met' if met else 'MISSED'}")
    return met


def markdown(tables: dict[str, dict[str, Figures]], ks: tuple[int, ...]) -> str:
    """The table in docs/using.md: corpus | fusion row | P@K R@K per K."""
    head = "| corpus | recall | " + " | ".join(f"P@{k} | R@{k}" for k in ks) + " |"
    lines = [head, "|---|---|" + "---|" * (2 * len(ks))]
    for name, rows in tables.items():
        for row in ROWS:
            label = {"hybrid-rrf": "hybrid, RRF (old)", "hybrid": "**hybrid (new)**"}.get(row, row)
            cells = " | ".join(f"{rows[row][k]['precision']:.3f} | {rows[row][k]['recall']:.3f}" for k in ks)
            lines.append(f"| {name} | {label} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpora", default=",".join(CORPORA), help="of eval, demo, pooled")
    parser.add_argument("--ks", default=",".join(map(str, KS)), help="recall depths K")
    parser.add_argument("--embedder", choices=("minilm", "hashing"), default="minilm")
    parser.add_argument("--markdown", action="store_true", help="also print the figures as a Markdown table")
    parser.add_argument("--home", type=Path, help="data folder (default: a new temporary folder)")
    args = parser.parse_args()
    corpora = [c for c in CORPORA if c in args.corpora.split(",")]
    ks = tuple(sorted({int(k) for k in args.ks.split(",")}))
    home = args.home or temporary_home("mp-bench-quality-")
    settings = Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})
    store = open_store(settings)
    derived = open_derived(settings, store, embedder=HashingEmbedder() if args.embedder == "hashing" else None)
    print(f"home {home}; embedder {derived.vectors.embedder.name}; K in {ks}")
    eval_set = ev.load_eval_set()
    tables: dict[str, dict[str, Figures]] = {}
    met: dict[str, bool] = {}
    for name in corpora:
        started = time.perf_counter()
        if name == "eval":
            corpus = Corpus("eval", eval_set, ev.ready_eval_tenant(derived, eval_set))
        elif name == "demo":
            corpus = demo_corpus(store, derived)
        else:
            corpus = pooled_corpus(store, derived, eval_set)
        results = ev.evaluate(derived, corpus.eval_set, corpus.ids, ks=ks)
        rows = {mode: results[mode]["at_k"] for mode in ("semantic", "keyword", "hybrid")}
        rows["hybrid-rrf"], same, asked = rrf_figures(derived, corpus, ks)
        print(
            f"\n{name}: {results['hybrid']['queries']} queries, tenant {corpus.eval_set.tenant!r},"
            f" {time.perf_counter() - started:.1f} s; hybrid recalls equal to fusion.fuse of the same lists:"
            f" {same}/{asked}"
        )
        met[name] = report(name, rows, ks)
        tables[name] = rows
    if args.markdown:
        print()
        print(markdown(tables, ks))
    print()
    print("target (eval and demo): " + ("met" if all(met.get(c, True) for c in ("eval", "demo")) else "MISSED"))
    store.close()
    if args.home is None:
        discard(home)


if __name__ == "__main__":
    main()
