"""The forget graph's ops, one per phase of `cascade.phases()`: freeze, one per registered store,
verify, prove.

The batch (run lock, targets, plaintext probes) never crosses an IO manager, and no module global
carries it: it lives in `RunBatch`, the value of the `forget_batch` resource, which Dagster makes
once per process that runs the run's steps and tears down when they end. Under the forget job's
in-process executor that is once per run, so every step of a run shares one batch (one freeze of
targets and probes, one run lock). Under a multi-process executor each step has its own holder,
finds no batch and begins it again from the ledger, as a re-execution from failure does (exactly
what `deletion retry` does): correct, only slower. Ops pass the job ids along (ids only).
"""

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import dagster as dg
from pydantic import Field

from memory_pipelines.defs.forget.checks import check_evaluation
from memory_pipelines.defs.stores.jobs import DERIVED_ASSETS
from memory_pipelines.lib.forget import certificate
from memory_pipelines.lib.forget.cascade import FREEZE, PROVE, STORE, VERIFY, Phase
from memory_pipelines.lib.forget.deletion import Batch, DeletionBlocked, DeletionLedger, DeletionService
from memory_pipelines.lib.forget.switches import DeletionPaused
from memory_pipelines.lib.infra.errors import MemoryPipelinesError, ValidationError
from memory_pipelines.lib.infra.settings import Settings, lower_priority
from memory_pipelines.lib.stores import registry
from memory_pipelines.resources import (
    AnalyticsResource,
    ChromaResource,
    MemoryStoreResource,
    SummarizerResource,
    derived_stores,
)

TOUCHED_ASSETS = ("memories", *DERIVED_ASSETS)
SCOPES = ("SUBJECT", "MEMORY", "TENANT")
TAGS = {"domain": "forget"}
# The run tag naming the deletion jobs a forget run works on (the forget sensor reads it).
JOBS_TAG = "memory_pipelines/deletion_jobs"
# Ids listed in a run's tag; the run config holds them all.
TAGGED_IDS = 10
Resources = tuple[MemoryStoreResource, ChromaResource, SummarizerResource, AnalyticsResource]


class RunBatch:
    """The batch of one run's steps in this process, and the tenant's data map at its freeze (for
    the before/after picture the prove step attaches). Plain memory: never serialised or logged."""

    def __init__(self) -> None:
        self.entry: tuple[DeletionService, Batch] | None = None
        self.before: dict[str, int] | None = None

    def keep(self, service: DeletionService, batch: Batch) -> None:
        """Hold the batch begun by a step for the later steps of the run."""
        self.drop()
        self.entry = (service, batch)

    def drop(self) -> None:
        """Forget the batch and data map, giving the tenant's run lock back (idempotent)."""
        entry, self.entry, self.before = self.entry, None, None
        if entry is not None:
            entry[0].release(entry[1])


@dg.resource(description="The forget run's batch (run lock, targets, probes), shared by the steps of one process")
def forget_batch(_: dg.InitResourceContext) -> Iterator[RunBatch]:
    """A `RunBatch` for the steps of one run in one process; whatever batch is left goes at the end."""
    holder = RunBatch()
    try:
        yield holder
    finally:
        holder.drop()  # a run that stopped between steps still gives the tenant's run lock back


class ForgetConfig(dg.Config):
    """The freeze step's config: existing job ids, or one new request validated like the CLI's.
    SUBJECT: scope + subject; MEMORY: scope + memory_id (+ version); TENANT: scope + confirm."""

    job_ids: list[str] = Field(
        default_factory=list,
        description="Re-run existing deletion jobs, e.g. [del_0123...]; empty (and no scope): every REQUESTED or"
        " BLOCKED job of the tenant (the partition)",
    )
    scope: str | None = Field(
        default=None,
        description="A new request instead of job_ids: SUBJECT (with subject), MEMORY (with memory_id, and version"
        " for one version only) or TENANT (with confirm: the tenant id; offboarding)",
    )
    subject: str | None = Field(
        default=None, description="SUBJECT scope: the user id, exactly (e.g. alice); everything the user wrote goes"
    )
    memory_id: str | None = Field(default=None, description="MEMORY scope: the memory id (m_...)")
    version: int | None = Field(default=None, description="MEMORY scope: one version only (null: every version)")
    confirm: str | None = Field(default=None, description="TENANT scope: repeat the tenant id to confirm")
    basis: str = Field(
        default="user-request",
        description="Legal basis: gdpr-art17 (30 days), ccpa (45), user-request (30), retention, offboarding",
    )
    requested_by: str | None = Field(default=None, description="Who asked (an operator or service id)")


def deletion_service(
    memory_store: MemoryStoreResource,
    chroma: ChromaResource,
    summarizer: SummarizerResource,
    analytics: AnalyticsResource,
) -> DeletionService:
    """The deletion service over the configured stores."""
    return DeletionService(derived_stores(memory_store, chroma, summarizer, analytics))


def run_request_key(run: dg.DagsterRun) -> str:
    """The key a run's new request is accepted under: its root run's id, the same for the run and for
    every re-execution of it (and of those), so re-executing never accepts the request again."""
    return f"dagster-run:{run.root_run_id or run.run_id}"


def _is_new(config: ForgetConfig) -> bool:
    """Whether the config makes a new request (a scope and its fields) rather than naming jobs."""
    return config.scope is not None or any(
        value is not None for value in (config.subject, config.memory_id, config.version)
    )


def _request(
    service: DeletionService, tenant_id: str, config: ForgetConfig, request_key: str | None = None
) -> list[str]:
    """Job ids the run works on: a new request's (validated like the CLI's; accepted once per
    `request_key`), the given ones, or the pending ones."""
    if not _is_new(config):
        if config.job_ids:
            return list(config.job_ids)
        return service.pending(tenant_id=tenant_id, states=("REQUESTED", "BLOCKED")).get(tenant_id, [])
    if config.job_ids:
        raise ValidationError("job_ids", "give either job_ids or a new request (scope ...), not both")
    if config.scope not in SCOPES:
        raise ValidationError("scope", f"must be one of {', '.join(SCOPES)} for a new request, got {config.scope!r}")
    if config.scope == "SUBJECT" and config.subject is None:
        raise ValidationError("subject", "is required with scope SUBJECT")
    if config.scope == "MEMORY" and config.memory_id is None:
        raise ValidationError("memory_id", "is required with scope MEMORY")
    job = service.request(
        tenant_id=tenant_id,
        subject=config.subject,
        memory_id=config.memory_id,
        version=config.version,
        all_tenant=config.scope == "TENANT",
        confirm=config.confirm,
        basis=config.basis,
        requested_by=config.requested_by,
        request_key=request_key,
    )
    return [job["job_id"]]


def jobs_tag(job_ids: list[str]) -> str:
    """The run tag naming a batch's job ids: the first few, then how many more."""
    shown = ",".join(job_ids[:TAGGED_IDS])
    return shown if len(job_ids) <= TAGGED_IDS else f"{shown},+{len(job_ids) - TAGGED_IDS}"


def _tag_jobs(context: dg.OpExecutionContext, job_ids: list[str]) -> None:
    """Name the jobs a run's new request created on the run, as the sensor's runs are named (the
    forget sensor leaves the jobs of a run that has not ended alone)."""
    if not job_ids or context.dagster_run.tags.get(JOBS_TAG):
        return
    try:
        context.instance.add_run_tags(context.run_id, {JOBS_TAG: jobs_tag(job_ids)})
    except Exception:  # informative: the request key, not the tag, keeps a re-execution to one job
        context.log.warning("could not tag the run with its deletion job ids")


def _invalid(exc: MemoryPipelinesError) -> dg.Failure:
    return dg.Failure(
        description=f"invalid request: {exc.field}: {exc.message}",
        metadata={"field": dg.MetadataValue.text(exc.field)},
        allow_retries=False,
    )


def _blocked(
    context: dg.OpExecutionContext,
    step: str,
    job_ids: list[str],
    exc: DeletionBlocked,
    memory_store: MemoryStoreResource,
    holder: RunBatch,
) -> dg.Failure:
    """The step failed: the jobs are BLOCKED (by the service); drop the batch, alert, fail the step."""
    holder.drop()
    try:
        # Reported through the instance: the events of a step that fails would not show.
        evaluation = check_evaluation(DeletionLedger(memory_store.store()), context.partition_key, context.instance)
        context.instance.report_runless_asset_event(evaluation)
    except Exception:  # the alert is best effort; the alerts sensor evaluates again within minutes
        context.log.warning("could not evaluate deletions_on_track after the failed step")
    return dg.Failure(
        description=f"deletion step {step} blocked: {exc.code}",
        metadata={
            "code": dg.MetadataValue.text(exc.code),
            "step": dg.MetadataValue.text(step),
            "deletion_job_ids": dg.MetadataValue.json(job_ids),
        },
        allow_retries=False,
    )


@contextmanager
def _guard(holder: RunBatch) -> Iterator[None]:
    """Whatever a step raises, its batch goes: the run lock is released and the probes dropped."""
    try:
        yield
    except BaseException:
        holder.drop()
        raise


def _batch(
    context: dg.OpExecutionContext, step: str, job_ids: list[str], resources: Resources, holder: RunBatch
) -> tuple[DeletionService, Batch]:
    """This run's batch; begun again (a retry) when this process has none, e.g. a re-execution from
    failure or a step of a multi-process run."""
    if holder.entry is not None:
        return holder.entry
    service = deletion_service(*resources)
    try:
        batch = service.begin(tenant_id=context.partition_key, job_ids=job_ids)
    except DeletionBlocked as exc:
        raise _blocked(context, step, job_ids, exc, resources[0], holder) from exc
    except ValidationError as exc:
        raise _invalid(exc) from exc
    except DeletionPaused as exc:
        if step == FREEZE:
            raise  # the freeze step ends without failing: the jobs wait for the resume
        # Begun again at a later step (a re-execution) while paused, with no job past its freeze.
        raise dg.Failure(description=exc.message, metadata={"field": dg.MetadataValue.text("pause")}) from exc
    holder.keep(service, batch)
    return service, batch


def _phase(
    context: dg.OpExecutionContext, phase: Phase, job_ids: list[str], resources: Resources, holder: RunBatch
) -> tuple[DeletionService, Batch, Any]:
    """One phase of this run's batch (`DeletionService.run_phase`); a DeletionBlocked fails the step
    (the jobs are BLOCKED)."""
    try:
        with _guard(holder):
            service, batch = _batch(context, phase.name, job_ids, resources, holder)
            return service, batch, service.run_phase(batch, phase)
    except DeletionBlocked as exc:
        raise _blocked(context, phase.name, job_ids, exc, resources[0], holder) from exc


@dg.op(
    tags=TAGS,
    out=dg.Out(
        list[str],
        description="The batch's deletion job ids (ids only, no content); none when there is nothing to forget",
        is_required=False,
    ),
)
def freeze(
    context: dg.OpExecutionContext,
    config: ForgetConfig,
    memory_store: MemoryStoreResource,
    chroma: ChromaResource,
    summarizer: SummarizerResource,
    analytics: AnalyticsResource,
    forget_batch: dg.ResourceParam[RunBatch],
) -> Iterator[dg.Output[list[str]]]:
    """Accept or pick the tenant's deletion jobs, freeze them, wait for permits to drain, fix targets."""
    tenant_id = context.partition_key
    # Background work (the run's steps share this process): recalls of every tenant come first.
    context.log.info(f"niceness {lower_priority(Settings.from_env())}")
    resources = (memory_store, chroma, summarizer, analytics)
    service = deletion_service(*resources)
    try:
        # A re-execution of the whole run (the UI's "re-execute all") runs freeze again with the same
        # request: keyed by the root run, it gets the job the first run created, never a second one
        # that would take what the subject wrote since.
        job_ids = _request(service, tenant_id, config, run_request_key(context.dagster_run))
    except MemoryPipelinesError as exc:
        raise _invalid(exc) from exc
    if _is_new(config):
        _tag_jobs(context, job_ids)
    forget_batch.drop()  # a retried step starts from the ledger, never from a half-used batch
    try:
        with _guard(forget_batch):
            _, batch = _batch(context, FREEZE, job_ids, resources, forget_batch)
    except DeletionPaused as exc:
        # An operator's switch, not a failure: the jobs stay accepted and hidden, and run on resume.
        context.log.warning(f"{exc.message}; job(s) {', '.join(job_ids)} wait")
        return
    if not batch.jobs:
        # Already COMPLETE (another run, e.g. `forget --wait`, got there first) or none pending: the
        # later steps are skipped, so no materialization hides the tenant's last proof.
        forget_batch.drop()
        what = f"job(s) {', '.join(job_ids)} already COMPLETE" if job_ids else "no REQUESTED or BLOCKED job"
        context.log.info(f"nothing to forget for tenant {tenant_id}: {what}")
        return
    try:
        forget_batch.before = certificate.data_map(service.store, tenant_id)
    except Exception:  # the picture is informative only; it never fails a forget
        context.log.warning("could not count the tenant's records for the data map")
    context.log.info(f"forgetting {len(batch.jobs)} deletion job(s) for tenant {tenant_id}")
    yield dg.Output(
        job_ids,
        metadata={
            "deletion_job_ids": dg.MetadataValue.json(job_ids),
            "target_versions": dg.MetadataValue.int(len(set().union(*batch.targets.values()))),
        },
    )


def phase_op(phase: Phase) -> dg.OpDefinition:
    """The forget graph's op for one phase of `cascade.phases()`, named after it."""
    if phase.kind == FREEZE:
        return freeze  # the one op with config: which jobs the run works on
    factories = {STORE: _store_op, VERIFY: _verify_op, PROVE: _prove_op}
    return factories[phase.kind](phase)


def _store_op(phase: Phase) -> dg.OpDefinition:
    assert phase.store is not None
    spec = registry.spec(phase.store)

    @dg.op(
        name=phase.name,
        description=f"Delete what `{spec.name}` holds of the batch's targets (owner {spec.owner}; "
        f"locator {spec.locator_key}).",
        tags={**TAGS, "store": spec.name},
        out=dg.Out(list[str]),
    )
    def delete_from_store(
        context: dg.OpExecutionContext,
        job_ids: list[str],
        memory_store: MemoryStoreResource,
        chroma: ChromaResource,
        summarizer: SummarizerResource,
        analytics: AnalyticsResource,
        forget_batch: dg.ResourceParam[RunBatch],
    ) -> list[str]:
        resources = (memory_store, chroma, summarizer, analytics)
        _, _, removed = _phase(context, phase, job_ids, resources, forget_batch)
        context.add_output_metadata(
            {"removed": dg.MetadataValue.int(removed), "adapter_version": dg.MetadataValue.text(spec.adapter_version)}
        )
        return job_ids

    return delete_from_store


def _verify_op(phase: Phase) -> dg.OpDefinition:
    @dg.op(name=phase.name, tags=TAGS, out=dg.Out(list[str]))
    def verify(
        context: dg.OpExecutionContext,
        job_ids: list[str],
        memory_store: MemoryStoreResource,
        chroma: ChromaResource,
        summarizer: SummarizerResource,
        analytics: AnalyticsResource,
        forget_batch: dg.ResourceParam[RunBatch],
    ) -> list[str]:
        """Exact-id queries on every store and paraphrase probes of the deleted content: expected zero."""
        resources = (memory_store, chroma, summarizer, analytics)
        _, _, verification = _phase(context, phase, job_ids, resources, forget_batch)
        context.add_output_metadata({"verification": dg.MetadataValue.json(verification)})
        return job_ids

    return verify


def _prove_op(phase: Phase) -> dg.OpDefinition:
    @dg.op(name=phase.name, tags=TAGS, out=dg.Out(dg.Nothing))
    def prove(
        context: dg.OpExecutionContext,
        job_ids: list[str],
        memory_store: MemoryStoreResource,
        chroma: ChromaResource,
        summarizer: SummarizerResource,
        analytics: AnalyticsResource,
        forget_batch: dg.ResourceParam[RunBatch],
    ) -> None:
        """Complete the verified jobs, store their proofs and report every partition the run changed."""
        resources = (memory_store, chroma, summarizer, analytics)
        service, batch, proofs = _phase(context, phase, job_ids, resources, forget_batch)
        summary = service.summary(batch)
        before = forget_batch.before  # None when this process did not freeze (a re-execution, multi-process)
        forget_batch.drop()
        tenant_id = context.partition_key
        states = {job_id: service.status(job_id=job_id)["state"] for job_id in job_ids}
        bases = sorted({str(p["basis"]) for p in proofs})
        if proofs:
            report_forgotten(context, tenant_id, [p["jobId"] for p in proofs], bases, summary["stores"])
        context.add_output_metadata(
            {
                "deletion_job_ids": dg.MetadataValue.json(job_ids),
                "deletion_states": dg.MetadataValue.json(states),
                "basis": dg.MetadataValue.text(",".join(bases)),
                "jobs_completed": dg.MetadataValue.int(len(proofs)),
                **{f"store_{name}": dg.MetadataValue.int(n) for name, n in summary["stores"].items()},
                **({"rebuilt": dg.MetadataValue.json(summary["rebuilt"])} if summary.get("rebuilt") else {}),
                "seconds": dg.MetadataValue.json(summary.get("seconds", {})),
                **proof_metadata(proofs),
                **certificates(service.jobs, proofs),
                **data_map_metadata(context, service, tenant_id, before),
            }
        )

    return prove


def job_key(kind: str, job_id: str, *, full: bool = False) -> str:
    """The metadata key of one job's proof or certificate: `proof_del_1a2b3c4d5e6f`, the job's first
    12 hex digits (its full id is in the proof and in `deletion_job_ids`): a full id made the key column
    of the UI's metadata table overlap the links beside it. `full`: the whole id."""
    return f"{kind}_{job_id if full else job_id[:16]}"


def _keys(kind: str, proofs: Sequence[Mapping[str, Any]]) -> list[str]:
    ids = [str(p["jobId"]) for p in proofs]
    short = [job_key(kind, job_id) for job_id in ids]
    # Two jobs of one materialization sharing 12 hex digits: every key is the full id, none overwritten.
    return short if len(set(short)) == len(short) else [job_key(kind, job_id, full=True) for job_id in ids]


def proof_metadata(proofs: Sequence[Mapping[str, Any]]) -> dict[str, dg.MetadataValue]:
    """Each completed job's proof (ids, hashes, counts and times), under `job_key("proof", job_id)`."""
    return {key: dg.MetadataValue.json(dict(p)) for key, p in zip(_keys("proof", proofs), proofs, strict=True)}


def certificates(service: DeletionLedger, proofs: Sequence[Mapping[str, Any]]) -> dict[str, dg.MetadataValue]:
    """One Markdown deletion certificate per completed job (`job_key("certificate", job_id)`): ids,
    hashes, states, counts and times only."""
    return {
        key: dg.MetadataValue.md(certificate.render_markdown(p, service.status(job_id=str(p["jobId"]))))
        for key, p in zip(_keys("certificate", proofs), proofs, strict=True)
    }


def data_map_metadata(
    context: dg.OpExecutionContext, service: DeletionService, tenant_id: str, before: dict[str, int] | None
) -> dict[str, dg.MetadataValue]:
    """The tenant's records per registered store before (at freeze) and after this forget: a table
    and a PNG bar chart inlined as a data: URI. Informative only, so it never fails the run."""
    try:
        after = certificate.data_map(service.store, tenant_id)
        image = certificate.data_map_png(before, after, title=f"Tenant {tenant_id}: records per store by lineage")
    except Exception:
        context.log.warning("could not draw the tenant's data map")
        return {}
    return {
        "data_map": dg.MetadataValue.md(certificate.data_map_markdown(before, after, image=image)),
        "data_map_after": dg.MetadataValue.json(after),
        **({"data_map_before": dg.MetadataValue.json(before)} if before is not None else {}),
    }


def report_forgotten(
    context: dg.OpExecutionContext, tenant_id: str, job_ids: list[str], bases: list[str], stores: dict[str, int]
) -> None:
    """A materialization of `memories` and each derived asset's tenant partition, tagged with the job ids.

    Their keys are their own (`forget_*`), never the assets' usual counts: the run purged these
    partitions, it did not rebuild them in full.
    """
    metadata: dict[str, Any] = {
        "forget_job_ids": dg.MetadataValue.json(job_ids),
        "forget_basis": dg.MetadataValue.text(",".join(bases)),
        **{f"forget_removed_{name}": dg.MetadataValue.int(n) for name, n in stores.items()},
    }
    # `memories` first: eager automation sees each derived asset updated after its parent, so the
    # purge counts as handled and no refresh is requested for it.
    for asset in TOUCHED_ASSETS:
        context.log_event(dg.AssetMaterialization(asset_key=asset, partition=tenant_id, metadata=metadata))


class DeletionSwitchConfig(dg.Config):
    """An incident switch: pause or resume deletion work (of one tenant, or of every tenant)."""

    action: str = Field(default="pause", description="pause or resume")
    tenant: str = Field(default="", description="The tenant; empty: every tenant")
    reason: str = Field(
        default="", description="Why, in one line (an incident id); required to pause, shown in every proof"
    )


@dg.op(tags=TAGS)
def switch_deletions(
    context: dg.OpExecutionContext, config: DeletionSwitchConfig, memory_store: MemoryStoreResource
) -> dg.Output[dict]:
    """Pause or resume deletion work; requests stay accepted and hidden, no COMPLETE job is touched."""
    from memory_pipelines.lib.forget import switches

    if config.action not in ("pause", "resume"):
        raise dg.Failure(description=f"action: must be pause or resume, got {config.action!r}", allow_retries=False)
    tenant_id = config.tenant or None
    try:
        with memory_store.store().transaction() as conn:
            if config.action == "pause":
                found = switches.pause(conn, tenant_id=tenant_id, reason=config.reason)
            else:
                found = switches.resume(conn, tenant_id=tenant_id)
    except MemoryPipelinesError as exc:
        raise _invalid(exc) from exc
    whose = "every tenant" if tenant_id is None else f"tenant {tenant_id}"
    context.log.info(f"deletion work of {whose}: {'paused' if config.action == 'pause' else 'resumed'}")
    return dg.Output(
        found,
        metadata={
            "action": dg.MetadataValue.text(config.action),
            "tenant": dg.MetadataValue.text(tenant_id or "every tenant"),
            "paused_at": dg.MetadataValue.text(found["paused_at"]),
            "resumed_at": dg.MetadataValue.text(found["resumed_at"] or ""),
            "reason": dg.MetadataValue.text(found["reason"]),
        },
    )
