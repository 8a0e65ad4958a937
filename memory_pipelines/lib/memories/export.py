"""A subject's export (GDPR Art. 15/20, CCPA): every version of every memory they wrote, decrypted,
streamed in batches through a server-side cursor on a connection of its own, as rows or as one JSON
document.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any

from psycopg.rows import dict_row

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.memories import crypto, tenants
from memory_pipelines.lib.memories.connections import Connections
from memory_pipelines.lib.memories.keys import KeyStore
from memory_pipelines.lib.memories.records import iso
from memory_pipelines.lib.memories.sealing import key_of, query_aad, text_aad
from memory_pipelines.lib.memories.visibility import NOT_HIDDEN, SELECT_MEMORY
from memory_pipelines.lib.results import ExportedVersion

__all__ = [
    "EXPORT_BATCH",
    "Export",
]

EXPORT_BATCH = 500

# Query texts are constants; every value travels as a bound parameter.
_SELECT_EXPORT = (
    SELECT_MEMORY
    + " WHERE m.tenant_id = %s AND m.user_id = %s"
    + NOT_HIDDEN
    + " ORDER BY m.created_at, m.memory_id, v.version"
)


def _export_row(row: dict[str, Any], keys: dict[str, bytes]) -> ExportedVersion:
    """One exported version, opened with the keys looked up for its batch."""
    key = key_of(row, keys)
    ids = (row["tenant_id"], row["memory_id"], row["version"])
    query_ct = row["original_query_ct"]
    return {
        "memory_id": row["memory_id"],
        "version": row["version"],
        "current": row["version"] == row["current_version"],
        "text": crypto.open_sealed(key, bytes(row["text_ct"]), text_aad(*ids)).decode("utf-8"),
        "team_id": row["team_id"],
        "memory_type": row["memory_type"],
        "shareable": row["shareable"],
        "category": row["category"],
        "confidence": row["confidence"],
        "original_query": None
        if query_ct is None
        else crypto.open_sealed(key, bytes(query_ct), query_aad(*ids)).decode("utf-8"),
        "do_not_sell": bool(row["memory_dns"] or row["subject_dns"]),
        "restored_from": row["restored_from"],
        "created_at": iso(row["created_at"]),
        "superseded_at": iso(row["superseded_at"]),
    }


class Export:
    """A subject's export, as rows or as a JSON document, read on `connections` with keys from `keys`."""

    def __init__(self, connections: Connections, keys: KeyStore) -> None:
        self.connections = connections
        self.keys = keys

    def iter_export(self, *, tenant_id: str, subject: str) -> Iterator[ExportedVersion]:
        """Every version of every memory the subject wrote, personal and team, streamed in batches."""
        validation.check_id("tenant", tenant_id)
        validation.check_id("subject", subject)
        with self.connections.transaction() as conn:
            tenants.tenant_mode(conn, tenant_id)
        # A connection of its own: a server-side cursor lives as long as the caller keeps reading.
        with self.connections.connect() as conn, conn.transaction():
            with conn.cursor(name="export_subject", row_factory=dict_row) as cur:
                cur.itersize = EXPORT_BATCH
                cur.execute(_SELECT_EXPORT, (tenant_id, subject))
                while batch := cur.fetchmany(EXPORT_BATCH):
                    # Keys are looked up per batch on the store's own short transactions: the export's
                    # long-lived one must hold no lock on the key tables (key compaction waits for it).
                    with self.connections.transaction() as key_conn:
                        keys = self.keys.keys_by_id(key_conn, tenant_id, [row["key_id"] for row in batch])
                    yield from (_export_row(row, keys) for row in batch)

    def export_json(
        self, *, tenant_id: str, subject: str, more: Callable[[], Mapping[str, Any]] | None = None
    ) -> Iterator[str]:
        """The subject's export (GDPR Art. 15/20, CCPA) as chunks of one JSON document; `more` gives
        the sections that follow `memories` (what higher layers hold about the subject), read before
        the first byte, so an error there never leaves a document cut short."""
        rows = self.iter_export(tenant_id=tenant_id, subject=subject)
        first_row = next(rows, None)  # validates before the first byte is produced
        sections = more() if more is not None else {}
        header = {
            "format": "memory-pipelines.export.v1" if more is None else "memory-pipelines.export.v2",
            "tenant": tenant_id,
            "subject": subject,
            "exported_at": datetime.now().astimezone().isoformat(),
        }
        yield json.dumps(header)[:-1] + ', "memories": ['
        if first_row is not None:
            yield "\n" + json.dumps(first_row)
            for row in rows:
                yield ",\n" + json.dumps(row)
        yield "\n]"
        for name, section in sections.items():
            yield f",\n{json.dumps(name)}: {json.dumps(section)}"
        yield "}\n"
