import dagster as dg

from memory_pipelines.defs.runs.executors import leased_in_process

ERASURE_JOB = "erase"

physical_erasure_job = dg.define_asset_job(
    ERASURE_JOB,
    selection=dg.AssetSelection.assets("physical_erasure"),
    executor_def=leased_in_process,
    description="Physical erasure of one tenant: rewrite its files in every store, byte-scan them, mark the"
    " COMPLETE deletions ERASED.",
    tags={"domain": "forget"},
)

KEY_CONVERSION_JOB = "convert_keys"

key_conversion_job = dg.define_asset_job(
    KEY_CONVERSION_JOB,
    selection=dg.AssetSelection.assets("key_conversion"),
    executor_def=leased_in_process,
    description="One tenant's texts written before version keys, sealed under keys of their own versions.",
    tags={"domain": "forget"},
)
