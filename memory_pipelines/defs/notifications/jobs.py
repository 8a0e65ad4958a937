import dagster as dg

NOTIFY_JOB = "notify"

notify_job = dg.define_asset_job(
    NOTIFY_JOB,
    selection=dg.AssetSelection.assets("deletion_notifications"),
    description="Deliver the queued deletion notices (email, webhook) that are due, each once per channel.",
    tags={"domain": "forget"},
)
