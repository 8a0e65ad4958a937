"""The rules every write follows, single or bulk: the defaults of a memory's metadata, and the no-op
rule (a text a current, visible version already holds is not written again)."""

from __future__ import annotations

from memory_pipelines.lib.memories.visibility import NOT_TOMBSTONED

__all__ = [
    "DEFAULT_CATEGORY",
    "DEFAULT_CONFIDENCE",
    "SAME_TEXT",
    "SAME_TEXTS",
]

DEFAULT_CATEGORY = "general"
DEFAULT_CONFIDENCE = 1.0

# Query texts are constants; every value travels as a bound parameter.
# Current versions with a given text MAC that no deletion hides (the no-op rule of writes).
SAME_TEXT = (
    "SELECT v.memory_id FROM memory.memory_versions v"  # noqa: S608 - constant text
    " WHERE v.tenant_id = %s AND v.text_mac = %s AND v.superseded_at IS NULL" + NOT_TOMBSTONED
)
SAME_TEXTS = (
    "SELECT m.memory_id, m.current_version, m.user_id, m.team_id, v.text_mac"  # noqa: S608 - constant text
    " FROM memory.memory_versions v JOIN memory.memories m"
    " ON m.tenant_id = v.tenant_id AND m.memory_id = v.memory_id"
    " WHERE v.tenant_id = %s AND v.superseded_at IS NULL AND v.text_mac = ANY(%s)" + NOT_TOMBSTONED
)
