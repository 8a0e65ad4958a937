import dagster as dg

from memory_pipelines.lib.evaluation.evaluator import Judge, LabelJudge, LLMJudge


class JudgeResource(dg.ConfigurableResource):
    """Whether a recalled memory is useful: the evaluation set's labels, or an LLM when `base_url` is set."""

    base_url: str | None = None
    model: str | None = None
    api_key: str | None = None
    timeout_seconds: float = 30.0

    def judge(self) -> Judge:
        if not self.base_url:
            return LabelJudge()
        if not self.model:
            raise dg.Failure("judge: a model is required with base_url (MEMORY_PIPELINES_JUDGE_MODEL)")
        return LLMJudge(base_url=self.base_url, model=self.model, api_key=self.api_key, timeout=self.timeout_seconds)
