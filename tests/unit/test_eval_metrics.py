"""Memory-quality metrics on hand-made cases with known answers."""

from __future__ import annotations

from datetime import date

import pytest

from memory_pipelines.lib.evaluation import evaluator as ev


def test_precision_is_the_useful_share_of_the_top_k():
    assert ev.precision_at_k(["a", "b", "c"], {"a", "c"}, 3) == pytest.approx(2 / 3)
    assert ev.precision_at_k(["a", "b", "c"], {"a"}, 1) == 1.0
    assert ev.precision_at_k(["b", "a"], {"a"}, 1) == 0.0
    assert ev.precision_at_k(["a"], {"a", "b"}, 3) == 1.0  # fewer recalled than K: share of what came back
    assert ev.precision_at_k([], {"a"}, 3) == 0.0


def test_recall_is_the_share_of_useful_memories_found():
    assert ev.recall_at_k(["a", "b", "c"], {"a", "c", "d", "e"}, 3) == 0.5
    assert ev.recall_at_k(["b", "a"], {"a"}, 1) == 0.0
    assert ev.recall_at_k(["b", "a"], {"a"}, 2) == 1.0
    with pytest.raises(ev.ValidationError):
        ev.recall_at_k(["a"], set(), 1)


def test_drift_is_one_minus_the_share_still_recalled():
    assert ev.drift([True] * 9 + [False]) == pytest.approx(0.1)
    assert ev.drift([True, True]) == 0.0
    assert ev.drift([]) is None
    # Exact on a band's edge: 8 of 100 lost is 0.08 (WARN), where 1 - 92/100 is 0.07999999999999996.
    assert ev.drift([True] * 92 + [False] * 8) == 0.08
    assert ev.severity("drift", ev.drift([True] * 92 + [False] * 8)) == "WARN"


@pytest.mark.parametrize(
    ("metric", "value", "state"),
    [
        ("precision", 0.97, "PASS"),
        ("precision", 0.84, "PASS"),
        ("precision", 0.83, "WARN"),
        ("precision", 0.79, "ERROR"),
        ("drift", 0.05, "PASS"),
        ("drift", 0.08, "WARN"),
        ("drift", 0.10, "WARN"),
        ("drift", 0.12, "ERROR"),
        ("drift", None, "PASS"),
    ],
)
def test_severity_warns_at_80_percent_of_the_way_and_errors_past_the_threshold(metric, value, state):
    assert ev.severity(metric, value) == state


def test_trend_table_marks_the_states():
    table = ev.trend_markdown(
        [
            {"month": "2026-08", "precision": 0.86, "recall": 0.74, "drift": 0.07},
            {"month": "2026-09", "precision": 0.84, "recall": 0.72, "drift": 0.09},
            {"month": "2026-10", "precision": 0.78, "recall": 0.70, "drift": 0.12},
        ]
    )
    assert table.splitlines() == [
        "| month | precision | recall | drift |",
        "|---|---|---|---|",
        "| 2026-08 | 0.86 | 0.74 | 7.0% |",
        "| 2026-09 | 0.84 | 0.72 | 9.0% (WARN) |",
        "| 2026-10 | 0.78 (ERROR) | 0.70 | 12.0% (ERROR) |",
    ]


def test_the_shipped_evaluation_set_is_large_and_covers_the_boundaries():
    eval_set = ev.load_eval_set()
    kinds = {q["kind"] for q in eval_set.queries}
    assert len(eval_set.queries) >= 100
    assert {"direct", "paraphrase", "topic", "superseded", "team"} <= kinds
    assert any(m.get("supersedes") for m in eval_set.memories)


def test_per_k_table_has_a_line_per_k_and_every_mode_side_by_side():
    results = {
        mode: {
            "queries": 3,
            "judge": "label",
            "at_k": {1: {"precision": p, "recall": r}, 5: {"precision": p / 4, "recall": 1.0}},
        }
        for mode, p, r in (("semantic", 0.9, 0.8), ("keyword", 0.5, 0.4), ("hybrid", 0.96, 0.85))
    }
    rows = ev.at_k_rows(results, date(2026, 9, 1))
    assert {(r["mode"], r["k"]) for r in rows} == {(m, k) for m in results for k in (1, 5)}
    assert all(r["month"] == "2026-09" and r["queries"] == 3 and r["judge"] == "label" for r in rows)
    assert ev.at_k_markdown(rows).splitlines() == [
        "| K | precision semantic | recall semantic | precision keyword | recall keyword | precision hybrid"
        " | recall hybrid |",
        "|---|---|---|---|---|---|---|",
        "| 1 | 0.900 | 0.800 | 0.500 | 0.400 | 0.960 | 0.850 |",
        "| 5 | 0.225 | 1.000 | 0.125 | 1.000 | 0.240 | 1.000 |",
    ]
