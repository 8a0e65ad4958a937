"""Hybrid recall's fusion of the semantic and keyword lists: the sum of their own similarities.

Each candidate scores its cosine similarity to the query (semantic list) plus the share of the
query's tokens it holds (keyword list), 0 for a list it is not in (CombSUM, Fox & Shaw 1994), and the
top k by that sum are kept, ties to the smaller (memory_id, version).

Why the scores and not the ranks: both are similarities on a fixed scale on which 1 is the query
itself (the same embedding; every query token present), so a list with little to say adds little
and a strong match adds much. Reciprocal rank fusion, the fusion this replaced, gives each list's
first answer the same weight whatever its score: a keyword hit sharing one common word of five
counts as much as one holding every word, so a poor list drags the good one down (issue 23; the
evaluation set asked in one pooled scope: recall@1 0.64 to 0.70 fused by rank, 0.90 to 0.92 for
semantic alone, 0.92 to 0.93 for this sum). Per-list normalisation (min-max, z-scores) has the same
flaw, the best of a poor list becoming 1.

No constant is tuned: the two similarities are added as they are. Weighting the keyword share from
0.5 to 5 gives the same recall on the project's evaluation set, the demo corpus and the pooled set
(`benchmarks/recall_quality.py`; docs/using.md "Memory quality evaluation").
"""

from __future__ import annotations

__all__ = ["Ranked", "fuse"]

# (memory_id, version) and its score, best first.
Ranked = list[tuple[tuple[str, int], float]]


def fuse(semantic: Ranked, keyword: Ranked, k: int) -> Ranked:
    """The top k of both lists by cosine similarity + keyword share, with that sum as the score."""
    fused: dict[tuple[str, int], float] = {}
    for ranked in (semantic, keyword):
        for source, score in ranked:
            fused[source] = fused.get(source, 0.0) + score
    return sorted(fused.items(), key=lambda item: (-item[1], item[0]))[:k]
