import base64
import warnings
from datetime import date
from pathlib import Path

import dagster as dg

from memory_pipelines.lib.evaluation import evaluator as evaluation
from memory_pipelines.lib.infra.progress import throttled
from memory_pipelines.lib.stores.derived import DerivedStores
from memory_pipelines.resources import (
    AnalyticsResource,
    ChromaResource,
    JudgeResource,
    MemoryStoreResource,
    SummarizerResource,
    derived_stores,
)

# Completed months (UTC); the monthly schedule evaluates the one that just ended.
months = dg.MonthlyPartitionsDefinition(start_date="2026-01-01", end_offset=0)
EVAL: dict = {
    "partitions_def": months,
    "group_name": "evaluation",
    "owners": ["team:memory-platform"],
    "kinds": {"python"},
}


def _ready(derived: DerivedStores) -> tuple[evaluation.EvalSet, dict[str, tuple[str, int]]]:
    """The evaluation tenant, written once and brought up to date in every derived store (serialized:
    both assets call this in parallel steps). It is never a `tenants` partition (lib.canary's rule)."""
    eval_set = evaluation.load_eval_set()
    return eval_set, evaluation.ready_eval_tenant(derived, eval_set)


def _dashboard(derived: DerivedStores, tenant: str, home: str) -> dict[str, dg.MetadataValue]:
    rows = evaluation.trend(derived.store, tenant_id=tenant)
    chart = evaluation.trend_chart(rows, Path(home).resolve() / "eval" / "memory_quality.png")
    image = base64.b64encode(chart.read_bytes()).decode()
    table = evaluation.trend_markdown(rows)
    return {
        # Under 1,000 characters, so the asset page draws it in place (the PNG sits behind a button).
        "trend_chart": dg.MetadataValue.md(evaluation.trend_svg_markdown(rows)),
        "trend": dg.MetadataValue.md(f"{table}\n\n![memory quality by month](data:image/png;base64,{image})"),
    }


def _month_figures(derived: DerivedStores, tenant: str, month: date) -> dict[str, dg.MetadataValue]:
    """The month's graded precision and recall beside its drift: numbers Dagster plots by partition."""
    rows = evaluation.trend(derived.store, tenant_id=tenant)
    row = next((r for r in rows if r["month"] == month.strftime("%Y-%m")), None)
    return {
        f"{key}_{GRADED_MODE}": dg.MetadataValue.float(float(value))
        for key in ("precision", "recall")
        if row is not None and (value := row[key]) is not None
    }


# The recall mode both checks grade; the other modes' figures are reported beside it.
GRADED_MODE = "hybrid"
# The bands of evaluation.severity: WARN in the last 20% before the threshold.
PRECISION_WARN_BELOW = round(evaluation.PRECISION_TARGET + 0.2 * (1 - evaluation.PRECISION_TARGET), 6)
DRIFT_WARN_FROM = round(0.8 * evaluation.DRIFT_TARGET, 6)
BANDS = {
    "precision": {
        "error": f"precision < {evaluation.PRECISION_TARGET}",
        "warn": f"{evaluation.PRECISION_TARGET} <= precision < {PRECISION_WARN_BELOW}",
        "pass": f"precision >= {PRECISION_WARN_BELOW}",
    },
    "drift": {
        "error": f"drift > {evaluation.DRIFT_TARGET}",
        "warn": f"{DRIFT_WARN_FROM} <= drift <= {evaluation.DRIFT_TARGET}",
        "pass": f"drift < {DRIFT_WARN_FROM}",
    },
}


def _spec(name: str, asset: str, metric: str, what: str) -> dg.AssetCheckSpec:
    """A check of one month partition of `asset`, describing the graded mode and its bands."""
    bands = BANDS[metric]
    description = (
        f"{what}, {GRADED_MODE} recall mode, for the month partition evaluated. ERROR when {bands['error']};"
        f" WARN band {bands['warn']}; passes when {bands['pass']}."
    )
    # Per-month checks need a partitioned AssetCheckSpec, a preview feature in this release (see
    # forget/checks.py): its warning is silenced here only.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", category=dg.PreviewWarning)
        return dg.AssetCheckSpec(
            name,
            asset=asset,
            description=description,
            partitions_def=months,
            metadata={"mode": GRADED_MODE, **{f"{band}_band": rule for band, rule in bands.items()}},
        )


PRECISION_CHECK = _spec("precision_target", "memory_eval", "precision", "Precision@K on the evaluation set")
DRIFT_CHECK = _spec(
    "drift_target",
    "memory_drift",
    "drift",
    "Share of 30+-day-old memories their own original query no longer recalls in the author's top K",
)


def _check(name: str, metric: str, value: float | None, month: str) -> dg.AssetCheckResult:
    state = evaluation.severity(metric, value)
    return dg.AssetCheckResult(
        check_name=name,
        passed=state == "PASS",
        severity=dg.AssetCheckSeverity.ERROR if state == "ERROR" else dg.AssetCheckSeverity.WARN,
        description=f"{month[:7]}: {state} ({GRADED_MODE} mode; WARN band {BANDS[metric]['warn']})",
        metadata={
            metric: dg.MetadataValue.float(-1.0 if value is None else float(value)),
            "state": state,
            "mode": GRADED_MODE,
            "month": month[:7],
            "warn_band": BANDS[metric]["warn"],
        },
    )


@dg.asset(check_specs=[PRECISION_CHECK], tags={"domain": "evaluation"}, **EVAL)
def memory_eval(
    context: dg.AssetExecutionContext,
    memory_store: MemoryStoreResource,
    chroma: ChromaResource,
    summarizer: SummarizerResource,
    analytics: AnalyticsResource,
    judge: JudgeResource,
) -> dg.MaterializeResult:
    """Monthly recall quality on the evaluation set: precision@K and recall@K per recall mode."""
    derived = derived_stores(memory_store, chroma, summarizer, analytics)
    eval_set, ids = _ready(derived)
    month = date.fromisoformat(context.partition_key)
    results = evaluation.evaluate(
        derived, eval_set, ids, judge=judge.judge(), ks=evaluation.REPORT_KS, progress=throttled(context.log.info)
    )
    evaluation.save_results(derived.store, tenant_id=eval_set.tenant, month=month, metric="quality", rows=results)
    metadata: dict[str, dg.MetadataValue] = {"queries": dg.MetadataValue.int(results["hybrid"]["queries"])}
    for mode, r in results.items():
        metadata[f"precision_{mode}"] = dg.MetadataValue.float(r["precision"])
        metadata[f"recall_{mode}"] = dg.MetadataValue.float(r["recall"])
    metadata["k"] = dg.MetadataValue.int(eval_set.k)
    # Every mode at K = 1, 5 and 10 (figures only): hybrid should match or beat the better of its parts.
    metadata["at_k"] = dg.MetadataValue.md(evaluation.at_k_markdown(evaluation.at_k_rows(results, month)))
    metadata["judge"] = dg.MetadataValue.text(results["hybrid"]["judge"])
    metadata.update(_dashboard(derived, eval_set.tenant, memory_store.home))
    return dg.MaterializeResult(
        metadata=metadata,
        check_results=[
            _check("precision_target", "precision", results[GRADED_MODE]["precision"], context.partition_key)
        ],
    )


# After memory_eval: the month's dashboard then shows the precision and recall just measured.
@dg.asset(check_specs=[DRIFT_CHECK], deps=[memory_eval], tags={"domain": "evaluation"}, **EVAL)
def memory_drift(
    context: dg.AssetExecutionContext,
    memory_store: MemoryStoreResource,
    chroma: ChromaResource,
    summarizer: SummarizerResource,
    analytics: AnalyticsResource,
) -> dg.MaterializeResult:
    """Monthly drift: share of 30+-day-old memories their own original query no longer recalls."""
    derived = derived_stores(memory_store, chroma, summarizer, analytics)
    eval_set, _ = _ready(derived)
    month = date.fromisoformat(context.partition_key)
    result = evaluation.measure_drift(
        derived, eval_set.tenant, month=month, k=eval_set.k, progress=throttled(context.log.info)
    )
    evaluation.save_results(
        derived.store,
        tenant_id=eval_set.tenant,
        month=month,
        metric="drift",
        rows={"hybrid": {"drift": result["drift"], "k": eval_set.k, "queries": result["sampled"], "judge": "recall"}},
    )
    metadata: dict[str, dg.MetadataValue] = {
        "drift": dg.MetadataValue.float(-1.0 if result["drift"] is None else result["drift"]),
        "sampled": dg.MetadataValue.int(result["sampled"]),
        "old_enough": dg.MetadataValue.int(result["old_enough"]),
        "written_before": dg.MetadataValue.text(result["cutoff"]),
        **_month_figures(derived, eval_set.tenant, month),
    }
    metadata.update(_dashboard(derived, eval_set.tenant, memory_store.home))
    return dg.MaterializeResult(
        metadata=metadata, check_results=[_check("drift_target", "drift", result["drift"], context.partition_key)]
    )
