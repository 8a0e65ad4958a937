import dagster as dg

DERIVED_ASSETS = ["memory_embeddings", "keyword_index", "subject_summaries", "team_summaries", "analytics_memories"]

tenant_refresh_job = dg.define_asset_job(
    "tenant_refresh",
    selection=dg.AssetSelection.assets("memories", *DERIVED_ASSETS),
    description="Snapshot `memories` and bring every derived store of one tenant up to date, with checks.",
    tags={"domain": "derived"},
)
