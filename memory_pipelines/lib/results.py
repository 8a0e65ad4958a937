"""The shapes of what leaves the library: every answer `MemoryPlatform` (and so the CLI) returns.

Each TypedDict names the keys of one answer exactly as the library builds it today, so a caller
(a host application, the CLI printing JSON) can rely on them and a type checker can check them.
They describe plain dicts: nothing changes at run time, `json.dumps` prints them as before.
Times are ISO 8601 strings; ids are strings; no answer holds a key or ciphertext.

This module imports nothing from the rest of the package (lib never imports Dagster, nor anything
of memory_pipelines outside lib).
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "AdapterPin",
    "AnalyticsAnswer",
    "AtK",
    "BackupListing",
    "BackupManifest",
    "BackupStub",
    "BackupTaken",
    "BackupsExpired",
    "CanaryDrill",
    "CanaryErasure",
    "CanaryRestore",
    "DeletionJob",
    "DeletionPause",
    "DeletionProof",
    "DeletionRequest",
    "DeletionScope",
    "DerivedRecord",
    "DoNotSell",
    "EvaluationTrend",
    "ExplainedMemory",
    "ExportedVersion",
    "KeysConverted",
    "KeysShredded",
    "LeaseRevoked",
    "LineageRecord",
    "MemoryVersion",
    "MemoryWrite",
    "NoticeDelivery",
    "NoticeSent",
    "Notification",
    "NotificationsDelivered",
    "PromptSnapshot",
    "RecallHit",
    "RecordSource",
    "RecordSources",
    "RestoreReport",
    "RestoreRequest",
    "RetentionJob",
    "RetentionPreview",
    "RetentionSweep",
    "RollBack",
    "RunExplanation",
    "RunLease",
    "SnapshotEntry",
    "StoreAdapter",
    "Summary",
    "SummaryMode",
    "SyncCounts",
    "TeamMemberAdded",
    "TeamMemberRemoved",
    "TenantInfo",
    "TenantMode",
    "TenantReopened",
    "TestTenant",
    "TrendMonth",
    "VisibleMemory",
]

# -- memories ------------------------------------------------------------------------------------


class MemoryWrite(TypedDict):
    """A write (`MemoryStore.write(...).as_dict()`): `changed` False for an identical re-write."""

    tenant_id: str
    memory_id: str
    version: int
    user_id: str
    team_id: str | None
    changed: bool


class MemoryVersion(TypedDict):
    """One version of a memory, decrypted (`MemoryStore.history`)."""

    memory_id: str
    version: int
    text: str
    current: bool
    user_id: str
    team_id: str | None
    category: str
    shareable: bool
    confidence: float
    original_query: str | None
    restored_from: int | None
    created_at: str | None
    superseded_at: str | None


class RollBack(TypedDict):
    """A rollback (`MemoryStore.rollback`): the new version, and the one it copies."""

    tenant_id: str
    memory_id: str
    version: int
    text: str
    restored_from: int
    skipped: NotRequired[list[int]]  # versions passed over (forgotten, or dropped by a restore)


class VisibleMemory(TypedDict):
    """A current memory a user sees (`MemoryStore.list_visible`)."""

    memory_id: str
    version: int
    text: str
    user_id: str
    team_id: str | None
    memory_type: str
    shareable: bool
    category: str
    confidence: float
    do_not_sell: bool
    created_at: str | None
    updated_at: str | None


class ExportedVersion(TypedDict):
    """One version of a subject's export (`MemoryStore.iter_export`)."""

    memory_id: str
    version: int
    current: bool
    text: str
    team_id: str | None
    memory_type: str
    shareable: bool
    category: str
    confidence: float
    original_query: str | None
    do_not_sell: bool
    restored_from: int | None
    created_at: str | None
    superseded_at: str | None


class RecallHit(TypedDict):
    """One recalled memory (`Recaller.recall`), best first."""

    memory_id: str
    version: int
    text: str
    score: float
    user_id: str
    team_id: str | None
    category: str
    cached: bool


# store asset -> its counts (`DerivedStores.sync_all`)
SyncCounts = dict[str, dict[str, int]]

# -- tenants and teams ---------------------------------------------------------------------------


class TenantInfo(TypedDict):
    """A tenant with its sharing mode and counts (`MemoryStore.tenants`)."""

    tenant_id: str
    sharing_mode: str
    change_seq: int
    created_at: str | None
    memories: int
    subjects: int
    teams: int


class TestTenant(TypedDict):
    """`MemoryStore.set_test_tenant`: whether onboarding stores receive the tenant's memories."""

    tenant_id: str
    test: bool


class NoticeDelivery(TypedDict):
    """One channel's state of one notice: attempts, when delivered or next tried, the last error."""

    channel: str
    attempts: int
    delivered_at: str | None
    next_attempt_at: str
    last_error: str | None


class Notification(TypedDict):
    """`MemoryPlatform.notifications`: a deletion job's notice (COMPLETE or ERASED) and its deliveries."""

    job_id: str
    tenant_id: str
    event: str
    queued_at: str
    delivered_at: str | None
    deliveries: list[NoticeDelivery]


class NoticeSent(TypedDict):
    """One delivery attempt of `MemoryPlatform.deliver_notifications`."""

    channel: str
    job_id: str
    event: str
    idempotency_key: str
    attempt: int
    error: NotRequired[str]
    next_attempt_at: NotRequired[str]


class NotificationsDelivered(TypedDict):
    """`MemoryPlatform.deliver_notifications`: what was sent, what failed (retried later), what is left."""

    channels: list[str]
    delivered: list[NoticeSent]
    failed: list[NoticeSent]
    pending: int


class TenantMode(TypedDict):
    """`MemoryStore.create_tenant` and `MemoryStore.set_sharing_mode`."""

    tenant_id: str
    sharing_mode: str


class TeamMemberAdded(TypedDict):
    """`MemoryStore.add_team_member`: `added` False when the user was a member already."""

    tenant_id: str
    team_id: str
    user_id: str
    added: bool
    members: list[str]


class TeamMemberRemoved(TypedDict):
    """`MemoryStore.remove_team_member`."""

    tenant_id: str
    team_id: str
    user_id: str
    removed: bool
    members: list[str]


class DoNotSell(TypedDict):
    """`MemoryStore.set_do_not_sell`: `memory_id` or `subject`, whichever was flagged."""

    tenant_id: str
    memory_id: NotRequired[str]
    subject: NotRequired[str]
    do_not_sell: bool


# -- lineage and summaries -----------------------------------------------------------------------


class LineageRecord(TypedDict):
    """A derived record of one version of a memory (`DerivedStores.lineage_of_memory`)."""

    store: str
    record_id: str
    memory_id: str
    version: int


class RecordSource(TypedDict):
    """A memory version a derived record was made from."""

    memory_id: str
    version: int


class RecordSources(TypedDict):
    """The sources of one derived record `STORE:ID` (`DerivedStores.sources_of_record`)."""

    store: str
    record_id: str
    sources: list[RecordSource]


class Summary(TypedDict):
    """A subject's or a team's summary, decrypted (`SummaryStore.read`)."""

    tenant_id: str
    scope: str  # subject or team
    scope_id: str
    mode: str
    summary: str
    source_count: int
    summarizer: str
    created_at: str
    sources: list[RecordSource]


class SummaryMode(TypedDict):
    """`SummaryStore.set_mode`."""

    tenant_id: str
    subject: str
    mode: str


class AnalyticsAnswer(TypedDict):
    """One SELECT over one tenant's analytics rows (`AnalyticsStore.query`)."""

    columns: list[str]
    rows: list[list[Any]]
    truncated: bool


# -- forgetting ----------------------------------------------------------------------------------


class DeletionScope(TypedDict):
    type: str  # SUBJECT, MEMORY, TENANT or RETENTION
    subject: str | None
    memory_id: str | None
    version: int | None


class DeletionPause(TypedDict):
    """`MemoryPlatform.pause_deletions`: deletion work of a tenant (None: every tenant) paused since
    `paused_at`, until `resumed_at` (None: still paused)."""

    pause_id: int
    tenant_id: str | None
    reason: str
    paused_at: str
    resumed_at: str | None


class AdapterPin(TypedDict):
    """`MemoryPlatform.pin_adapter` / `unpin_adapter`: the adapter version later cascades run for a store."""

    store: str
    version: str
    default: str
    reason: str | None


class StoreAdapter(TypedDict):
    """`MemoryPlatform.adapters`: the deletion adapter version a store's cascades run now, its
    default, the versions it ships, and the operator's pin (None: not pinned)."""

    store: str
    version: str
    default: str
    shipped: list[str]
    pinned: dict[str, str] | None


class DeletionJob(TypedDict):
    """A deletion job's status (`DeletionLedger.status`): ids, HMACs, counts and states, never text."""

    job_id: str
    tenant_id: str
    state: str  # REQUESTED, FROZEN, DELETING, VERIFYING, BLOCKED or COMPLETE
    scope: DeletionScope
    scope_hash: str
    basis: str
    deadline: str
    targets: dict[str, str]  # store -> PENDING, DONE:n, FAILED:CODE, ...
    target_versions: int | None
    attempts: int
    created_at: str
    completed_at: str | None
    # An open job of a paused tenant: the pause that holds it (nothing cascades until resumed)
    paused: NotRequired[DeletionPause]
    # RETENTION jobs only
    sweep_date: NotRequired[str]
    categories: NotRequired[dict[str, int]]
    retentionPolicyVersion: NotRequired[str]


class DeletionRequest(DeletionJob):
    """An accepted request (`DeletionService.request`): `duplicate` when an open job had that scope."""

    duplicate: bool


class DeletionProof(TypedDict):
    """The proof of a COMPLETE job (`DeletionLedger.proof`), as stored: camelCase keys."""

    jobId: str
    scope: dict[str, str]  # type, tenant
    scopeHash: str
    subjectEpoch: int | None
    basis: str
    policyVersion: str
    targetVersions: int
    targets: dict[str, str]
    rebuilt: dict[str, int]
    adapterVersions: dict[str, Any]
    verification: dict[str, Any]
    requestedAt: str
    completedAt: str
    deadline: str
    sweepDate: NotRequired[str]
    categories: NotRequired[dict[str, int]]
    erasure: NotRequired[dict[str, Any]]  # once the tenant's physical erasure ran
    # store -> {cryptographic, physical}: which guarantee held (lib/forget/guarantees.py); proofs
    # of jobs completed before issue 32 have none until their erasure.
    guarantees: NotRequired[dict[str, dict[str, Any]]]


class KeysShredded(TypedDict):
    """`DeletionService.shred_keys`: the keys destroyed, and the forget job of the same scope."""

    tenant_id: str
    subject: str | None
    destroyed_keys: list[str]
    forget_job: DeletionRequest


class KeysConverted(TypedDict):
    """One tenant of `MemoryPlatform.convert_keys`: texts an older release sealed under their author's
    key, sealed again under version keys (lib/memories/key_conversion.py). Counts only."""

    tenant_id: str
    subjects: int  # subjects converted
    resealed: int  # versions sealed again under keys of their own
    macs: int  # text MACs recomputed under a subject's new key
    retired: int  # subject keys retired (they had sealed texts)
    retired_destroyed: int  # retired keys destroyed, every backup that needed them expired
    postings_rekeyed: NotRequired[int]  # keyword postings rewritten under the new keys


# -- backups -------------------------------------------------------------------------------------


class BackupStub(TypedDict):
    """What every backup's manifest holds, even one in flight or failed."""

    format: int
    backup_id: str
    tenant_id: str
    object: str
    created_at: str
    expires_at: str


class BackupManifest(BackupStub):
    """A stored backup's manifest, less its wrapped key."""

    rows: dict[str, int]
    key_ids: dict[str, Any]  # tenant_key, subject_keys
    bytes: int
    sha256: str
    snapshot_at: str
    consent_snapshot: Any


class BackupTaken(BackupManifest):
    """`BackupService.backup`: the manifest and how long the backup took."""

    seconds: float


class BackupListing(BackupStub):
    """One of a tenant's backups (`BackupService.list_backups`); the manifest's other keys once DONE."""

    location: str
    expired: bool
    state: str  # IN_FLIGHT, DONE or FAILED
    snapshot_at: str | None  # None until the snapshot is taken
    rows: NotRequired[dict[str, int]]
    key_ids: NotRequired[dict[str, Any]]
    bytes: NotRequired[int]
    sha256: NotRequired[str]
    consent_snapshot: NotRequired[Any]


class BackupsExpired(TypedDict):
    """`BackupService.sweep_expired`."""

    expired: int


class RestoreRequest(TypedDict):
    """`BackupService.request_restore`: for the restore sensor to run."""

    restore_id: str
    tenant_id: str
    backup_id: str
    state: str


class RestoreReport(TypedDict):
    """`BackupService.restore`: `state` COMPLETE, or BLOCKED (the tenant's rows as before)."""

    restore_id: str
    tenant_id: str
    backup_id: str
    state: NotRequired[str]
    loaded: NotRequired[dict[str, int]]
    consent: NotRequired[dict[str, Any]]
    replayed: NotRequired[dict[str, Any]]
    verification: NotRequired[dict[str, int]]
    seconds: NotRequired[dict[str, float]]
    load_seconds: NotRequired[float]
    replay_seconds: NotRequired[float]
    change_seq: NotRequired[int]
    erasure_owed: NotRequired[dict[str, Any]]
    error: NotRequired[str]


class TenantReopened(TypedDict):
    """`BackupService.reopen`: `reopened` False when the tenant was open."""

    tenant_id: str
    reopened: bool


# -- retention -----------------------------------------------------------------------------------


class RetentionPreview(TypedDict):
    """`retention.preview`: counts only."""

    date: str
    policy_version: str
    tenants: dict[str, dict[str, int]]  # tenant -> category -> memories
    immediate: dict[str, int]
    total: int


class RetentionJob(TypedDict):
    job_id: str
    categories: dict[str, int]
    state: str


class RetentionSweep(TypedDict):
    """`retention.sweep`: one RETENTION job per tenant; `stores` filled when the sweep ran them."""

    date: str
    policy_version: str
    removed: int
    jobs: dict[str, RetentionJob]
    immediate_forget_jobs: dict[str, int]
    immediate_forget_job_ids: dict[str, list[str]]
    stores: dict[str, dict[str, int]]
    paused: NotRequired[list[str]]  # tenants whose deletion work is paused: requested, not yet run


# -- agent runs ----------------------------------------------------------------------------------


class RunLease(TypedDict):
    """A run's lease, opened (`AgentRuns.open` returns its id)."""

    lease_id: str
    run_id: str
    tenant_id: str
    subject_id: str


class LeaseRevoked(TypedDict):
    """`Gate.revoke`."""

    lease_id: str
    permits_cancelled: int


class PromptSnapshot(TypedDict):
    """`AgentRuns.snapshot_prompt`."""

    snapshot_id: str
    run_id: str
    sources: int


class DerivedRecord(TypedDict):
    store: str
    record_id: str


class ExplainedMemory(TypedDict):
    memory_id: str
    version: int
    author: str
    read_under_epoch: int
    state: Literal["present", "forgotten"]
    text: str | None
    derived: list[DerivedRecord]


class SnapshotEntry(TypedDict):
    snapshot_id: str
    created_at: str


class RunExplanation(TypedDict):
    """`AgentRuns.explain`: the recall chain of a run."""

    tenant_id: str
    run_id: str
    leases: list[str]
    memories: list[ExplainedMemory]
    prompt_snapshots: list[SnapshotEntry]


# -- evaluation and the canary drill ---------------------------------------------------------------


class TrendMonth(TypedDict):
    """One month of `evaluator.trend`."""

    month: str
    precision: float | None
    recall: float | None
    drift: float | None


class AtK(TypedDict):
    """One mode's figures at one K of an evaluation (`evaluator.latest_at_k`)."""

    month: str
    mode: str
    k: int
    precision: float
    recall: float
    queries: int
    judge: str


class EvaluationTrend(TypedDict):
    """The evaluation's month-by-month trend for one recall mode, with its Markdown table; and the
    per-K figures of every mode in the evaluation computed last, with theirs."""

    tenant: str
    mode: str
    k: int
    months: list[TrendMonth]
    markdown: str
    at_k: list[AtK]
    at_k_markdown: str


class CanaryErasure(TypedDict):
    state: str
    bytes_rewritten: int
    files_scanned: int
    fingerprints: int


class CanaryRestore(TypedDict):
    state: str
    leftovers: dict[str, int]


class CanaryDrill(TypedDict):
    """`canary.run_canary_drill`: `passed` only when every count of leftovers is zero."""

    tenant: str
    job_id: str
    state: str
    canaries: int
    recalled_before_forget: int
    materialized: dict[str, int]
    leftovers: dict[str, int]
    physical_erasure: CanaryErasure
    after_restore: NotRequired[CanaryRestore]
    witness_memories_kept: int
    tenant_removed: str
    passed: bool
    seconds: float
