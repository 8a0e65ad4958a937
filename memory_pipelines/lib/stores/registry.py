"""Store registry: every store that may receive memory-derived data, each declared once by its package.

A store package under `lib/stores/` declares its `StoreSpec`s in a `spec` module (`SPECS`); the
registry finds them there. Every list that names the stores is derived from here: the derived
assets and `tenant_refresh`, `DerivedStores.sync_all`, the forget graph's steps, verification,
proofs, certificates, the data map, erasure and what a restore drops. A store without a spec has no
delete adapter, so nothing may be written to it (lineage refuses).

A spec is checked when it is registered (`check_spec`): a store deletion could not reach (no adapter,
an adapter without every method of REQUIRED, no verification, or a derived store
whose copies a restore would neither drop nor rebuild) is refused, so it never receives a memory.
A store is brought under the hard gate in two steps: registered `onboarding`, it receives only the
memories of test tenants (`memory-pipelines tenant set-test`): its sync skips every other tenant and
lineage refuses any other write; then `enforced`, every tenant's.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from memory_pipelines.lib.infra import faults
from memory_pipelines.lib.infra.errors import ServiceError

__all__ = [
    "ALL_SCOPES",
    "ENFORCED",
    "ONBOARDING",
    "REQUIRED",
    "StoreCheck",
    "StoreSpec",
    "Synced",
    "adapter",
    "check_spec",
    "derived_names",
    "is_registered",
    "is_test_tenant",
    "names",
    "onboarding_records",
    "register",
    "require_registered",
    "require_writable",
    "resolve",
    "spec",
    "stores",
]

# Cascade ranks: copies before the primary and the keys, so an interrupted job can still read what
# it has to find (and build paraphrase probes) when it resumes.
COPY = 100
PRIMARY = 900
KEYS = 990
# Every deletion scope (a StoreSpec's `key_erasure` when each of them destroys its key).
ALL_SCOPES = ("MEMORY", "RETENTION", "SUBJECT", "TENANT")
# A store's stage: receiving test tenants' memories only, or every tenant's.
ONBOARDING = "onboarding"
ENFORCED = "enforced"


@dataclass
class Synced:
    """What one sync of a store did: counts, and text or path facts for the asset's metadata."""

    counts: dict[str, int]
    text: dict[str, str] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StoreCheck:
    """An asset check of a store's asset: `problems(derived, tenant_id=)` -> counts (numbers only,
    never text); it passes when each of `must_be_zero` is 0."""

    name: str
    description: str
    problems: str | Callable[..., dict[str, int]]
    must_be_zero: tuple[str, ...]


# The methods a registered store's adapter must have (`check_spec` refuses a store whose adapter lacks one).
# Optional ones: `count_sql(ctx)` (its `count` as one SQL scalar, asked with the other stores') and
# `fingerprints_many(conn, ctxs)` (`fingerprints` of each job of a batch from one read).
REQUIRED = ("find", "delete", "count", "verify", "fingerprints", "erase")


@dataclass(frozen=True)
class StoreSpec:
    """What the platform needs to know of one store. `adapter` and `sync` are objects or lazy
    "module:attribute" references (a spec module stays import-light: the registry reads it first)."""

    name: str
    owner: str
    locator_key: str
    adapter_version: str  # the version a cascade runs unless an operator pins another (lib/forget/switches.py)
    max_completion_seconds: int
    verification: str
    adapter: str | Callable[[], Any]  # its deletion adapter's class (see stores/adapter.py)
    order: int = COPY  # position in the cascade
    derived: bool = True  # receives records through lineage (the primary and the key store are the source)
    # The Dagster asset that keeps it in sync with `memories`, and how: sync(derived, tenant_id=, progress=)
    # -> Synced. None for stores written by their callers (the recall cache, prompt snapshots).
    asset: str | None = None
    sync: str | Callable[..., Any] | None = None
    asset_description: str = ""
    kinds: tuple[str, ...] = ("postgres",)
    checks: tuple[StoreCheck, ...] = ()
    # Records of the tenant in this store for the data map and certificates; None: its lineage records.
    count: str | Callable[..., int] | None = None
    # Its records' lineage-orphans (copies of versions a restore dropped) deleted in the restore's own
    # transaction: SQL taking %(t)s (tenant) and %(ids)s (record ids); None: the rebuild after the
    # restore replaces them (vectors, analytics) or they have no lineage of their own.
    restore_drop: str | None = None
    # Its rows a backup holds and a restore brings back, loaded after the memories: name -> (table,
    # [(column, Arrow type name, e.g. "string" for pa.string())]), read with a bound tenant id.
    backup_tables: dict[str, tuple[str, list[tuple[str, str]]]] = field(default_factory=dict, hash=False)
    # Cryptographic erasure: the scopes whose deletion destroys the key every copy of this store is
    # sealed (or MACed) under, so that no copy anywhere opens once the erasure has rotated the KEK;
    # and, for the certificate, what seals its copies (or why nothing does).
    key_erasure: tuple[str, ...] = ()
    sealed_by: str = "nothing: its records are not sealed under a key of the scope"
    stage: str = ENFORCED  # ONBOARDING: only test tenants' memories reach it
    # Earlier versions its adapter still runs when pinned (`deletion adapter pin`); it reads `Context.versions`.
    older_adapter_versions: tuple[str, ...] = ()


_lock = threading.RLock()
_builtin: tuple[StoreSpec, ...] | None = None
_extra: list[StoreSpec] = []


def run_sync(spec: StoreSpec, derived: Any, *, tenant_id: str, **kwargs: Any) -> Any:
    """The store's sync for the tenant (its `Synced`); a crash test may end the process right after.
    An onboarding store skips a tenant that is not a test tenant (nothing written, said in `text`)."""
    assert spec.sync is not None, spec.name
    if spec.stage == ONBOARDING:
        with derived.store.transaction() as conn:
            if not is_test_tenant(conn, tenant_id):
                held = onboarding_records(conn, tenant_id).get(spec.name, 0)
                if held:  # kept from when it was a test tenant: skipping would leave them stale for good
                    raise ServiceError(
                        "store",
                        f"store {spec.name!r} is onboarding and still holds {held} record(s) of {tenant_id!r}, which"
                        " is no longer a test tenant: mark it one again (tenant set-test) to keep them in sync",
                    )
                return Synced({"records": 0}, text={"skipped": f"{spec.name} is onboarding: test tenants only"})
    synced = resolve(spec.sync)(derived, tenant_id=tenant_id, **kwargs)
    faults.point(f"sync.{spec.name}")
    return synced


def resolve(ref: str | Callable[..., Any]) -> Any:
    """The object a "module:attribute" reference names (or the object itself)."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def check_spec(spec: StoreSpec) -> None:
    """Refuse a store deletion could not reach (see the module docstring): ServiceError naming it."""
    problems = []
    try:
        made = resolve(spec.adapter) if spec.adapter else None
    except (ImportError, AttributeError) as exc:
        made, problems = None, [f"its adapter {spec.adapter!r} cannot be loaded ({exc})"]
    if made is None and not problems:
        problems.append("no deletion adapter")
    elif made is not None:
        missing = [method for method in REQUIRED if not callable(getattr(made, method, None))]
        if missing:
            problems.append(f"its deletion adapter lacks {', '.join(missing)}")
    if not spec.verification.strip():
        problems.append("no verification")
    if spec.derived and spec.restore_drop is None and spec.sync is None:
        problems.append("no restore drop, and no sync to rebuild it after a restore")
    if spec.stage not in (ONBOARDING, ENFORCED):
        problems.append(f"stage {spec.stage!r} is neither {ONBOARDING!r} nor {ENFORCED!r}")
    if problems:
        raise ServiceError(
            "store", f"store {spec.name!r} cannot be registered: {'; '.join(problems)} (it could never be forgotten)"
        )


def onboarding_records(conn: Any, tenant_id: str) -> dict[str, int]:
    """Records of the tenant in each onboarding store (by lineage), the stores holding none left out."""
    onboarding = [s.name for s in stores() if s.stage == ONBOARDING]
    if not onboarding:
        return {}
    rows = conn.execute(
        "SELECT store, count(DISTINCT record_id) FROM derived.lineage WHERE tenant_id = %s AND store = ANY(%s)"
        " GROUP BY store",
        (tenant_id, onboarding),
    ).fetchall()
    return {str(store): int(n) for store, n in rows if n}


def is_test_tenant(conn: Any, tenant_id: str) -> bool:
    row = conn.execute("SELECT test_tenant FROM memory.tenants WHERE tenant_id = %s", (tenant_id,)).fetchone()
    return bool(row and row[0])


def _discover() -> tuple[StoreSpec, ...]:
    from memory_pipelines.lib import stores as package

    found: list[StoreSpec] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.ispkg:
            try:
                module = importlib.import_module(f"{package.__name__}.{info.name}.spec")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package.__name__}.{info.name}.spec":
                    raise
                continue
            found.extend(module.SPECS)
    for found_spec in found:
        check_spec(found_spec)
    return tuple(found)


def stores() -> tuple[StoreSpec, ...]:
    """Every registered store in cascade order (copies first, the primary and the keys last)."""
    global _builtin
    with _lock:
        if _builtin is None:
            _builtin = _discover()
        return tuple(sorted((*_builtin, *_extra), key=lambda s: (s.order, s.name)))


def names() -> list[str]:
    return [s.name for s in stores()]


def derived_names() -> list[str]:
    """Stores that receive derived records through lineage."""
    return [s.name for s in stores() if s.derived]


def spec(name: str) -> StoreSpec:
    for s in stores():
        if s.name == name:
            return s
    raise KeyError(name)


def is_registered(name: str) -> bool:
    return any(s.name == name for s in stores())


_adapters: dict[StoreSpec, Any] = {}


def adapter(name: str) -> Any:
    """The deletion adapter object of a registered store (made on first use)."""
    s = spec(name)
    with _lock:
        if s not in _adapters:
            _adapters[s] = resolve(s.adapter)()
        return _adapters[s]


@contextmanager
def register(*specs: StoreSpec) -> Iterator[None]:
    """Register stores from outside `lib/stores/` (a plugin, a test's toy store) for the block."""
    for s in specs:
        check_spec(s)
    with _lock:
        taken = set(names())
        clash = [s.name for s in specs if s.name in taken]
        if clash:
            raise ServiceError("store", f"store {clash[0]!r} is already registered")
        _extra.extend(specs)
    try:
        yield
    finally:
        with _lock:
            for s in specs:
                _extra.remove(s)
                _adapters.pop(s, None)


def require_registered(store: str) -> None:
    """Refuse writes to a store that deletion cannot reach."""
    if not is_registered(store):
        raise ServiceError("store", f"store {store!r} has no registered delete adapter; refusing to write to it")


def require_writable(conn: Any, store: str, tenant_id: str) -> None:
    """Refuse writes to a store deletion cannot reach, or to an onboarding store for a tenant that
    is not a test tenant (in the writer's transaction: a flag changed meanwhile is seen)."""
    require_registered(store)
    if spec(store).stage == ONBOARDING and not is_test_tenant(conn, tenant_id):
        raise ServiceError(
            "store", f"store {store!r} is onboarding: it receives test tenants' memories only, not {tenant_id!r}'s"
        )
