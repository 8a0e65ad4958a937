"""What a backup holds: the tenant's tables, their columns and Arrow types, and in which order a
restore replaces, stages and loads them."""

from __future__ import annotations

import pyarrow as pa

from memory_pipelines.lib.stores import registry

__all__ = [
    "CORE_TABLES",
    "load_order",
    "replaced",
    "staged",
    "store_tables",
    "tables",
]

_TS = pa.timestamp("us", tz="UTC")

# What a backup holds, per table: columns with their Arrow types, read with a bound tenant id.
# Text columns are ciphertext as stored; the key store is deliberately absent.
CORE_TABLES: dict[str, tuple[str, list[tuple[str, pa.DataType]]]] = {
    "subjects": (
        "memory.subjects",
        [("user_id", pa.string()), ("do_not_sell", pa.bool_()), ("created_at", _TS)],
    ),
    "teams": ("memory.teams", [("team_id", pa.string()), ("created_at", _TS)]),
    "team_members": (
        "memory.team_members",
        [("team_id", pa.string()), ("user_id", pa.string()), ("added_at", _TS)],
    ),
    "memories": (
        "memory.memories",
        [
            ("memory_id", pa.string()),
            ("user_id", pa.string()),
            ("team_id", pa.string()),
            ("memory_type", pa.string()),
            ("current_version", pa.int32()),
            ("do_not_sell", pa.bool_()),
            ("created_at", _TS),
            ("updated_at", _TS),
        ],
    ),
    "memory_versions": (
        "memory.memory_versions",
        [
            ("memory_id", pa.string()),
            ("version", pa.int32()),
            ("shareable", pa.bool_()),
            ("category", pa.string()),
            ("confidence", pa.float64()),
            ("text_ct", pa.binary()),
            ("text_mac", pa.binary()),
            ("original_query_ct", pa.binary()),
            ("key_id", pa.string()),
            ("restored_from", pa.int32()),
            ("created_at", _TS),
            ("superseded_at", _TS),
        ],
    ),
    "lineage": (
        "derived.lineage",
        [
            ("store", pa.string()),
            ("record_id", pa.string()),
            ("source_memory_id", pa.string()),
            ("source_version", pa.int32()),
            ("created_at", _TS),
        ],
    ),
}
# Load order respects foreign keys; deletion runs in reverse. A store's own tables (its spec's
# `backup_tables`, e.g. the summaries' modes) come after the memories they refer to.
_CORE_LOAD_ORDER = ["subjects", "teams", "team_members", "memories", "memory_versions", "lineage"]
# Lineage is kept as it is, never replaced nor loaded: edges of derived records made after the backup
# (vectors, postings, summaries, prompt snapshots) must survive, or a later forget could not find them.
_CORE_REPLACED = ["memory_versions", "memories", "team_members", "teams"]
# Loaded through temporary tables, in load order: nothing the journals forgot reaches the real ones.
_CORE_STAGED = ["teams", "team_members", "memories", "memory_versions"]


def store_tables() -> dict[str, tuple[str, list[tuple[str, pa.DataType]]]]:
    """The registered stores' tables a backup holds, in registry order."""
    return {
        name: (table, [(column, getattr(pa, kind)()) for column, kind in columns])
        for spec in registry.stores()
        for name, (table, columns) in spec.backup_tables.items()
    }


def tables() -> dict[str, tuple[str, list[tuple[str, pa.DataType]]]]:
    """Every table a backup holds: name -> (qualified table, [(column, Arrow type)])."""
    return {**CORE_TABLES, **store_tables()}


def load_order() -> list[str]:
    return [*_CORE_LOAD_ORDER, *store_tables()]


def replaced() -> list[str]:
    return [*reversed(list(store_tables())), *_CORE_REPLACED]


def staged() -> list[str]:
    return [*_CORE_STAGED, *store_tables()]
