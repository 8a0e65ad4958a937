"""Retention: policies as data, and the daily sweep that removes memories whose period ended.

A memory's period starts when it was first written and follows the category of its current
version. Day D's sweep removes the memories whose period ended on D (UTC) or earlier without
being swept (a missed day, a tightened policy), through the deletion cascade (scope RETENTION:
every version, tombstoned at once, verified, one proof per tenant and day with counts by
category). Sweeping a day twice finds nothing the second time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from typing import Any, Protocol

import yaml

from memory_pipelines.lib.forget.deletion import DeletionService
from memory_pipelines.lib.forget.switches import DeletionPaused
from memory_pipelines.lib.infra import faults
from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.lib.infra.paths import ASSETS_DIR
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.results import RetentionJob, RetentionPreview, RetentionSweep

__all__ = [
    "FIRST_DAY",
    "KNOWN_CATEGORIES",
    "POLICY_FILE",
    "Policies",
    "RetentionReads",
    "StoreRetentionReads",
    "check_day",
    "check_sweep_day",
    "expired",
    "immediate",
    "load_policies",
    "period_end",
    "preview",
    "sweep",
]

POLICY_FILE = ASSETS_DIR / "retention_policies.yaml"
# The earliest day a sweep may be asked for (UTC); the `retention` job is partitioned by tenant.
FIRST_DAY = "2024-01-01"
# Categories the product knows. A policy for anything else is almost surely a typo, and a typo
# in a retention policy silently keeps data forever, so it is refused at load.
KNOWN_CATEGORIES = frozenset(
    {"general", "medical", "financial", "educational", "legal", "health", "work", "travel", "food", "preference"}
    | {"eu_user"}
)


@dataclass(frozen=True)
class Policies:
    version: str
    keep_days: dict[str, int]
    immediate: frozenset[str]


def load_policies(path: Path = POLICY_FILE) -> Policies:
    """Parse and check a policy file; errors name the file, the line and the field."""
    text = path.read_text(encoding="utf-8")
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        raise ValidationError("retention_policies", f"{path.name} is not valid YAML: {exc}") from exc
    if not isinstance(root, yaml.MappingNode):
        raise ValidationError("retention_policies", f"{path.name} must be a mapping with `version` and `policies`")
    top = {key.value: value for key, value in root.value}
    version = top.get("version")
    if not isinstance(version, yaml.ScalarNode) or not version.value:
        raise ValidationError("retention_policies", f"{path.name}: `version` is required")
    policies = top.get("policies")
    if not isinstance(policies, yaml.MappingNode):
        raise ValidationError("retention_policies", f"{path.name}: `policies` must map categories to rules")
    keep: dict[str, int] = {}
    immediate: set[str] = set()
    for key, rule in policies.value:
        where = f"{path.name} line {key.start_mark.line + 1}"
        category = key.value
        if category not in KNOWN_CATEGORIES:
            raise ValidationError(
                "category", f"{where}: unknown category {category!r} (known: {', '.join(sorted(KNOWN_CATEGORIES))})"
            )
        if category in keep or category in immediate:
            raise ValidationError("category", f"{where}: {category!r} has two policies")
        fields = {k.value: v for k, v in rule.value} if isinstance(rule, yaml.MappingNode) else None
        if fields is None or set(fields) - {"keep_days", "immediate"} or len(fields) != 1:
            raise ValidationError(
                "policy", f"{where}: {category!r} needs exactly one of `keep_days: N` or `immediate: true`"
            )
        if "immediate" in fields:
            if fields["immediate"].value != "true":
                raise ValidationError("immediate", f"{where}: `immediate` can only be true")
            immediate.add(category)
            continue
        node = fields["keep_days"]
        try:
            days = int(node.value)
        except ValueError:
            days = -1
        if days < 1:
            raise ValidationError(
                "keep_days",
                f"{path.name} line {node.start_mark.line + 1}: keep_days of {category!r} must be a whole number"
                f" of days >= 1, got {node.value!r}",
            )
        keep[category] = days
    return Policies(version=str(version.value), keep_days=keep, immediate=frozenset(immediate))


# Days a sweep or preview may name: a policy's period subtracted from (or a day added to) any of
# them stays a valid date; 0001-01-01 minus seven years is not one (OverflowError).
MIN_DAY, MAX_DAY = date(1970, 1, 1), date(9000, 12, 31)


def check_day(day: Any) -> date:
    """A sweep day from a date or an ISO string (field `date`), from 1970-01-01 to 9000-12-31."""
    if isinstance(day, date) and not isinstance(day, datetime):
        the_day = day
    else:
        try:
            the_day = date.fromisoformat(str(day))
        except ValueError:
            raise ValidationError("date", f"must be a day as YYYY-MM-DD, got {day!r}") from None
    if not MIN_DAY <= the_day <= MAX_DAY:
        raise ValidationError(
            "date", f"must be from {MIN_DAY.isoformat()} to {MAX_DAY.isoformat()}, got {the_day.isoformat()}"
        )
    return the_day


def check_sweep_day(day: Any, *, today: date | None = None) -> date:
    """A day whose sweep may remove data: one that has ended (UTC), so before today.

    Day D removes what the policies let go by the end of D; a sweep of today, or of a day to
    come, would remove memories whose retention has not ended yet (`2099-01-01`: every memory of
    every category with a policy, in every tenant). Checked here, under every entry point.
    """
    the_day = check_day(day)
    today = today or datetime.now(UTC).date()
    if the_day >= today:
        raise ValidationError(
            "date", f"must be a day that has ended (UTC), before {today.isoformat()}; got {the_day.isoformat()}"
        )
    return the_day


# Memories whose period ended by the end of the day (on it, or earlier and not swept yet: a missed
# day, a tightened policy, a category changed to a shorter one), first written before
# day + 1 - keep for their current category; hidden and deleted or restoring tenants left out.
_EXPIRED = (
    "SELECT m.tenant_id, m.memory_id, v.category FROM memory.memories m"
    " JOIN memory.memory_versions v ON v.tenant_id = m.tenant_id AND v.memory_id = m.memory_id"
    " AND v.version = m.current_version"
    " JOIN memory.subjects s ON s.tenant_id = m.tenant_id AND s.user_id = m.user_id"
    " JOIN memory.tenants x ON x.tenant_id = m.tenant_id"
    " WHERE v.category = %(category)s AND m.created_at < %(end)s"
    " AND (%(tenant)s::text IS NULL OR m.tenant_id = %(tenant)s)"
    " AND x.deleted_at IS NULL AND x.restoring_since IS NULL AND s.forgotten_at IS NULL"
    " AND NOT EXISTS (SELECT 1 FROM control.tombstones t WHERE t.tenant_id = v.tenant_id"
    " AND t.memory_id = v.memory_id AND t.version = v.version)"
)
_IMMEDIATE = (
    "SELECT m.tenant_id, m.memory_id, v.category FROM memory.memories m"
    " JOIN memory.memory_versions v ON v.tenant_id = m.tenant_id AND v.memory_id = m.memory_id"
    " AND v.version = m.current_version"
    " JOIN memory.subjects s ON s.tenant_id = m.tenant_id AND s.user_id = m.user_id"
    " JOIN memory.tenants x ON x.tenant_id = m.tenant_id"
    " WHERE v.category = ANY(%(categories)s) AND s.forgotten_at IS NULL"
    " AND x.deleted_at IS NULL AND x.restoring_since IS NULL"
    " AND (%(tenant)s::text IS NULL OR m.tenant_id = %(tenant)s)"
    " AND NOT EXISTS (SELECT 1 FROM control.tombstones t WHERE t.tenant_id = v.tenant_id"
    " AND t.memory_id = v.memory_id AND t.version = v.version)"
)


class RetentionReads(Protocol):
    """What retention reads of a memory store: `MemoryStore` through `StoreRetentionReads`, or the
    in-memory store of lib/memories/in_memory.py in unit tests. Rows are (tenant, memory id, category)
    of current, not hidden memories of open tenants, by their current version's category."""

    def expiring(self, *, written_before: dict[str, datetime], tenant_id: str | None) -> list[tuple[str, str, str]]:
        """Those whose category is a key of `written_before` and were first written before its value,
        category by category in sorted order, from one snapshot of the store."""
        ...

    def in_categories(self, *, categories: list[str], tenant_id: str | None) -> list[tuple[str, str, str]]:
        """Those whose category is one of `categories`, whenever written."""
        ...


@dataclass(frozen=True)
class StoreRetentionReads:
    store: MemoryStore

    def expiring(self, *, written_before: dict[str, datetime], tenant_id: str | None) -> list[tuple[str, str, str]]:
        rows: list[tuple[str, str, str]] = []
        with self.store.transaction() as conn:
            for category, end in sorted(written_before.items()):
                params = {"category": category, "end": end, "tenant": tenant_id}
                rows += [(t, m, c) for t, m, c in conn.execute(_EXPIRED, params)]
        return rows

    def in_categories(self, *, categories: list[str], tenant_id: str | None) -> list[tuple[str, str, str]]:
        with self.store.transaction() as conn:
            params = {"categories": categories, "tenant": tenant_id}
            return [(t, m, c) for t, m, c in conn.execute(_IMMEDIATE, params)]


def period_end(day: date, keep_days: int) -> datetime:
    """The first instant a memory kept `keep_days` may still have been written and outlive day `day`:
    written before it, its period ended by the end of `day` (UTC)."""
    return datetime.combine(day - timedelta(days=keep_days), time.min, tzinfo=UTC) + timedelta(days=1)


def expired(
    reads: RetentionReads, *, day: date, policies: Policies, tenant_id: str | None = None
) -> dict[str, dict[str, list[str]]]:
    """tenant -> category -> memory ids whose retention ended by the end of `day`, not yet removed
    (on it, or earlier and not swept yet: a missed day, a tightened policy, a category changed to a
    shorter one)."""
    out: dict[str, dict[str, list[str]]] = {}
    ends = {category: period_end(day, keep) for category, keep in policies.keep_days.items()}
    for tenant, memory_id, cat in reads.expiring(written_before=ends, tenant_id=tenant_id):
        out.setdefault(tenant, {}).setdefault(cat, []).append(memory_id)
    return out


def immediate(reads: RetentionReads, *, policies: Policies, tenant_id: str | None = None) -> dict[str, list[str]]:
    """tenant -> memory ids in categories kept for no time at all (they go through forget)."""
    out: dict[str, list[str]] = {}
    if not policies.immediate:
        return out
    for tenant, memory_id, _ in reads.in_categories(categories=sorted(policies.immediate), tenant_id=tenant_id):
        out.setdefault(tenant, []).append(memory_id)
    return out


def preview(store: MemoryStore, *, day: Any, policies: Policies | None = None) -> RetentionPreview:
    """What a sweep of `day` would remove: counts per tenant and category, nothing else.

    Any day is allowed, a future one too ("what will the sweep of 2027-01-01 take?"): a preview
    writes nothing and shows counts only, never ids or text.
    """
    the_day = check_day(day)
    policies = policies or load_policies()
    reads = StoreRetentionReads(store)
    found = expired(reads, day=the_day, policies=policies)
    return {
        "date": the_day.isoformat(),
        "policy_version": policies.version,
        "tenants": {t: {c: len(ids) for c, ids in sorted(cats.items())} for t, cats in sorted(found.items())},
        "immediate": {t: len(ids) for t, ids in sorted(immediate(reads, policies=policies).items())},
        "total": sum(len(ids) for cats in found.values() for ids in cats.values()),
    }


def sweep(
    service: DeletionService,
    *,
    day: Any,
    policies: Policies | None = None,
    tenant_id: str | None = None,
    run: bool = True,
) -> RetentionSweep:
    """Request (and with `run`, carry out) the removal of what day `day`'s retention ended.

    One RETENTION job per tenant with expired memories (`tenant_id`: that tenant only); `immediate`
    categories become forget requests (MEMORY scope, basis gdpr-art17). Without `run` the jobs wait
    for the forget sensor; with it, `stores` counts what each tenant's batch removed per store.
    `day` must have ended (see `check_sweep_day`).
    """
    the_day = check_sweep_day(day)
    policies = policies or load_policies()
    reads = StoreRetentionReads(service.store)
    found = expired(reads, day=the_day, policies=policies, tenant_id=tenant_id)
    requested: dict[str, tuple[str, dict[str, int]]] = {}  # tenant -> its job id and categories
    for tenant, categories in sorted(found.items()):
        job = service.request_retention(
            tenant_id=tenant,
            day=the_day,
            memory_ids=sorted(m for ids in categories.values() for m in ids),
            categories={c: len(ids) for c, ids in sorted(categories.items())},
            policy_version=policies.version,
        )
        assert job is not None
        requested[tenant] = (job["job_id"], job["categories"])
    forgets: dict[str, list[str]] = {}
    for tenant, memory_ids in sorted(immediate(reads, policies=policies, tenant_id=tenant_id).items()):
        forgets[tenant] = [
            service.request(tenant_id=tenant, memory_id=m, basis="gdpr-art17")["job_id"] for m in memory_ids
        ]
    faults.point("retention.requested")
    stores: dict[str, dict[str, int]] = {}
    paused: list[str] = []
    if run:
        for tenant in sorted(set(requested) | set(forgets)):
            batch = ([requested[tenant][0]] if tenant in requested else []) + forgets.get(tenant, [])
            try:
                stores[tenant] = service.run_batch(tenant_id=tenant, job_ids=batch)["stores"]
            except DeletionPaused:
                paused.append(tenant)  # requested and hidden; the forget sensor runs them on resume
    jobs: dict[str, RetentionJob] = {
        tenant: {"job_id": job_id, "categories": categories, "state": service.status(job_id=job_id)["state"]}
        for tenant, (job_id, categories) in requested.items()
    }
    return {
        "date": the_day.isoformat(),
        "policy_version": policies.version,
        "removed": sum(sum(entry["categories"].values()) for entry in jobs.values()),
        "jobs": jobs,
        "immediate_forget_jobs": {t: len(ids) for t, ids in forgets.items()},
        "immediate_forget_job_ids": forgets,
        "stores": stores,
        "paused": paused,
    }
