"""`Checks`: the platform checking itself: memory quality over time, the deletion canary drill."""

from __future__ import annotations

from memory_pipelines.lib.results import CanaryDrill, EvaluationTrend
from memory_pipelines.platform.parts import PlatformParts

__all__ = ["Checks"]


class Checks:
    """The platform checking itself: memory quality over time, the deletion canary drill."""

    def __init__(self, parts: PlatformParts) -> None:
        self.parts = parts

    def evaluation_trend(self, *, mode: str = "hybrid") -> EvaluationTrend:
        """Month by month precision, recall (of recall `mode`) and drift of the evaluation tenant,
        with the Markdown table; `months` is empty before any `eval run`. `at_k`: every mode's
        precision and recall at K = 1, 5 and 10 in the evaluation computed last (empty before one)."""
        from memory_pipelines.lib.evaluation import evaluator

        evaluator.check_mode(mode)
        eval_set = evaluator.load_eval_set()
        rows = evaluator.trend(self.parts.store, tenant_id=eval_set.tenant, mode=mode)
        at_k = evaluator.latest_at_k(self.parts.store, tenant_id=eval_set.tenant)
        return {
            "tenant": eval_set.tenant,
            "mode": mode,
            "k": eval_set.k,
            "months": rows,
            "markdown": evaluator.trend_markdown(rows),
            "at_k": at_k,
            "at_k_markdown": evaluator.at_k_markdown(at_k) if at_k else "",
        }

    def canary_drill(self) -> CanaryDrill:
        """The end-to-end deletion drill in a tenant of its own (written, backed up, forgotten, erased,
        restored, offboarded); `passed` only when nothing of the canaries is left anywhere."""
        from memory_pipelines.lib.forget.canary import run_canary_drill

        derived, backups = self.parts.derived, self.parts.backups
        home = None if self.parts.settings.pg_url else self.parts.settings.home
        return run_canary_drill(derived, home=home, backups=backups)
