"""Raw throughput of MiniLMEmbedder on short memory-like sentences, against padding every input to 256 tokens.

Usage: python benchmarks/embedding_raw.py [--n 2000] [--repeat 3] [--threads N] [--batch-size 32]

The "padded to 256" figure runs the same graph on the same texts, with every batch padded to max_tokens, which is
what Chroma's stock ONNX embedding function does.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import numpy as np

from memory_pipelines.lib.stores.embedding import MiniLMEmbedder, pad_batch

SUBJECTS = ["I", "My sister", "Alex", "The user", "My manager", "Our team", "Dr. Patel", "My landlord", "Sam", "Mum"]
VERBS = [
    "prefers",
    "is allergic to",
    "booked",
    "forgot about",
    "wants to learn",
    "recommended",
    "cancelled",
    "loves",
    "complained about",
    "paid for",
]
OBJECTS = [
    "penicillin",
    "the dentist appointment",
    "a window seat on long flights",
    "oat milk in coffee",
    "the quarterly budget review",
    "Italian lessons",
    "the broken dishwasher",
    "a trip to Lisbon",
    "vegetarian restaurants near the office",
    "the gym membership",
    "the new project roadmap",
    "jazz concerts",
]
TAILS = [
    "",
    "next Tuesday",
    "since last spring",
    "because the old one kept failing",
    "and asked me to remind them in two weeks",
    "according to the email from this morning",
    "but only on weekends when the weather is good",
    "after the long meeting with the finance department on Friday afternoon",
    "so please keep that in mind whenever we plan dinners, trips or anything involving food together",
]


def make_sentences(n: int, seed: int = 7) -> list[str]:
    """Deterministic, varied 5-25 word sentences."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}".split()
        words = words[:25]
        if len(words) < 5:
            words += ["(note", str(i) + ")"]
        out.append(" ".join(words).rstrip(",") + ".")
    return out


def embed_padded_to_max(embedder: MiniLMEmbedder, texts: list[str]) -> np.ndarray:
    """Same graph, but every batch padded to max_tokens (Chroma's stock behaviour)."""
    sequences = embedder.tokenize(texts)
    parts = []
    for start in range(0, len(sequences), embedder.batch_size):
        ids, mask = pad_batch(sequences[start : start + embedder.batch_size], length=embedder.max_tokens)
        parts.append(embedder.run(ids, mask))
    return np.concatenate(parts)


def timed(fn: Callable[[list[str]], np.ndarray], texts: list[str]) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    result = fn(texts)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2000, help="sentences to embed (default 2000)")
    parser.add_argument("--padded-n", type=int, default=None, help="sentences for the padded-to-256 run (default n/10)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3, help="timed passes over the n sentences (default 3)")
    args = parser.parse_args()

    texts = make_sentences(args.n)
    padded_n = args.padded_n or max(args.batch_size, args.n // 10)
    embedder = MiniLMEmbedder(batch_size=args.batch_size, threads=args.threads)

    start = time.perf_counter()
    embedder.embed(texts[:64])  # warm-up: builds the graph and the session
    build_s = time.perf_counter() - start
    embed_padded_to_max(embedder, texts[: args.batch_size])

    lengths = [len(s) for s in embedder.tokenize(texts)]
    words = [len(t.split()) for t in texts]
    print(f"model            : {embedder.name} ({embedder.dimension}-d), threads={embedder.threads}")
    shape = f"{min(words)}-{max(words)} words, tokens mean {np.mean(lengths):.1f}"
    print(f"texts            : {len(texts)} sentences, {shape}")
    print(f"first call       : {build_s:.2f} s (graph build + session + 64 sentences)")

    rates = []
    for _ in range(args.repeat):
        seconds, dynamic = timed(embedder.embed, texts)
        rates.append(len(texts) / seconds)
    rate = float(np.median(rates))
    spread = f"min {min(rates):.1f}, max {max(rates):.1f}, {args.repeat} passes of {len(texts)}"
    print(f"per-batch padding: {rate:8.1f} sentences/s  (median; {spread})")

    subset = texts[:padded_n]
    seconds_p, padded = timed(lambda t: embed_padded_to_max(embedder, t), subset)
    rate_p = len(subset) / seconds_p
    print(f"padded to {embedder.max_tokens:<7}: {rate_p:8.1f} sentences/s  ({len(subset)} in {seconds_p:.2f} s)")
    print(f"speed-up         : {rate / rate_p:8.1f} x")
    print(f"max |diff|       : {np.abs(dynamic[:padded_n] - padded).max():.2e} (same texts, both paddings)")


if __name__ == "__main__":
    main()
