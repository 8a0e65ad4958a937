"""`DerivedViews`: what the derived stores answer: lineage, summaries, analytics."""

from __future__ import annotations

from typing import cast

from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.lib.results import AnalyticsAnswer, LineageRecord, RecordSources, Summary, SummaryMode
from memory_pipelines.platform.parts import PlatformParts, check_tenant

__all__ = ["DerivedViews"]


class DerivedViews:
    """What the derived stores answer: lineage, summaries, analytics."""

    def __init__(self, parts: PlatformParts) -> None:
        self.parts = parts

    def lineage(
        self, *, tenant_id: str, memory_id: str | None = None, record: str | None = None
    ) -> list[LineageRecord] | RecordSources:
        """Derived records of every version of `memory_id` (a list), or the sources of a derived
        `record` (STORE:ID)."""
        check_tenant(tenant_id)
        if (memory_id is None) == (record is None):
            raise ValidationError("memory_id", "give exactly one of memory_id or record")
        if memory_id is not None:
            return self.parts.derived.lineage_of_memory(tenant_id=tenant_id, memory_id=memory_id)
        assert record is not None
        return self.parts.derived.sources_of_record(tenant_id=tenant_id, record=record)

    def lineage_picture(self, *, tenant_id: str, memory_id: str, fmt: str = "png") -> bytes:
        """A picture (png or svg) of one memory's lineage: its versions, each derived record, an edge per link."""
        from memory_pipelines.lib.forget.certificate import lineage_graph

        records = self.lineage(tenant_id=tenant_id, memory_id=memory_id)
        assert isinstance(records, list)  # a memory_id's lineage: always the list
        return lineage_graph(records, title=f"lineage of {memory_id}", fmt=fmt)

    def summary(self, *, tenant_id: str, subject: str | None = None, team_id: str | None = None) -> Summary:
        """A subject's summary, or else a team's (`team_id`), decrypted, with its sources."""
        check_tenant(tenant_id)
        if subject is not None and team_id is not None:
            raise ValidationError("subject", "give exactly one of subject or team_id")
        summaries = self.parts.derived.summaries
        if subject is not None:
            return summaries.read(tenant_id=tenant_id, scope="subject", scope_id=subject)
        # Kept: with neither subject nor team_id, None goes on to `read`, whose check of the id refuses it
        # (ValidationError naming team), as before; only the type checker is told it is a str.
        return summaries.read(tenant_id=tenant_id, scope="team", scope_id=cast(str, team_id))

    def set_summary_mode(self, *, tenant_id: str, subject: str, mode: str) -> SummaryMode:
        """How the subject's summary is made: full, summary or hybrid."""
        check_tenant(tenant_id)
        return self.parts.derived.summaries.set_mode(tenant_id=tenant_id, subject=subject, mode=mode)

    def analytics(self, *, tenant_id: str, sql: str) -> AnalyticsAnswer:
        """One SELECT over the tenant's analytics rows (the table `memories`), in a locked-down DuckDB.

        Only this tenant's rows, less those an accepted deletion hides; an unknown, deleted or
        restoring tenant is refused as by every read."""
        check_tenant(tenant_id)
        return self.parts.analytics.query(sql, tenant_id=tenant_id)
