"""Subject and team summaries, sealed under the subject's or the team's key."""

from memory_pipelines.lib.stores.registry import StoreSpec

SPECS = (
    StoreSpec(
        name="subject_summaries",
        owner="team:memory-platform",
        locator_key="lineage(subject_summaries) -> subject:U",
        adapter_version="summaries-v2",
        max_completion_seconds=600,
        verification="no summary lineage to a target version",
        adapter="memory_pipelines.lib.stores.summaries.adapter:SubjectSummariesAdapter",
        order=50,
    ),
    StoreSpec(
        name="team_summaries",
        owner="team:memory-platform",
        locator_key="lineage(team_summaries) -> team:X",
        adapter_version="summaries-v2",
        max_completion_seconds=600,
        verification="no summary lineage to a target version",
        adapter="memory_pipelines.lib.stores.summaries.adapter:TeamSummariesAdapter",
        order=60,
    ),
)
