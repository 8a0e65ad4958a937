"""Per-tenant LIST partitions of the tables that hold content, MACs or keys (migration 0011).

Every tenant has one partition of each table in `PARTITIONED_TABLES`, made with the tenant by a
trigger on `memory.tenants`. Compacting a tenant (VACUUM FULL of its partitions) rewrites only its
files and takes ACCESS EXCLUSIVE on them alone: other tenants' reads go on. Partitions are found by
their bound (pg_inherits + pg_get_expr of relpartbound, in SQL: `memory.tenant_partition`), never
by name alone. Tenant ids only ever travel as bound parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import psycopg
from psycopg import sql

from memory_pipelines.lib.infra.errors import ConflictError, NotFoundError, ValidationError

__all__ = [
    "KEY_TABLES",
    "PARTITIONED_TABLES",
    "CompactionLockTimeout",
    "analyze_tenant",
    "compact_tenant",
    "drop_tenant",
    "ensure_tenant",
    "estimated_rows",
    "sealed_statistics",
    "tenant_files",
    "tenant_partitions",
]

# Every table of wrapped keys: the key store's records, its deletion's and its verification's.
KEY_TABLES: tuple[str, ...] = (
    "keystore.subject_keys",
    "keystore.team_keys",
    "keystore.tenant_keys",
    "keystore.build_keys",
    "keystore.group_keys",
    "keystore.version_keys",
    "keystore.retired_keys",
)
PARTITIONED_TABLES: tuple[str, ...] = (
    "memory.memory_versions",
    "derived.keyword_postings",
    "derived.summaries",
    "derived.prompt_snapshots",
    "derived.analytics_rows",
    *KEY_TABLES,
)
_FORKS = ("main", "fsm", "vm", "init")
# The tenant's partition of each of `tables` that it has: parent, its oid and qualified name.
_PARTITIONS = (
    "SELECT t.parent, c.oid, n.nspname, c.relname, format('%%I.%%I', n.nspname, c.relname) FROM ("
    "  SELECT u.parent, u.ord, memory.tenant_partition(u.parent::regclass, %s) AS part"
    "  FROM unnest(%s::text[]) WITH ORDINALITY AS u(parent, ord) OFFSET 0) t"  # once per parent
    " JOIN pg_catalog.pg_class c ON c.oid = t.part"
    " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace ORDER BY t.ord"
)
# Every relation holding the partitions' bytes: the partitions, their TOAST tables and the indexes
# of both, with the size of each fork (0: no such file).
_RELATIONS = """
WITH parts AS (
    SELECT c.oid, c.reltoastrelid FROM pg_catalog.pg_class c WHERE c.oid = ANY(%s::oid[])
), tables AS (
    SELECT oid FROM parts UNION ALL SELECT reltoastrelid FROM parts WHERE reltoastrelid <> 0
), rels AS (
    SELECT oid FROM tables
    UNION ALL SELECT i.indexrelid FROM pg_catalog.pg_index i JOIN tables ON i.indrelid = tables.oid
)
SELECT pg_relation_filepath(oid), pg_relation_size(oid, 'main'), pg_relation_size(oid, 'fsm'),
       pg_relation_size(oid, 'vm'), pg_relation_size(oid, 'init')
FROM rels ORDER BY 1
"""
# Marks a partition being dropped (set before its detach, exact tenant id): a drop interrupted
# between detach and drop leaves a plain table that no bound names any more, found by this.
_DROP_MARK = "memory_pipelines: dropping the partition of tenant "
_ORPHANS = (
    "SELECT n.nspname, c.relname FROM pg_catalog.pg_class c"
    " JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace"
    " WHERE c.relkind = 'r' AND n.nspname = ANY(%s) AND NOT c.relispartition"
    " AND obj_description(c.oid, 'pg_class') = %s"
)


class _Partition(NamedTuple):
    oid: int
    schema: str
    name: str
    qualified: str  # quoted where needed, as PostgreSQL prints it

    @property
    def ident(self) -> sql.Identifier:
        return sql.Identifier(self.schema, self.name)


class CompactionLockTimeout(ConflictError):
    """A partition's lock was not granted within `lock_timeout`: a transaction of that tenant holds it."""


def _check_tables(tables: Sequence[str]) -> None:
    unknown = sorted(set(tables) - set(PARTITIONED_TABLES))
    if unknown:
        raise ValidationError(
            "tables", f"{unknown[0]!r} is not partitioned per tenant ({', '.join(PARTITIONED_TABLES)})"
        )


def _partitions(
    conn: psycopg.Connection, tenant_id: str, tables: Sequence[str] = PARTITIONED_TABLES
) -> dict[str, _Partition]:
    rows = conn.execute(_PARTITIONS, (tenant_id, list(tables))).fetchall()
    return {str(row[0]): _Partition(int(row[1]), str(row[2]), str(row[3]), str(row[4])) for row in rows}


def ensure_tenant(conn: psycopg.Connection, tenant_id: str) -> None:
    """Make the tenant's missing partitions (idempotent), in the caller's transaction.

    Inserting the tenant into `memory.tenants` already does this; this is for rows of a tenant that
    has no such row. The DDL lives in SQL (`memory.ensure_tenant_partitions`) so the trigger and
    this share one implementation, with the tenant id a bound parameter.
    """
    if not tenant_id:
        raise ValidationError("tenant", "is required")
    conn.execute("SELECT memory.ensure_tenant_partitions(%s)", (tenant_id,))


def estimated_rows(conn: psycopg.Connection, tenant_id: str, table: str) -> int:
    """The planner's row count of the tenant's partition of `table` (0 if never analyzed)."""
    _check_tables([table])
    part = _partitions(conn, tenant_id, [table]).get(table)
    if part is None:
        return 0
    row = conn.execute("SELECT reltuples FROM pg_catalog.pg_class WHERE oid = %s", (part.oid,)).fetchone()
    return max(0, int(row[0])) if row is not None else 0


def tenant_partitions(conn: psycopg.Connection, tenant_id: str) -> dict[str, str]:
    """Parent table -> the tenant's partition of it (qualified), for every parent where it has one."""
    return {parent: part.qualified for parent, part in _partitions(conn, tenant_id).items()}


# Shared tables with a row per memory or subject of every tenant: a tenant they were last analyzed
# without is planned as a tenant of one row.
_SHARED_TABLES = ("memory.memories", "memory.subjects")


def analyze_tenant(conn: psycopg.Connection, tenant_id: str) -> list[str]:
    """ANALYZE the tenant's partitions and the shared tables holding its memories' heads; returns
    what was analyzed. Autovacuum reaches a new partition late, and a shared table only after 10% of
    it changed; until then the planner takes a bulk-loaded tenant for an empty one. Measured: a fresh
    10,000-memory tenant's forget spent 1.9 s of 2.9 s in the primary step, each statement walking
    the tenant's memories through the owner index (planned for one row) instead of probing ids.
    Costs about 0.4 s beside a million memories. The sealed (bytea) columns get statistics without
    any value (migration 0021's `memory.sealed_column_statistics`): ANALYZE leaves them alone."""
    parts = _partitions(conn, tenant_id)
    for part in parts.values():
        conn.execute(sql.SQL("ANALYZE {}").format(part.ident))
        conn.execute("SELECT memory.sealed_column_statistics(%s::oid::regclass)", (part.oid,))
    for table in _SHARED_TABLES:
        conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(*table.split("."))))
    return [part.qualified for part in parts.values()] + list(_SHARED_TABLES)


def sealed_statistics(conn: psycopg.Connection, tenant_id: str, table: str) -> None:
    """Measure again what the planner knows of the sealed (bytea) columns of the tenant's partition of
    `table`, without any value (migration 0021's `memory.sealed_column_statistics`): after a store wrote
    many rows there, which ANALYZE never samples."""
    _check_tables([table])
    part = _partitions(conn, tenant_id, [table]).get(table)
    if part is not None:
        conn.execute("SELECT memory.sealed_column_statistics(%s::oid::regclass)", (part.oid,))


def compact_tenant(
    conninfo: str,
    tenant_id: str,
    *,
    tables: Sequence[str] = PARTITIONED_TABLES,
    lock_timeout: str = "10s",
) -> dict[str, int]:
    """VACUUM FULL the tenant's partition of each of `tables`; returns parent -> bytes after the rewrite.

    Only the tenant's own files are locked (ACCESS EXCLUSIVE) and rewritten. A lock not granted
    within `lock_timeout` (a long transaction of this tenant) raises CompactionLockTimeout: queued
    any longer, the request would hold up the tenant's other readers behind it.
    """
    _check_tables(tables)
    written: dict[str, int] = {}
    with psycopg.connect(conninfo, autocommit=True) as conn:
        try:
            conn.execute("SELECT set_config('lock_timeout', %s, false)", (lock_timeout,))
        except psycopg.errors.InvalidParameterValue as exc:
            raise ValidationError("lock_timeout", f"is not a PostgreSQL duration: {lock_timeout!r}") from exc
        found = _partitions(conn, tenant_id, tables)
        missing = [table for table in tables if table not in found]
        if missing:
            raise NotFoundError("tenant", f"tenant {tenant_id!r} has no partition of {', '.join(missing)}")
        for parent in tables:
            part = found[parent]
            try:
                conn.execute(sql.SQL("VACUUM FULL {}").format(part.ident))
            except psycopg.errors.LockNotAvailable as exc:
                raise CompactionLockTimeout(
                    "tenant",
                    f"compacting {part.qualified} ({parent} of tenant {tenant_id!r}) waited more than"
                    f" {lock_timeout} for its lock: a transaction of this tenant holds it. Nothing else"
                    " waited on this compaction; retry it later",
                ) from exc
            row = conn.execute("SELECT pg_total_relation_size(%s::oid)", (part.oid,)).fetchone()
            written[parent] = int(row[0]) if row else 0
    return written


def tenant_files(conn: psycopg.Connection, tenant_id: str) -> list[str]:
    """Data-directory-relative paths of every file of the tenant's partitions (TOAST and indexes
    included): each fork that exists (`_fsm`, `_vm`, `_init`) and each segment past 1 GB (`.1`...)."""
    oids = [part.oid for part in _partitions(conn, tenant_id).values()]
    if not oids:
        return []
    row = conn.execute("SELECT pg_size_bytes(current_setting('segment_size'))").fetchone()
    segment = int(row[0]) if row else 1 << 30
    files: list[str] = []
    for path, *sizes in conn.execute(_RELATIONS, (oids,)).fetchall():
        for fork, size in zip(_FORKS, sizes, strict=True):
            if fork != "main" and not size:
                continue  # the main fork's file exists even when empty; the others once written
            stem = path if fork == "main" else f"{path}_{fork}"
            files.append(stem)
            files.extend(f"{stem}.{n}" for n in range(1, math.ceil(int(size) / segment)))
    return files


def drop_tenant(conn: psycopg.Connection, tenant_id: str) -> int:
    """Drop every partition of the tenant (once its TENANT-scope deletion is complete); returns how many.

    On an autocommit connection each partition is first detached CONCURRENTLY, which waits for the
    parent's older transactions without blocking anyone; the drop then locks the detached table and,
    for memory_versions, briefly memory.memories (its foreign key's triggers). A drop interrupted
    after a detach is finished by the next call. Inside a transaction the partitions are dropped
    directly, which holds ACCESS EXCLUSIVE on each parent until commit. The tenant gets no rows
    afterwards: an insert for it fails (no partition) until `ensure_tenant`.
    """
    mark = _DROP_MARK + tenant_id
    schemas = sorted({table.split(".")[0] for table in PARTITIONED_TABLES})
    dropped = 0
    for schema, name in conn.execute(_ORPHANS, (schemas, mark)).fetchall():
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(schema, name)))
        dropped += 1
    for parent, part in _partitions(conn, tenant_id).items():
        if conn.autocommit:
            row = conn.execute(
                "SELECT inhdetachpending FROM pg_catalog.pg_inherits WHERE inhrelid = %s::oid", (part.oid,)
            ).fetchone()
            conn.execute(sql.SQL("COMMENT ON TABLE {} IS {}").format(part.ident, sql.Literal(mark)))
            conn.execute(
                sql.SQL("ALTER TABLE {} DETACH PARTITION {} {}").format(
                    sql.Identifier(*parent.split(".")),
                    part.ident,
                    sql.SQL("FINALIZE" if row and row[0] else "CONCURRENTLY"),
                )
            )
        conn.execute(sql.SQL("DROP TABLE {}").format(part.ident))
        dropped += 1
    return dropped
