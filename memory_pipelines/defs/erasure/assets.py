import dagster as dg

from memory_pipelines.defs.forget.ops import certificates
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.lib.forget.erasure import ErasureIncomplete, ErasureService
from memory_pipelines.lib.forget.ledger import DeletionLedger
from memory_pipelines.lib.infra.progress import throttled
from memory_pipelines.lib.infra.settings import Settings, lower_priority
from memory_pipelines.lib.stores.derived import convert_keys
from memory_pipelines.resources import AnalyticsResource, ChromaResource, MemoryStoreResource, SummarizerResource
from memory_pipelines.resources.derived import derived_stores


@dg.asset(
    partitions_def=tenants_partitions,
    group_name="forget",
    kinds={"postgres", "chroma"},
    owners=["team:memory-platform"],
    deps=["memory_deletions"],
    tags={"domain": "forget"},
)
def physical_erasure(
    context: dg.AssetExecutionContext,
    memory_store: MemoryStoreResource,
    chroma: ChromaResource,
    summarizer: SummarizerResource,
    analytics: AnalyticsResource,
) -> dg.MaterializeResult:
    """Forgotten bytes gone from every file: the tenant's stores rewritten, then proven by a byte scan."""
    tenant_id = context.partition_key
    context.log.info(f"niceness {lower_priority(Settings.from_env())}")  # background: recalls come first
    service = ErasureService(derived_stores(memory_store, chroma, summarizer, analytics))

    try:
        report = service.erase_tenant(tenant_id=tenant_id, progress=throttled(context.log.info))
    except ErasureIncomplete as exc:
        # The run fails (the sensor tries again); `erasures_on_time` fails once the deadline passes.
        context.log.error(str(exc))
        raise dg.Failure(description=str(exc), metadata={"files_with_hits": dg.MetadataValue.json(exc.hits)}) from exc
    # The certificates `memory_deletions` showed were rendered at COMPLETE (physical: PENDING); these
    # jobs' certificates as they stand now (ERASED, backups SHREDDED) go on that asset's partition too.
    ledger = DeletionLedger(service.store)
    proofs = [ledger.proof(job_id=job_id) for job_id in report["jobs"][:20]]
    if proofs:
        context.log_event(
            dg.AssetObservation(
                asset_key="memory_deletions",
                partition=tenant_id,
                metadata={
                    "erased_at": dg.MetadataValue.text(str(report.get("erasedAt", ""))),
                    "deletion_job_ids": dg.MetadataValue.json([str(p["jobId"]) for p in proofs]),
                    **certificates(ledger, proofs),
                },
            )
        )
    scan = report.get("byteScan", {})
    return dg.MaterializeResult(
        metadata={
            "erased_jobs": dg.MetadataValue.int(report["erased"]),
            "job_ids": dg.MetadataValue.json(report["jobs"][:20]),
            "bytes_rewritten": dg.MetadataValue.int(sum(report.get("bytesRewritten", {}).values())),
            "bytes_rewritten_by_store": dg.MetadataValue.json(report.get("bytesRewritten", {})),
            "scanned_files": dg.MetadataValue.int(int(scan.get("files", 0))),
            "scanned_bytes": dg.MetadataValue.int(int(scan.get("bytes", 0))),
            "fingerprints": dg.MetadataValue.int(int(scan.get("fingerprints", 0))),
            "scan_hits": dg.MetadataValue.int(int(scan.get("hits", 0))),
            "not_scanned": dg.MetadataValue.json(scan.get("notScanned", [])),
            "seconds": dg.MetadataValue.json(report.get("seconds", {})),
        },
    )


@dg.asset(
    partitions_def=tenants_partitions,
    group_name="forget",
    kinds={"postgres"},
    owners=["team:memory-platform"],
    deps=["memories"],
    tags={"domain": "forget"},
    description="Texts an older release sealed under their author's key, sealed again under keys of their own"
    " versions (so forgetting any one destroys a key); resumable, reads go on meanwhile.",
)
def key_conversion(context: dg.AssetExecutionContext, memory_store: MemoryStoreResource) -> dg.MaterializeResult:
    # The author keys that sealed those texts are retired until the backups holding such texts expire
    # (lib/memories/key_conversion.py); a KEK rotation of this run or of the erasure then destroys them.
    context.log.info(f"niceness {lower_priority(Settings.from_env())}")  # background: recalls come first
    settings = memory_store.settings()
    counts = convert_keys(
        memory_store.store(),
        tenant_id=context.partition_key,
        backup_days=settings.backup_days,
        progress=throttled(context.log.info),
    )
    return dg.MaterializeResult(
        metadata={name: dg.MetadataValue.int(n) for name, n in counts.items() if isinstance(n, int)}
    )
