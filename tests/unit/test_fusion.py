"""Hybrid recall's fusion on hand-made lists (pure: no engine), beside the reciprocal rank fusion it
replaced (issue 23), which the first cases show failing."""

from __future__ import annotations

import random

import pytest

from benchmarks.recall_quality import rrf
from memory_pipelines.lib.stores.recall.fusion import fuse


def src(name: str, version: int = 1) -> tuple[str, int]:
    return (f"m_{name}", version)


def ids(ranked: list[tuple[tuple[str, int], float]]) -> list[str]:
    return [memory_id.removeprefix("m_") for (memory_id, _), _ in ranked]


def test_a_weak_keyword_hit_does_not_unseat_a_clear_semantic_answer():
    """The keyword list holds one memory sharing one word of five with the query: rank fusion put it
    first (its two ranks beat the semantic answer's one), the score sum keeps the semantic answer."""
    semantic = [(src("a"), 0.62), (src("b"), 0.31), (src("c"), 0.30)]
    keyword = [(src("c"), 0.2)]
    assert ids(rrf(semantic, keyword, 1)) == ["c"]
    assert ids(fuse(semantic, keyword, 1)) == ["a"]
    assert ids(fuse(semantic, keyword, 3)) == ["a", "c", "b"]


def test_a_memory_holding_every_query_word_rises_above_close_semantic_neighbours():
    semantic = [(src("a"), 0.55), (src("b"), 0.52), (src("c"), 0.50)]
    keyword = [(src("c"), 1.0), (src("a"), 0.25), (src("b"), 0.25)]
    assert ids(rrf(semantic, keyword, 1)) == ["a"]  # rank 1 + rank 2 beats rank 3 + rank 1
    assert ids(fuse(semantic, keyword, 3)) == ["c", "a", "b"]


def test_a_list_alone_keeps_its_own_order_and_scores():
    semantic = [(src("a"), 0.7), (src("b"), 0.4), (src("c"), -0.1)]
    keyword = [(src("d"), 1.0), (src("e"), 0.5), (src("f"), 0.5)]
    assert fuse(semantic, [], 5) == semantic
    assert fuse([], keyword, 5) == keyword
    assert fuse(semantic, [], 2) == semantic[:2]


def test_a_candidate_in_both_lists_scores_the_sum():
    assert fuse([(src("a"), 0.5)], [(src("a"), 0.75)], 1) == [(src("a"), 1.25)]


def test_ties_go_to_the_smaller_memory_id_then_version_whatever_the_input_order():
    semantic = [(src("b"), 0.5), (src("a", 2), 0.5), (src("a", 1), 0.5)]
    keyword = [(src("c"), 0.5)]
    expected = [src("a", 1), src("a", 2), src("b"), src("c")]
    assert [s for s, _ in fuse(semantic, keyword, 4)] == expected
    assert [s for s, _ in fuse(list(reversed(semantic)), keyword, 4)] == expected


@pytest.mark.parametrize("k", [1, 3, 100])
def test_empty_lists_fuse_to_nothing(k):
    assert fuse([], [], k) == []


def test_never_worse_than_a_part_that_is_right_while_the_other_has_nothing():
    """Random lists: when one list is empty, the fusion is that list's own top k (a list best alone
    is never degraded by an empty or absent other)."""
    rng = random.Random(23)
    for _ in range(200):
        n = rng.randint(1, 30)
        ranked = sorted(
            ((src(f"{i:03d}"), round(rng.random(), 2)) for i in range(n)), key=lambda item: (-item[1], item[0])
        )
        k = rng.randint(1, 40)
        assert fuse(ranked, [], k) == ranked[:k]
        assert fuse([], ranked, k) == ranked[:k]


def test_a_candidate_at_least_as_good_in_both_lists_is_never_ranked_below():
    """Monotone: whoever scores at least as well in each list (absent counts 0) is not ranked lower."""
    rng = random.Random(7)
    for _ in range(200):
        pool = [src(f"{i:02d}") for i in range(rng.randint(2, 15))]
        semantic = [(s, round(rng.random(), 2)) for s in pool if rng.random() < 0.8]
        keyword = [(s, rng.choice([0.25, 0.5, 0.75, 1.0])) for s in pool if rng.random() < 0.4]
        fused = fuse(semantic, keyword, len(pool))
        position = {s: i for i, (s, _) in enumerate(fused)}
        sem, kw = dict(semantic), dict(keyword)
        for x in position:
            for y in position:
                if x < y and sem.get(x, 0) >= sem.get(y, 0) and kw.get(x, 0) >= kw.get(y, 0):
                    assert position[x] < position[y], (x, y, semantic, keyword)
