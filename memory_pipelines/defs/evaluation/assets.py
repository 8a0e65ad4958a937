import base64
from datetime import date
from pathlib import Path

import dagster as dg

from memory_pipelines.lib import evaluation
from memory_pipelines.lib.derived import DerivedStores
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
        "trend": dg.MetadataValue.md(f"{table}\n\n![memory quality by month](data:image/png;base64,{image})"),
        "trend_chart": dg.MetadataValue.path(str(chart)),
    }


def _check(name: str, metric: str, value: float | None) -> dg.AssetCheckResult:
    state = evaluation.severity(metric, value)
    return dg.AssetCheckResult(
        check_name=name,
        passed=state == "PASS",
        severity=dg.AssetCheckSeverity.ERROR if state == "ERROR" else dg.AssetCheckSeverity.WARN,
        metadata={metric: dg.MetadataValue.float(-1.0 if value is None else float(value)), "state": state},
    )


@dg.asset(
    check_specs=[dg.AssetCheckSpec("precision_target", asset="memory_eval", description="precision@K >= 0.8")],
    **EVAL,
)
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
    results = evaluation.evaluate(derived, eval_set, ids, judge=judge.judge())
    evaluation.save_results(derived.store, tenant_id=eval_set.tenant, month=month, metric="quality", rows=results)
    metadata: dict[str, dg.MetadataValue] = {"queries": dg.MetadataValue.int(results["hybrid"]["queries"])}
    for mode, r in results.items():
        metadata[f"precision_{mode}"] = dg.MetadataValue.float(r["precision"])
        metadata[f"recall_{mode}"] = dg.MetadataValue.float(r["recall"])
    metadata["k"] = dg.MetadataValue.int(eval_set.k)
    metadata["judge"] = dg.MetadataValue.text(results["hybrid"]["judge"])
    metadata.update(_dashboard(derived, eval_set.tenant, memory_store.home))
    return dg.MaterializeResult(
        metadata=metadata, check_results=[_check("precision_target", "precision", results["hybrid"]["precision"])]
    )


@dg.asset(
    check_specs=[dg.AssetCheckSpec("drift_target", asset="memory_drift", description="drift < 10% a month")],
    **EVAL,
)
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
    result = evaluation.measure_drift(derived, eval_set.tenant, month=month, k=eval_set.k)
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
    }
    metadata.update(_dashboard(derived, eval_set.tenant, memory_store.home))
    return dg.MaterializeResult(metadata=metadata, check_results=[_check("drift_target", "drift", result["drift"])])
