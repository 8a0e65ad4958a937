from pathlib import Path

import dagster as dg

from memory_pipelines.defs.forget.jobs import deletion_service
from memory_pipelines.defs.memories.partitions import tenants_partitions
from memory_pipelines.lib.forget.canary import run_canary_drill
from memory_pipelines.resources import (
    AnalyticsResource,
    BackupResource,
    ChromaResource,
    MemoryStoreResource,
    SummarizerResource,
)


@dg.asset(
    group_name="forget",
    kinds={"python"},
    owners=["team:memory-platform"],
    tags={"domain": "forget"},
    check_specs=[
        dg.AssetCheckSpec(
            "nothing_left_behind",
            asset="deletion_canary",
            description="After the drill (forget, physical erasure, restore from the pre-forget backup, rebuild),"
            " no canary is left: zero hits in recall, lineage, the primary store, vectors, files under HOME and"
            " the erasure byte scan; the witness memory stays; the drill's tenant is offboarded.",
        )
    ],
)
def deletion_canary(
    context: dg.AssetExecutionContext,
    memory_store: MemoryStoreResource,
    chroma: ChromaResource,
    summarizer: SummarizerResource,
    analytics: AnalyticsResource,
    backups: BackupResource,
) -> dg.MaterializeResult:
    """Weekly proof that forgetting works: canaries written, copied, backed up, forgotten, restored, still gone."""
    service = deletion_service(memory_store, chroma, summarizer, analytics)
    home = None if memory_store.pg_url else Path(memory_store.home).resolve()
    result = run_canary_drill(service.derived, home=home, backups=backups.service(store=service.store))
    # The drill offboarded its tenant; if anything made it a partition meanwhile, it goes now.
    if context.instance.has_dynamic_partition(tenants_partitions.name or "tenants", result["tenant"]):
        context.instance.delete_dynamic_partition(tenants_partitions.name or "tenants", result["tenant"])
    context.log.info(f"canary drill in {result['tenant']}: passed={result['passed']}")
    figures = {name: dg.MetadataValue.int(int(count)) for name, count in result["leftovers"].items()}
    restored = result.get("after_restore", {}).get("state", "not run")
    return dg.MaterializeResult(
        metadata={
            "passed": dg.MetadataValue.bool(result["passed"]),
            "canaries": dg.MetadataValue.int(result["canaries"]),
            "job_id": dg.MetadataValue.text(result["job_id"]),
            "seconds": dg.MetadataValue.float(result["seconds"]),
            "restore_from_backup": dg.MetadataValue.text(restored),
            "tenant_removed": dg.MetadataValue.text(str(result.get("tenant_removed"))),
            "physical_erasure": dg.MetadataValue.text(result["physical_erasure"]["state"]),
            "erasure_files_scanned": dg.MetadataValue.int(int(result["physical_erasure"]["files_scanned"])),
            "erasure_fingerprints": dg.MetadataValue.int(int(result["physical_erasure"]["fingerprints"])),
            **{f"leftover_{name}": value for name, value in figures.items()},
        },
        check_results=[
            dg.AssetCheckResult(check_name="nothing_left_behind", passed=bool(result["passed"]), metadata=figures)
        ],
    )
