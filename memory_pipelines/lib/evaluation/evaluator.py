"""Memory quality: precision@K and recall@K of recall per mode, and monthly drift, on an evaluation set.

The evaluation set (`assets/eval/memory_eval_set.json`) holds a tenant's memories (with the day
each was written and the query that produced it) and queries labelled with the memories useful to
answer them. Definitions (seed "memory evaluation metrics"):

- precision@K of a query: the share of the top K recalled memories the judge finds useful (the
  seed's `useful / len(top_k)`); the evaluation set uses K=1, the memory put first.
- recall@K: useful memories among the top K, divided by all the query's useful memories.
- drift of a month: among up to 100 memories written 30+ days before the month starts, the share
  whose own original query no longer recalls them in the top K (their author's view).

A memory that was forgotten is never recalled (every read path hides it), so it can never count.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import psycopg

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import ServiceError, ValidationError
from memory_pipelines.lib.infra.owner_only import private_dir, private_file
from memory_pipelines.lib.infra.paths import ASSETS_DIR
from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import AtK, TrendMonth
from memory_pipelines.lib.stores.derived import DerivedStores
from memory_pipelines.lib.stores.recall.recall import MODES

__all__ = [
    "CHART_MONTHS",
    "DRIFT_SAMPLE",
    "DRIFT_TARGET",
    "EVAL_SET",
    "INLINE_MARKDOWN",
    "PRECISION_TARGET",
    "REPORT_KS",
    "EvalSet",
    "Judge",
    "LLMJudge",
    "LabelJudge",
    "at_k_markdown",
    "at_k_rows",
    "check_mode",
    "drift",
    "evaluate",
    "latest_at_k",
    "load_eval_set",
    "measure_drift",
    "precision_at_k",
    "ready_eval_tenant",
    "recall_at_k",
    "save_results",
    "seed_eval_tenant",
    "severity",
    "trend",
    "trend_chart",
    "trend_markdown",
    "trend_svg_markdown",
]

EVAL_SET = ASSETS_DIR / "eval" / "memory_eval_set.json"
PRECISION_TARGET = 0.8
# The depths each evaluation reports beside the set's own K (`eval report`): the memory put first,
# a short prompt's worth, a long one's.
REPORT_KS = (1, 5, 10)
DRIFT_TARGET = 0.10
DRIFT_SAMPLE = 100


@dataclass(frozen=True)
class EvalSet:
    tenant: str
    k: int
    teams: dict[str, list[str]]
    memories: list[dict[str, Any]]
    queries: list[dict[str, Any]]


def load_eval_set(path: Path = EVAL_SET) -> EvalSet:
    """Read and check an evaluation set; errors name the field and the entry."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValidationError("eval_set", f"cannot read {path}: {exc}") from None
    keys = {m["key"] for m in doc.get("memories", [])}
    for query in doc.get("queries", []):
        unknown = sorted(set(query.get("useful", [])) - keys)
        if unknown:
            raise ValidationError("useful", f"query {query.get('id')!r} names unknown memories {unknown}")
    if not isinstance(doc.get("k"), int) or not 1 <= doc["k"] <= 100:
        raise ValidationError("k", "must be an integer from 1 to 100")
    return EvalSet(doc["tenant"], doc["k"], doc.get("teams", {}), doc["memories"], doc["queries"])


# -- metrics (pure) -------------------------------------------------------------------------------


def precision_at_k(retrieved: list[str], useful: set[str], k: int) -> float:
    """Share of the top K that is useful; 0 when nothing was recalled."""
    top = retrieved[:k]
    return sum(1 for memory in top if memory in useful) / len(top) if top else 0.0


def recall_at_k(retrieved: list[str], useful: set[str], k: int) -> float:
    if not useful:
        raise ValidationError("useful", "a query needs at least one useful memory")
    return len(set(retrieved[:k]) & useful) / len(useful)


def drift(still_recalled: list[bool]) -> float | None:
    """1 - share still recalled; None when nothing was old enough to sample."""
    # (n - kept) / n, not 1 - kept / n: 8 of 100 lost is exactly 0.08, on the WARN band's edge.
    return None if not still_recalled else (len(still_recalled) - sum(still_recalled)) / len(still_recalled)


# -- judges -----------------------------------------------------------------------------------


class Judge(Protocol):
    name: str

    def useful(self, *, query: str, memory_text: str, labelled_useful: bool) -> bool: ...


class LabelJudge:
    """Ground truth from the evaluation set's labels."""

    name = "label"

    def useful(self, *, query: str, memory_text: str, labelled_useful: bool) -> bool:
        return labelled_useful


class LLMJudge:
    """LLM-as-judge over an OpenAI-compatible chat completions API: is this memory useful for the query?"""

    def __init__(self, *, base_url: str, model: str, api_key: str | None = None, timeout: float = 30.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.name = f"llm:{model}"

    def useful(self, *, query: str, memory_text: str, labelled_useful: bool) -> bool:
        import httpx

        prompt = (
            "You judge a memory retrieval system. Answer with exactly one word, yes or no.\n"
            f"Question: {query}\nRetrieved memory: {memory_text}\n"
            "Is this memory useful to answer the question?"
        )
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            response = httpx.post(
                f"{self.base_url}/chat/completions",
                json={"model": self.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0},
                headers=headers,
                timeout=self.timeout,
            )
            response.raise_for_status()
            answer = str(response.json()["choices"][0]["message"]["content"]).strip().lower()
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise ServiceError("judge", f"the judge at {self.base_url} failed: {type(exc).__name__}: {exc}") from exc
        if answer.startswith("yes"):
            return True
        if answer.startswith("no"):
            return False
        raise ServiceError("judge", f"the judge answered neither yes nor no ({len(answer)} characters)")


# -- the evaluation tenant ------------------------------------------------------------------


# Any constant: the same in every process that prepares the evaluation tenant.
_EVAL_TENANT_LOCK = 7_150_433_213


@contextmanager
def _eval_tenant_lock(store: MemoryStore) -> Iterator[None]:
    conn = psycopg.connect(store.conninfo, autocommit=True)
    try:
        conn.execute("SELECT pg_advisory_lock(%s)", (_EVAL_TENANT_LOCK,))
        yield
    finally:
        conn.close()  # ends the session, so the lock goes with it even after an error


def ready_eval_tenant(derived: DerivedStores, eval_set: EvalSet) -> dict[str, tuple[str, int]]:
    """Seed the evaluation tenant and bring every derived store of it up to date, one caller at a
    time: `memory_eval` and `memory_drift` run as parallel steps, and months backfill in parallel
    runs; unserialized, two first seeds would write the set twice."""
    with _eval_tenant_lock(derived.store):
        ids = seed_eval_tenant(derived.store, eval_set)
        derived.sync_all(tenant_id=eval_set.tenant)
    return ids


def seed_eval_tenant(store: MemoryStore, eval_set: EvalSet) -> dict[str, tuple[str, int]]:
    """Write the evaluation tenant once (idempotent); returns key -> (memory_id, current version).

    Each memory's first write is dated by its `written_on` (the data's clock, which drift reads).
    """
    tenant = eval_set.tenant
    existing = _key_map(store, tenant)
    if existing is not None:
        return existing
    with validation.platform_owned():
        store.create_tenant(tenant_id=tenant, sharing_mode="shared_pool")
    for team, members in sorted(eval_set.teams.items()):
        for member in members:
            store.add_team_member(tenant_id=tenant, team_id=team, user_id=member)
    ids: dict[str, tuple[str, int]] = {}
    for memory in eval_set.memories:
        previous = ids.get(memory["key"]) if memory.get("supersedes") else None
        written = store.write(
            tenant_id=tenant,
            user_id=memory["user"],
            text=memory["text"],
            team_id=memory.get("team"),
            category=memory["category"],
            original_query=memory["original_query"],
            memory_id=previous[0] if previous else None,
        )
        ids[memory["key"]] = (written.memory_id, written.version)
        if previous is None:
            when = datetime.fromisoformat(memory["written_on"]).replace(tzinfo=UTC)
            with store.transaction() as conn:
                conn.execute(
                    "UPDATE memory.memories SET created_at = %s WHERE tenant_id = %s AND memory_id = %s",
                    (when, tenant, written.memory_id),
                )
                conn.execute(
                    "UPDATE memory.memory_versions SET created_at = %s WHERE tenant_id = %s AND memory_id = %s"
                    " AND version = 1",
                    (when, tenant, written.memory_id),
                )
                conn.execute(
                    "INSERT INTO control.eval_keys VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                    (tenant, memory["key"], written.memory_id),
                )
    return ids


def _key_map(store: MemoryStore, tenant: str) -> dict[str, tuple[str, int]] | None:
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT k.key, m.memory_id, m.current_version FROM control.eval_keys k JOIN memory.memories m"
            " ON m.tenant_id = k.tenant_id AND m.memory_id = k.memory_id WHERE k.tenant_id = %s",
            (tenant,),
        ).fetchall()
        known = conn.execute("SELECT count(*) FROM control.eval_keys WHERE tenant_id = %s", (tenant,)).fetchone()
    if not known or not known[0]:
        return None
    return {key: (memory_id, version) for key, memory_id, version in rows}


# -- evaluation ---------------------------------------------------------------------------------


def evaluate(
    derived: DerivedStores,
    eval_set: EvalSet,
    ids: dict[str, tuple[str, int]],
    *,
    judge: Judge | None = None,
    modes: tuple[str, ...] = MODES,
    k: int | None = None,
    ks: tuple[int, ...] = (),
    progress: Progress = no_progress,
) -> dict[str, dict[str, Any]]:
    """mode -> precision, recall (means over queries), query count; per-kind means too; `at_k`: the
    precision and recall of each K of `ks` (each a recall of the top K, as a user would ask it).
    `progress` hears of each query asked ("evaluation queries", over every mode)."""
    judge = judge or LabelJudge()
    k = k or eval_set.k
    depths = sorted({k, *ks})
    # The judge is asked once per query and memory, whatever the mode and K that recalled it.
    verdicts: dict[tuple[int, str], bool] = {}
    out: dict[str, dict[str, Any]] = {}
    total, asked = len(modes) * len(eval_set.queries), 0
    for mode in modes:
        scored: dict[int, list[tuple[str, float, float]]] = {depth: [] for depth in depths}  # (kind, p, r)
        for number, query in enumerate(eval_set.queries):
            asked += 1
            progress(asked, total, "evaluation queries")
            # A forgotten memory has no id any more, so it can be neither useful nor recalled.
            useful = {ids[key][0] for key in query["useful"] if key in ids}
            if not useful:
                continue
            for depth in depths:
                p, r = _score(derived, eval_set.tenant, query, useful, depth, mode, judge, verdicts, number)
                scored[depth].append((query["kind"], p, r))
        at = scored[k]
        kinds: dict[str, list[tuple[float, float]]] = {}
        for kind, p, r in at:
            kinds.setdefault(kind, []).append((p, r))
        out[mode] = {
            "precision": _mean([p for _, p, _ in at]),
            "recall": _mean([r for _, _, r in at]),
            "queries": len(at),
            "k": k,
            "judge": judge.name,
            "by_kind": {
                kind: {"precision": _mean([p for p, _ in v]), "recall": _mean([r for _, r in v]), "queries": len(v)}
                for kind, v in sorted(kinds.items())
            },
            "at_k": {
                depth: {
                    "precision": _mean([p for _, p, _ in scored[depth]]),
                    "recall": _mean([r for _, _, r in scored[depth]]),
                }
                for depth in sorted(set(ks))
            },
        }
    return out


def _score(
    derived: DerivedStores,
    tenant: str,
    query: dict[str, Any],
    useful: set[str],
    k: int,
    mode: str,
    judge: Judge,
    verdicts: dict[tuple[int, str], bool],
    number: int,
) -> tuple[float, float]:
    """Precision@k (judged) and recall@k (labelled) of query `number`'s recall in `mode`; `verdicts`
    keeps the judge's answers by (query number, memory id)."""
    hits = derived.recaller.recall(
        tenant_id=tenant,
        user_id=query["user"],
        team_id=query.get("team"),
        query=query["query"],
        k=k,
        mode=mode,
        use_cache=False,
    )
    retrieved = [h["memory_id"] for h in hits]
    for hit in hits:
        if (number, hit["memory_id"]) not in verdicts:
            verdicts[(number, hit["memory_id"])] = judge.useful(
                query=query["query"], memory_text=hit["text"], labelled_useful=hit["memory_id"] in useful
            )
    judged = {memory for memory in retrieved if verdicts[(number, memory)]}
    return precision_at_k(retrieved, judged, k), recall_at_k(retrieved, useful, k)


def measure_drift(
    derived: DerivedStores,
    tenant_id: str,
    *,
    month: date,
    k: int,
    mode: str = "hybrid",
    seed: int = 0,
    progress: Progress = no_progress,
) -> dict[str, Any]:
    """Drift of `month`: sample memories written 30+ days before it starts; do their original queries
    still recall them in the author's top K? `progress` hears of each sampled memory ("drift sample")."""
    cutoff = datetime.combine(month, datetime.min.time(), tzinfo=UTC) - timedelta(days=30)
    store = derived.store
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT m.memory_id, m.user_id, m.team_id FROM memory.memories m"
            " JOIN memory.subjects s ON s.tenant_id = m.tenant_id AND s.user_id = m.user_id"
            " JOIN memory.memory_versions v ON v.tenant_id = m.tenant_id AND v.memory_id = m.memory_id"
            " AND v.version = m.current_version"
            " WHERE m.tenant_id = %s AND m.created_at < %s AND v.original_query_ct IS NOT NULL"
            " AND s.forgotten_at IS NULL ORDER BY m.created_at, m.user_id, m.memory_id",
            (tenant_id, cutoff),
        ).fetchall()
    # Rows in an order of their own (memory ids are random): the same memories give the same sample.
    sample = random.Random(seed).sample(rows, min(DRIFT_SAMPLE, len(rows)))
    queries = store.original_queries(tenant_id=tenant_id, memory_ids=[r[0] for r in sample])
    still: list[bool] = []
    for index, (memory_id, user_id, team_id) in enumerate(sample):
        progress(index + 1, len(sample), "drift sample")
        query = queries.get(memory_id)
        if not query:
            continue
        hits = derived.recaller.recall(
            tenant_id=tenant_id, user_id=user_id, team_id=team_id, query=query, k=k, mode=mode, use_cache=False
        )
        still.append(memory_id in {h["memory_id"] for h in hits})
    return {"drift": drift(still), "sampled": len(still), "old_enough": len(rows), "cutoff": cutoff.date().isoformat()}


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0


def severity(metric: str, value: float | None) -> str:
    """PASS, WARN (at 80% of the way to the threshold) or ERROR (past it) for precision or drift."""
    if value is None:
        return "PASS"
    if metric == "precision":
        if value < PRECISION_TARGET:
            return "ERROR"
        return "WARN" if value < round(PRECISION_TARGET + 0.2 * (1 - PRECISION_TARGET), 6) else "PASS"
    if value > DRIFT_TARGET:
        return "ERROR"
    return "WARN" if value >= round(0.8 * DRIFT_TARGET, 6) else "PASS"


def save_results(
    store: MemoryStore, *, tenant_id: str, month: date, metric: str, rows: dict[str, dict[str, Any]]
) -> None:
    """Keep a month's figures (one row per mode, and per K of its `at_k`), replacing an earlier run of the
    same month."""
    with store.transaction() as conn:
        for mode, r in rows.items():
            conn.execute(
                "INSERT INTO control.eval_results (tenant_id, month, metric, mode, precision, recall, drift, k,"
                " queries, judge) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (tenant_id, month, metric, mode) DO UPDATE SET precision = EXCLUDED.precision,"
                " recall = EXCLUDED.recall, drift = EXCLUDED.drift, k = EXCLUDED.k, queries = EXCLUDED.queries,"
                " judge = EXCLUDED.judge, computed_at = now()",
                (
                    tenant_id,
                    month,
                    metric,
                    mode,
                    r.get("precision"),
                    r.get("recall"),
                    r.get("drift"),
                    r["k"],
                    r["queries"],
                    r["judge"],
                ),
            )
        if metric == "quality":
            _save_at_k(conn, tenant_id, month, rows)


def _save_at_k(conn: psycopg.Connection, tenant_id: str, month: date, rows: dict[str, dict[str, Any]]) -> None:
    """The month's per-K figures (`at_k` of each mode), replacing those of an earlier run."""
    conn.execute("DELETE FROM control.eval_results_at_k WHERE tenant_id = %s AND month = %s", (tenant_id, month))
    for mode, r in rows.items():
        for k, figures in r.get("at_k", {}).items():
            conn.execute(
                "INSERT INTO control.eval_results_at_k (tenant_id, month, mode, k, precision, recall, queries, judge)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                (tenant_id, month, mode, k, figures["precision"], figures["recall"], r["queries"], r["judge"]),
            )


def latest_at_k(store: MemoryStore, *, tenant_id: str) -> list[AtK]:
    """The per-K figures of the evaluation computed last (its month, mode by mode, K by K)."""
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT month, mode, k, precision, recall, queries, judge FROM control.eval_results_at_k"
            " WHERE tenant_id = %s AND month = (SELECT month FROM control.eval_results_at_k WHERE tenant_id = %s"
            " ORDER BY computed_at DESC, month DESC LIMIT 1) ORDER BY k, mode",
            (tenant_id, tenant_id),
        ).fetchall()
    return [
        {"month": m.strftime("%Y-%m"), "mode": mode, "k": k, "precision": p, "recall": r, "queries": q, "judge": j}
        for m, mode, k, p, r, q, j in rows
    ]


def at_k_rows(results: dict[str, dict[str, Any]], month: date) -> list[AtK]:
    """`evaluate`'s per-K figures as `latest_at_k` reads them back."""
    return [
        {
            "month": month.strftime("%Y-%m"),
            "mode": mode,
            "k": k,
            "precision": figures["precision"],
            "recall": figures["recall"],
            "queries": r["queries"],
            "judge": r["judge"],
        }
        for mode, r in results.items()
        for k, figures in sorted(r.get("at_k", {}).items())
    ]


def at_k_markdown(rows: Sequence[AtK]) -> str:
    """K | semantic, keyword and hybrid precision@K and recall@K: one line per K."""
    modes = [mode for mode in MODES if any(r["mode"] == mode for r in rows)]
    figures = {(r["k"], r["mode"]): r for r in rows}
    head = "| K | " + " | ".join(f"precision {m} | recall {m}" for m in modes) + " |"
    lines = [head, "|---" * (1 + 2 * len(modes)) + "|"]
    for k in sorted({r["k"] for r in rows}):
        cells = [
            f"{figures[(k, m)][key]:.3f}" if (k, m) in figures else "-"
            for m in modes
            for key in ("precision", "recall")
        ]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def check_mode(mode: object) -> str:
    """A recall mode the evaluation measures. An unknown one would match no row and read as "no
    evaluation yet": refused by name instead."""
    if mode not in MODES:
        raise ValidationError("mode", f"must be one of {', '.join(MODES)}")
    return str(mode)


def trend(store: MemoryStore, *, tenant_id: str, mode: str = "hybrid") -> list[TrendMonth]:
    """Month by month: precision and recall (of `mode`) and drift, oldest first."""
    check_mode(mode)
    with store.transaction() as conn:
        rows = conn.execute(
            "SELECT month, max(precision) FILTER (WHERE metric = 'quality'), max(recall) FILTER (WHERE metric ="
            " 'quality'), max(drift) FILTER (WHERE metric = 'drift') FROM control.eval_results"
            " WHERE tenant_id = %s AND mode = %s GROUP BY month ORDER BY month",
            (tenant_id, mode),
        ).fetchall()
    return [{"month": m.strftime("%Y-%m"), "precision": p, "recall": r, "drift": d} for m, p, r, d in rows]


def trend_markdown(rows: list[TrendMonth]) -> str:
    """The dashboard table: month | precision | recall | drift, with the threshold states."""

    def cell(value: float | None, metric: str | None = None) -> str:
        if value is None:
            return "-"
        text = f"{value:.1%}" if metric == "drift" else f"{value:.2f}"
        state = severity(metric, value) if metric else "PASS"
        return text if state == "PASS" else f"{text} ({state})"

    lines = ["| month | precision | recall | drift |", "|---|---|---|---|"]
    lines += [
        f"| {r['month']} | {cell(r['precision'], 'precision')} | {cell(r['recall'])} | {cell(r['drift'], 'drift')} |"
        for r in rows
    ]
    return "\n".join(lines)


def trend_chart(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """A PNG of the trend with both thresholds drawn; returns `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    months = [r["month"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    for key, label in (("precision", "precision@K"), ("recall", "recall@K"), ("drift", "drift")):
        xs = [m for m, r in zip(months, rows, strict=True) if r[key] is not None]
        ax.plot(xs, [r[key] for r in rows if r[key] is not None], marker="o", label=label)
    ax.axhline(PRECISION_TARGET, color="tab:blue", linestyle=":", linewidth=1, label="precision target 0.8")
    ax.axhline(DRIFT_TARGET, color="tab:green", linestyle=":", linewidth=1, label="drift limit 10%")
    ax.set_ylim(0, 1.05)
    ax.set_title("Memory quality by month")
    ax.legend(loc="center left", fontsize=7, frameon=False)
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.tight_layout()
    private_dir(path.parent)
    fig.savefig(path)
    plt.close(fig)
    private_file(path)
    return path


# Months the inline chart draws: Dagster renders a Markdown metadata value in place only while it
# is under 1,000 characters (longer ones sit behind "[Show Markdown]"), so the chart is a small SVG.
CHART_MONTHS = 12
INLINE_MARKDOWN = 1000
_SERIES = (("precision", "blue"), ("recall", "darkorange"), ("drift", "green"))


def trend_svg_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The trend as a Markdown image of an inline SVG (under 1,000 characters): precision, recall and
    drift of the last CHART_MONTHS months (fewer if need be), the precision target and drift limit dashed."""
    rows = rows[-CHART_MONTHS:]
    while True:
        chart = _svg_markdown(rows)
        if len(chart) < INLINE_MARKDOWN or len(rows) <= 1:
            return chart
        rows = rows[1:]


def _svg_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    step = 200 / max(len(rows) - 1, 1)

    def point(i: int, v: float) -> str:
        return f"{round(28 + i * step) if len(rows) > 1 else 128} {round(85 - 80 * min(max(v, 0.0), 1.0))}"

    lines = []
    for key, color in _SERIES:
        points = [point(i, r[key]) for i, r in enumerate(rows) if r[key] is not None]
        if points:  # a lone month is a dot: a zero-length segment with a wide round cap
            lone = " stroke-width='6'" if len(points) == 1 else ""
            lines.append(f"<path d='M{'L'.join(points)}{'h0' if lone else ''}' stroke='{color}'{lone}/>")
    target, limit = (round(85 - 80 * v) for v in (PRECISION_TARGET, DRIFT_TARGET))
    months = [rows[0]["month"], rows[-1]["month"]] if len(rows) > 1 else [r["month"] for r in rows]
    svg = (
        "<svg xmlns='http://www.w3.org/2000/svg' width='480' viewBox='0 0 240 108' font-size='7'>"
        "<g fill='none' stroke-linecap='round' stroke-width='2'><path d='M26 5V85H232' stroke='gray'/>"
        f"<path d='M26 {target}H232M26 {limit}H232' stroke='gray' stroke-dasharray='2'/>{''.join(lines)}</g>"
        "<text x='2' y='8'>1.0</text><text x='2' y='88'>0</text>"
        + "".join(f"<text x='{26 + 180 * n}' y='95'>{m}</text>" for n, m in enumerate(months))
        + "".join(f"<text x='{28 + 60 * n}' y='105' fill='{c}'>{k}</text>" for n, (k, c) in enumerate(_SERIES))
        + "</svg>"
    )
    # A CommonMark destination in <...> may hold spaces; '<' and '>' must be escaped inside it.
    return f"![memory quality](<data:image/svg+xml,{svg.replace('<', '%3C').replace('>', '%3E')}>)"
