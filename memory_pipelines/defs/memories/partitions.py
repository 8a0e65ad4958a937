import dagster as dg

# Tenants, never users, are partitions: thousands of users per asset exceed what Dagster handles.
tenants_partitions = dg.DynamicPartitionsDefinition(name="tenants")
