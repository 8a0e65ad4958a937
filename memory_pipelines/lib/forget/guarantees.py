"""Which guarantee held, per target of a deletion's proof: cryptographic erasure, physical erasure, both.

- Cryptographic: every copy the store keeps of the forgotten data is sealed (or MACed) under a key
  this scope destroyed (StoreSpec.key_erasure), and the erasure rotated the tenant's KEK, so no
  wrapped copy of that key opens either. It holds wherever the copies are (WAL archives, replicas, a
  managed server's storage, backups), which no file scan reaches.
- Physical: the store's files that lie on this machine were rewritten and a byte scan of them found
  no fingerprint of the forgotten data. It says nothing of files elsewhere (an external server).

At COMPLETE the key is destroyed but copies of its wrapped form still open until the erasure rotates
the KEK: `PENDING` for both. The erasure turns them into `KEY_DESTROYED:<time>` and
`SCANNED:<time>` or `NOT_SCANNED`; a target no key of the scope seals stays `NONE`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memory_pipelines.lib.stores import registry

__all__ = [
    "KEY_DESTROYED",
    "NONE",
    "NOT_SCANNED",
    "PENDING",
    "SCANNED",
    "at_completion",
    "at_erasure",
    "held",
]

PENDING = "PENDING"
NONE = "NONE"
KEY_DESTROYED = "KEY_DESTROYED"
SCANNED = "SCANNED"
NOT_SCANNED = "NOT_SCANNED"
_PRIMARY = "primary"


def at_completion(scope: str, *, legacy: int | None) -> dict[str, dict[str, Any]]:
    """store -> {cryptographic, physical} when the job completes. `legacy`: target versions sealed
    under their author's subject key (written before version keys); None when unknown."""
    out: dict[str, dict[str, Any]] = {}
    for spec in registry.stores():
        sealed = scope in spec.key_erasure
        entry: dict[str, Any] = {"cryptographic": PENDING if sealed else NONE, "physical": PENDING}
        if spec.name == _PRIMARY and scope in ("MEMORY", "RETENTION") and legacy != 0:
            entry["cryptographic"] = NONE  # those versions' key lives on with their author
            entry["legacySealed"] = legacy
        out[spec.name] = entry
    return out


def at_erasure(
    completed: Mapping[str, Mapping[str, Any]] | None,
    scope: str,
    *,
    erased_at: str,
    keys_gone: bool,
    scanned: Mapping[str, bool],
) -> dict[str, dict[str, Any]]:
    """The proof's guarantees once the erasure ran: `keys_gone` when it rotated the KEK (or the
    tenant's keys and vault file are destroyed); `scanned`: store -> its files were byte-scanned clean."""
    before = completed or at_completion(scope, legacy=None)
    out: dict[str, dict[str, Any]] = {}
    for name, entry in before.items():
        new = dict(entry)
        if entry.get("cryptographic") == PENDING:
            new["cryptographic"] = f"{KEY_DESTROYED}:{erased_at}" if keys_gone else PENDING
        new["physical"] = f"{SCANNED}:{erased_at}" if scanned.get(name, False) else NOT_SCANNED
        out[name] = new
    return out


def held(entry: Mapping[str, Any]) -> str:
    """In words, for a certificate: which guarantee holds for one target."""
    crypto = str(entry.get("cryptographic", ""))
    physical = str(entry.get("physical", ""))
    has_crypto = crypto.startswith(KEY_DESTROYED)
    has_physical = physical.startswith(SCANNED)
    if has_crypto and has_physical:
        return "both: key destroyed and KEK rotated; files scanned, 0 hits"
    if has_crypto:
        return "cryptographic: key destroyed and KEK rotated (its files are not on this machine)"
    if has_physical:
        return "physical: files scanned, 0 hits (no key of this scope seals it)"
    if PENDING in (crypto, physical):
        return "pending: until the physical erasure"
    return "neither on this machine: deleted through the store's API only"
