"""Subject and team summaries, sealed under the subject's or the team's key."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from memory_pipelines.lib.infra.progress import Progress, no_progress
from memory_pipelines.lib.stores.registry import ALL_SCOPES, StoreCheck, StoreSpec, Synced

if TYPE_CHECKING:
    from memory_pipelines.lib.stores.derived import DerivedStores


__all__ = [
    "BACKUP",
    "COMMON",
    "MUST_BE_ZERO",
    "SPECS",
    "problems",
    "sync",
]


def sync(derived: DerivedStores, *, scope: str, tenant_id: str, progress: Progress = no_progress) -> Synced:
    """Summarise every subject (or team) whose memories changed, under its own key."""
    summaries = derived.summaries
    counts = summaries.sync(tenant_id=tenant_id, scope=scope)
    return Synced(counts, text={"summarizer": summaries.summarizer.name})


def problems(derived: DerivedStores, *, scope: str, tenant_id: str) -> dict[str, int]:
    from memory_pipelines.lib.stores.summaries.store import ExtractiveSummarizer, SummaryStore

    # Checking reads no summary text, so the summarizer behind the asset does not matter here.
    return SummaryStore(derived.store, ExtractiveSummarizer()).check(tenant_id=tenant_id, scope=scope)


# Each subject's chosen summary mode: a consent-like choice a backup keeps (summaries are rebuilt).
BACKUP: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "summary_modes": ("derived.summary_modes", [("user_id", "string"), ("mode", "string")]),
}
COMMON: dict[str, Any] = {
    "owner": "team:memory-platform",
    "adapter_version": "summaries-v2",
    "max_completion_seconds": 600,
    "verification": "no summary lineage to a target version",
}
MUST_BE_ZERO = ("without_lineage", "from_non_current_versions")

SPECS = (
    StoreSpec(
        name="subject_summaries",
        locator_key="lineage(subject_summaries) -> subject:U",
        adapter="memory_pipelines.lib.stores.summaries.adapter:SubjectSummariesAdapter",
        order=50,
        key_erasure=ALL_SCOPES,
        sealed_by="a key of each build, destroyed by the next build or with the row (summaries built"
        " before build keys: the subject's or team's key)",
        asset="subject_summaries",
        sync=partial(sync, scope="subject"),
        asset_description="What the assistant knows about each user, summarised per their mode, encrypted under"
        " their key.",
        checks=(
            StoreCheck(
                "subject_summaries_lineage",
                "Every subject summary has lineage, and only to current versions.",
                partial(problems, scope="subject"),
                MUST_BE_ZERO,
            ),
        ),
        restore_drop="DELETE FROM derived.summaries WHERE tenant_id = %(t)s AND scope = 'subject'"
        " AND 'subject:' || scope_id = ANY(%(ids)s)",
        backup_tables=BACKUP,
        **COMMON,
    ),
    StoreSpec(
        name="team_summaries",
        locator_key="lineage(team_summaries) -> team:X",
        adapter="memory_pipelines.lib.stores.summaries.adapter:TeamSummariesAdapter",
        order=60,
        key_erasure=ALL_SCOPES,
        sealed_by="a key of each build, destroyed by the next build or with the row (summaries built"
        " before build keys: the team's key)",
        asset="team_summaries",
        sync=partial(sync, scope="team"),
        asset_description="What each team has shared, summarised and encrypted under the team key.",
        checks=(
            StoreCheck(
                "team_summaries_lineage",
                "Every team summary has lineage, and only to current versions.",
                partial(problems, scope="team"),
                MUST_BE_ZERO,
            ),
        ),
        restore_drop="DELETE FROM derived.summaries WHERE tenant_id = %(t)s AND scope = 'team'"
        " AND 'team:' || scope_id = ANY(%(ids)s)",
        **COMMON,
    ),
)
