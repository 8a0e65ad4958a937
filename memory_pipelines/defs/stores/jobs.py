import dagster as dg

from memory_pipelines.lib.stores import registry

# The registered stores' assets (stores/<store>/spec.py), in registry order.
DERIVED_ASSETS = [spec.asset for spec in registry.stores() if spec.asset]

tenant_refresh_job = dg.define_asset_job(
    "tenant_refresh",
    selection=dg.AssetSelection.assets("memories", *DERIVED_ASSETS),
    description="Snapshot `memories` and bring every derived store of one tenant up to date, with checks.",
    tags={"domain": "derived"},
)
