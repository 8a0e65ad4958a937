"""The analytics rows of each tenant in PostgreSQL (`derived.analytics_rows`): their schema, and
how they are written and read whole.

A tenant's rows are replaced in one transaction (DELETE, then COPY), so a reader sees the old copy
or the new one, never a mix. They are read back by `COPY ... TO STDOUT` as CSV parsed by pyarrow:
2.0 s for 1,000,000 rows where a row-by-row fetch takes several times that
(docs/analytics-location.md). Timestamps travel as microseconds since the epoch, so no text format
of PostgreSQL's has to be parsed back.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Sequence
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from psycopg import sql

from memory_pipelines.lib.memories import crypto

__all__ = [
    "BUCKETS",
    "SCHEMA",
    "TABLE",
    "bucket_of",
    "buckets_of",
    "pseudonym",
    "read_rows",
    "record_ids",
    "write_rows",
]

TABLE = "derived.analytics_rows"
SCHEMA = pa.schema(
    [
        ("memory_id", pa.string()),
        ("version", pa.int32()),
        ("user_pseudonym", pa.string()),
        ("team_pseudonym", pa.string()),
        ("memory_type", pa.string()),
        ("category", pa.string()),
        ("shareable", pa.bool_()),
        ("confidence", pa.float64()),
        ("text_length", pa.int32()),
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("updated_at", pa.timestamp("us", tz="UTC")),
        ("version_created_at", pa.timestamp("us", tz="UTC")),
        ("tenant_id", pa.string()),
    ]
)
# A column users' SQL has always had: the first byte of the author's pseudonym modulo BUCKETS.
BUCKETS = 64
_TIMESTAMPS = {f.name for f in SCHEMA if pa.types.is_timestamp(f.type)}
_HEX_BYTES = pa.array([f"{i:02x}" for i in range(256)])


def pseudonym(key: bytes, value: str) -> str:
    """An author's or team's pseudonym in the analytics copy: an HMAC under the tenant's subkey."""
    return crypto.mac(key, value.encode()).hex()[:32]


def bucket_of(user_pseudonym: str) -> int:
    return int(user_pseudonym[:2], 16) % BUCKETS


def buckets_of(user_pseudonyms: pa.ChunkedArray | pa.Array) -> pa.Array:
    """bucket_of for a whole column (a pseudonym that is not hex, never written by us, goes to 0)."""
    first_byte = pc.index_in(pc.utf8_slice_codeunits(user_pseudonyms, 0, 2), value_set=_HEX_BYTES)
    return pc.cast(pc.bit_wise_and(pc.fill_null(first_byte, 0), BUCKETS - 1), pa.int32())


def record_ids(table: pa.Table) -> pa.ChunkedArray:
    """`memory_id:version` of each row, as lineage names records."""
    return pc.binary_join_element_wise(table["memory_id"], pc.cast(table["version"], pa.string()), ":")


def write_rows(conn: psycopg.Connection, rows: Iterable[Sequence[Any]]) -> None:
    """COPY `rows` (values in SCHEMA's order, tenant_id last) into the table."""
    names = sql.SQL(", ").join(sql.Identifier(n) for n in SCHEMA.names)
    with conn.cursor() as cur, cur.copy(sql.SQL("COPY {} ({}) FROM STDIN").format(_table(), names)) as copy:
        for row in rows:
            copy.write_row(row)


def read_rows(conn: psycopg.Connection, tenant_id: str, columns: Sequence[str] | None = None) -> pa.Table:
    """The tenant's rows (all columns, or `columns` in that order), by memory_id and version."""
    wanted = list(columns) if columns is not None else SCHEMA.names
    unknown = [c for c in wanted if c not in SCHEMA.names]
    if unknown:
        raise ValueError(f"no analytics column {unknown[0]!r}")
    select = sql.SQL(", ").join(
        sql.SQL("(extract(epoch FROM {0}) * 1000000)::bigint").format(sql.Identifier(c))
        if c in _TIMESTAMPS
        else sql.Identifier(c)
        for c in wanted
    )
    statement = sql.SQL(
        "COPY (SELECT {} FROM {} WHERE tenant_id = %s ORDER BY memory_id, version) TO STDOUT (FORMAT csv)"
    ).format(select, _table())
    buffer = io.BytesIO()
    with conn.cursor() as cur, cur.copy(statement, (tenant_id,)) as copy:
        for chunk in copy:
            buffer.write(chunk)
    types = {c: pa.int64() if c in _TIMESTAMPS else SCHEMA.field(c).type for c in wanted}
    if not buffer.tell():
        return pa.schema([SCHEMA.field(c) for c in wanted]).empty_table()
    table = pacsv.read_csv(
        pa.BufferReader(buffer.getvalue()),
        read_options=pacsv.ReadOptions(column_names=wanted),
        # A category may hold a newline; PostgreSQL quotes such a value, and an empty string, never a NULL.
        # An empty line is a row of one NULL column, not nothing (PostgreSQL writes NULL as nothing).
        parse_options=pacsv.ParseOptions(newlines_in_values=True, ignore_empty_lines=False),
        convert_options=pacsv.ConvertOptions(
            column_types=types,
            null_values=[""],  # not pyarrow's defaults: a category may be "NULL" or "N/A"
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,
            true_values=["t"],
            false_values=["f"],
        ),
    )
    for name in _TIMESTAMPS & set(wanted):
        index = table.column_names.index(name)
        table = table.set_column(index, SCHEMA.field(name), pc.cast(table[name], SCHEMA.field(name).type))
    return table


def _table() -> sql.Composed:
    schema, name = TABLE.split(".")
    return sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(name))
