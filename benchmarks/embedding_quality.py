"""The int8 embedding model against float32, speed and quality from one run.

    .venv/bin/python -m benchmarks.embedding_quality            # 2,000 sentences, ingest of 10,000 memories

Prints, in this order:
- raw throughput of each model on the same sentences (`embedding_raw.make_sentences`), passes interleaved so both
  see the same machine, and the ratio int8 / float32 (target: int8 >= 500 sentences/s);
- mean and minimum cosine between the two models' vectors of every text of the evaluation set and of the demo
  corpus (target: mean >= 0.99);
- the evaluation (`assets/eval/memory_eval_set.json`, label judge) under each model: precision@K and recall@K of
  semantic and hybrid recall for K = 1, 5, 10, with the difference in points (target: within 1 point);
- end-to-end ingest with the int8 model (`benchmarks/ingest.py`'s corpus, write and every derived store) against
  raw int8 embedding of the same texts (target: >= 0.8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.embedding_raw import make_sentences
from benchmarks.homes import discard, temporary_home
from benchmarks.ingest import run_ingest
from memory_pipelines.lib.evaluation.evaluator import evaluate, load_eval_set, ready_eval_tenant
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.runtime import open_store
from memory_pipelines.lib.stores.derived import open_derived
from memory_pipelines.lib.stores.embedding import MiniLMEmbedder

ASSETS = Path(__file__).resolve().parents[1] / "assets"
KS = (1, 5, 10)


def corpora() -> dict[str, list[str]]:
    """Every text of the evaluation set (memories and queries) and of the demo corpus."""
    eval_set = json.loads((ASSETS / "eval" / "memory_eval_set.json").read_text())
    demo = json.loads((ASSETS / "demo" / "corpus.json").read_text())
    return {
        "evaluation set": [m["text"] for m in eval_set["memories"]] + [q["query"] for q in eval_set["queries"]],
        "demo corpus": [m["text"] for m in demo["memories"]]
        + [m["original_query"] for m in demo["memories"] if m.get("original_query")]
        + [demo["versioned"][key] for key in ("first", "second")],
    }


def raw_rates(models: dict[str, MiniLMEmbedder], texts: list[str], passes: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(passes):
        for name, model in models.items():
            start = time.perf_counter()
            model.embed(texts)
            rates[name].append(len(texts) / (time.perf_counter() - start))
    return rates


def quality(settings: Settings, models: dict[str, MiniLMEmbedder]) -> dict[str, dict[tuple[str, int], tuple]]:
    """model -> (mode, K) -> (precision, recall) on the evaluation set; the tenant is re-embedded per model
    (its collection is rebuilt when the model changes, as in production)."""
    eval_set = load_eval_set()
    store = open_store(settings)
    out: dict[str, dict[tuple[str, int], tuple]] = {}
    try:
        for name, model in models.items():
            derived = open_derived(settings, store, embedder=model)
            ids = ready_eval_tenant(derived, eval_set)
            out[name] = {}
            for k in KS:
                for mode, figures in evaluate(derived, eval_set, ids, modes=("semantic", "hybrid"), k=k).items():
                    out[name][(mode, k)] = (figures["precision"], figures["recall"])
    finally:
        store.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000, help="sentences for the raw figures (default 2,000)")
    parser.add_argument("--passes", type=int, default=3, help="timed passes per model (default 3)")
    parser.add_argument("--ingest", type=int, default=10_000, help="memories for the ingest figure (default 10,000)")
    parser.add_argument("--home", type=Path, help="data folder (default: a new temporary folder)")
    args = parser.parse_args()
    home = args.home or temporary_home("mp-bench-embedding-")
    settings = Settings.from_env({"MEMORY_PIPELINES_HOME": str(home)})
    models = {"float32": MiniLMEmbedder(quantized=False), "int8": MiniLMEmbedder()}
    for name, model in models.items():
        start = time.perf_counter()
        model.embed(["warm up"])
        print(f"{name:8} {model.name}: first call {time.perf_counter() - start:.2f} s (load or build, cached)")

    texts = make_sentences(args.n)
    rates = raw_rates(models, texts, args.passes)
    fp32, int8 = (statistics.median(rates[name]) for name in ("float32", "int8"))
    print(f"\nraw, {len(texts):,} sentences, {args.passes} interleaved passes each (median, min-max):")
    for name, values in rates.items():
        print(f"  {name:8} {statistics.median(values):8.1f} sentences/s  ({min(values):.1f}-{max(values):.1f})")
    verdict = "met" if int8 >= 500 else "MISSED"
    print(f"  int8 / float32: {int8 / fp32:.2f}x; int8 >= 500 sentences/s: {verdict}")

    print("\ncosine int8 vs float32:")
    for corpus, corpus_texts in corpora().items():
        cosines = np.sum(models["float32"].embed(corpus_texts) * models["int8"].embed(corpus_texts), axis=1)
        verdict = "met" if cosines.mean() >= 0.99 else "MISSED"
        mean, low = cosines.mean(), cosines.min()
        print(f"  {corpus:15} {len(corpus_texts):4} texts  mean {mean:.4f}  min {low:.4f}  ({verdict})")

    figures = quality(settings, models)
    print("\nevaluation set, label judge (points = 100 x difference, int8 - float32):")
    header = f"{'P float32':>9} {'P int8':>7} {'pts':>5}  {'R float32':>9} {'R int8':>7} {'pts':>5}"
    print(f"  {'mode':9} {'K':>2}  {header}")
    worst = 0.0
    for mode, k in figures["float32"]:
        (p32, r32), (p8, r8) = figures["float32"][(mode, k)], figures["int8"][(mode, k)]
        dp, dr = 100 * (p8 - p32), 100 * (r8 - r32)
        worst = max(worst, abs(dp), abs(dr))
        print(f"  {mode:9} {k:>2}  {p32:9.4f} {p8:7.4f} {dp:+5.1f}  {r32:9.4f} {r8:7.4f} {dr:+5.1f}")
    print(f"  largest difference {worst:.1f} points (within 1 point: {'met' if worst <= 1.0 else 'MISSED'})")

    result = run_ingest(settings, models["int8"], n=args.ingest, subjects=100, tenant="bench-int8")
    print(f"\ningest of {args.ingest:,} memories with the int8 model:")
    result.print()
    print(f"  end to end / raw int8: {result.ratio:.2f} (target >= 0.8: {'met' if result.ratio >= 0.8 else 'MISSED'})")
    if args.home is None:
        discard(home)


if __name__ == "__main__":
    main()
