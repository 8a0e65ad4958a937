import dagster as dg

# Dagster's default automation sensor starts STOPPED; derived stores must follow `memories`
# without someone switching it on in the UI.
derived_stores_automation = dg.AutomationConditionSensorDefinition(
    "derived_stores_automation",
    target=dg.AssetSelection.groups("derived_stores"),
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=30,
    description="Materializes each tenant's derived stores after its `memories` partition changes (eager).",
)
