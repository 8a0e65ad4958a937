import dagster as dg

memories_snapshot_job = dg.define_asset_job(
    "memories_snapshot",
    selection=["memories"],
    description="Records the tenant's memory counts and store integrity as a `memories` materialization.",
    tags={"domain": "memories"},
)
