import dagster as dg

memory_evaluation_job = dg.define_asset_job(
    "memory_evaluation",
    selection=["memory_eval", "memory_drift"],
    description="Monthly memory quality: precision@K, recall@K per mode, and drift, with the trend dashboard.",
    tags={"domain": "evaluation"},
)
