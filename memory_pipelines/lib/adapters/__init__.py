"""One deletion adapter per registered store (see `base.StoreAdapter` and `registry.STORES`)."""
