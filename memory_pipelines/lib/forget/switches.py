"""Incident switches: deletion work paused (for a tenant or every tenant), and a store's deletion
adapter pinned to one of the versions it ships.

A pause stops what has not started: requests are still accepted and hidden at once (nothing of the
scope is read while paused), but no cascade and no physical erasure begins until `resume`; one
already past its start finishes. Deadlines keep running: a pause is accounted in every proof's
`pauses` and never extends a deadline. A pin changes which code a later cascade runs, recorded in
each proof's `adapterVersions`. Neither touches a COMPLETE job: nothing here, and no statement at
all (a trigger of migration 0026), makes one anything but COMPLETE.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import ConflictError, NotFoundError, ValidationError
from memory_pipelines.lib.stores import registry

__all__ = [
    "MAX_REASON",
    "WAITING_WHILE_PAUSED",
    "DeletionPaused",
    "active_pause",
    "adapter_versions",
    "pause",
    "paused_tenants",
    "pauses",
    "pauses_between",
    "pin",
    "require_running",
    "resume",
    "unpin",
    "versions_to_run",
]

MAX_REASON = 200
# Jobs a pause holds: not yet started, or blocked and waiting for a retry. One past its freeze finishes.
WAITING_WHILE_PAUSED = ("REQUESTED", "BLOCKED")


class DeletionPaused(ConflictError):
    """Deletion work of the tenant is paused: the job stays accepted and hidden, and runs on resume."""

    def __init__(self, tenant_id: str, found: dict[str, Any]) -> None:
        whose = "every tenant" if found["tenant_id"] is None else f"tenant {tenant_id}"
        super().__init__(
            "pause",
            f"deletion work of {whose} is paused since {found['paused_at']} ({found['reason']}); requests are"
            " accepted and hidden, and run after `memory-pipelines deletion resume`",
        )
        self.pause = found


def _reason(reason: str) -> str:
    text = (reason or "").strip()
    if not text or len(text) > MAX_REASON or not text.isprintable():
        raise ValidationError("reason", f"one line of 1 to {MAX_REASON} characters saying why (an incident id)")
    return text


def _row(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "pause_id": int(row["pause_id"]),
        "tenant_id": row["tenant_id"],
        "reason": row["reason"],
        "paused_at": row["paused_at"].isoformat(),
        "resumed_at": None if row["resumed_at"] is None else row["resumed_at"].isoformat(),
    }


def active_pause(conn: psycopg.Connection, tenant_id: str) -> dict[str, Any] | None:
    """The open pause that holds the tenant (its own before every tenant's), or None."""
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            "SELECT * FROM control.deletion_pauses WHERE resumed_at IS NULL AND (tenant_id IS NULL OR tenant_id = %s)"
            " ORDER BY tenant_id NULLS LAST LIMIT 1",
            (tenant_id,),
        ).fetchone()
    return None if row is None else _row(row)


def paused_tenants(conn: psycopg.Connection, tenant_ids: list[str]) -> set[str]:
    """Those of `tenant_ids` whose deletion work is paused (theirs or every tenant's), in one query."""
    rows = conn.execute(
        "SELECT t FROM unnest(%s::text[]) AS t WHERE EXISTS (SELECT 1 FROM control.deletion_pauses p"
        " WHERE p.resumed_at IS NULL AND (p.tenant_id IS NULL OR p.tenant_id = t))",
        (tenant_ids,),
    ).fetchall()
    return {str(row[0]) for row in rows}


def require_running(conn: psycopg.Connection, tenant_id: str) -> None:
    """Raise DeletionPaused when the tenant's deletion work is paused."""
    found = active_pause(conn, tenant_id)
    if found is not None:
        raise DeletionPaused(tenant_id, found)


def pause(conn: psycopg.Connection, *, tenant_id: str | None, reason: str) -> dict[str, Any]:
    """Pause deletion work of the tenant (None: of every tenant); an open pause of that scope is kept."""
    validation.check_optional_id("tenant", tenant_id)
    text = _reason(reason)
    if (
        tenant_id is not None
        and not conn.execute("SELECT 1 FROM memory.tenants WHERE tenant_id = %s", (tenant_id,)).fetchone()
    ):
        raise NotFoundError("tenant", f"no tenant {tenant_id!r}: nothing of it to pause")
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            "INSERT INTO control.deletion_pauses (tenant_id, reason) VALUES (%s, %s)"
            " ON CONFLICT (coalesce(tenant_id, '')) WHERE resumed_at IS NULL DO NOTHING RETURNING *",
            (tenant_id, text),
        ).fetchone()
        if row is None:
            row = cur.execute(
                "SELECT * FROM control.deletion_pauses WHERE resumed_at IS NULL AND tenant_id IS NOT DISTINCT FROM %s",
                (tenant_id,),
            ).fetchone()
    assert row is not None
    return _row(row)


def resume(conn: psycopg.Connection, *, tenant_id: str | None) -> dict[str, Any]:
    """End the open pause of exactly that scope (a tenant's, or every tenant's with None)."""
    validation.check_optional_id("tenant", tenant_id)
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(
            "UPDATE control.deletion_pauses SET resumed_at = now()"
            " WHERE resumed_at IS NULL AND tenant_id IS NOT DISTINCT FROM %s RETURNING *",
            (tenant_id,),
        ).fetchone()
    if row is None:
        whose = "every tenant's" if tenant_id is None else f"tenant {tenant_id}'s"
        raise NotFoundError("tenant", f"no pause of {whose} deletion work is open")
    return _row(row)


def pauses(conn: psycopg.Connection, *, tenant_id: str | None = None, open_only: bool = False) -> list[dict[str, Any]]:
    """Pauses (of the tenant and of every tenant, when a tenant is given), newest first."""
    validation.check_optional_id("tenant", tenant_id)
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            "SELECT * FROM control.deletion_pauses WHERE (%s::text IS NULL OR tenant_id IS NULL OR tenant_id = %s)"
            " AND (NOT %s OR resumed_at IS NULL) ORDER BY paused_at DESC, pause_id DESC",
            (tenant_id, tenant_id, open_only),
        ).fetchall()
    return [_row(row) for row in rows]


def pauses_between(conn: psycopg.Connection, tenant_id: str, start: datetime, end: datetime) -> list[dict[str, Any]]:
    """The pauses that held the tenant at some time in [start, end], oldest first, for a proof's timeline."""
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(
            "SELECT * FROM control.deletion_pauses WHERE (tenant_id IS NULL OR tenant_id = %s)"
            " AND paused_at <= %s AND (resumed_at IS NULL OR resumed_at >= %s) ORDER BY paused_at, pause_id",
            (tenant_id, end, start),
        ).fetchall()
    return [
        {
            "pausedAt": r["paused_at"].isoformat(),
            "resumedAt": None if r["resumed_at"] is None else r["resumed_at"].isoformat(),
            "scope": "all tenants" if r["tenant_id"] is None else "tenant",
            "reason": r["reason"],
        }
        for r in rows
    ]


def _shipped(store: str) -> tuple[str, ...]:
    if not registry.is_registered(store):
        raise NotFoundError("store", f"no registered store {store!r}; stores: {', '.join(registry.names())}")
    spec = registry.spec(store)
    return (spec.adapter_version, *spec.older_adapter_versions)


def pin(conn: psycopg.Connection, *, store: str, version: str, reason: str) -> dict[str, Any]:
    """Make later cascades run `version` of the store's adapter (one of those it ships)."""
    shipped = _shipped(store)
    if version not in shipped:
        raise ValidationError("version", f"{store} ships adapter versions {', '.join(shipped)}, not {version!r}")
    text = _reason(reason)
    conn.execute(
        "INSERT INTO control.adapter_pins (store, version, reason) VALUES (%s, %s, %s)"
        " ON CONFLICT (store) DO UPDATE SET version = excluded.version, reason = excluded.reason, pinned_at = now()",
        (store, version, text),
    )
    return {"store": store, "version": version, "default": shipped[0], "reason": text}


def unpin(conn: psycopg.Connection, *, store: str) -> dict[str, Any]:
    shipped = _shipped(store)
    conn.execute("DELETE FROM control.adapter_pins WHERE store = %s", (store,))
    return {"store": store, "version": shipped[0], "default": shipped[0], "reason": None}


def versions_to_run(conn: psycopg.Connection) -> dict[str, str]:
    """store -> the adapter version a cascade runs now. A pin to a version this release does not ship
    is refused (ConflictError naming `pin`), never silently replaced by the default."""
    found = adapter_versions(conn)
    stale = {name: f["pinned"]["version"] for name, f in found.items() if f["pinned"] and not f["pin_shipped"]}
    if stale:
        raise ConflictError(
            "pin",
            "; ".join(
                f"{name} is pinned to {version}, which this release does not ship" for name, version in stale.items()
            )
            + ": `memory-pipelines deletion adapter unpin STORE` or pin a version it ships",
        )
    return {name: f["version"] for name, f in found.items()}


def adapter_versions(conn: psycopg.Connection) -> dict[str, dict[str, Any]]:
    """Every registered store: the adapter version a cascade runs now, its default, what it ships, the pin."""
    pinned = {
        store: (version, reason, at)
        for store, version, reason, at in conn.execute(
            "SELECT store, version, reason, pinned_at FROM control.adapter_pins"
        )
    }
    found = {}
    for spec in registry.stores():
        shipped = (spec.adapter_version, *spec.older_adapter_versions)
        pin_row = pinned.get(spec.name)
        # A pin to a version this release no longer ships is shown here and refused by a cascade.
        running = pin_row[0] if pin_row and pin_row[0] in shipped else spec.adapter_version
        found[spec.name] = {
            "version": running,
            "default": spec.adapter_version,
            "shipped": list(shipped),
            "pinned": None
            if pin_row is None
            else {"version": pin_row[0], "reason": pin_row[1], "pinned_at": pin_row[2].isoformat()},
            "pin_shipped": pin_row is None or pin_row[0] in shipped,
        }
    return found
