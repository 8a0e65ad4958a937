"""A toy store declared from outside `lib/stores/`: its own table, sync and deletion adapter.

It proves that adding a store is one package: registered with `registry.register(*SPECS)`, it is in
the forget graph, the cascade, verification, the proof, the certificate, the data map, `sync_all`,
its asset and check, and what a restore drops, with no edit anywhere else.
"""
