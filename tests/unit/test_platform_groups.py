"""`MemoryPlatform` is its groups of methods held on one `PlatformParts`: each public method is a
group's own (name, signature, docstring), delegated to the group instance the platform holds, and a
group works alone on parts it is given (here on the in-memory store: no service)."""

from __future__ import annotations

import inspect
from typing import cast

import pytest

from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.lib.infra.settings import Settings
from memory_pipelines.lib.memories.in_memory import InMemoryStore
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.platform import MemoryPlatform
from memory_pipelines.platform.backups import Backups
from memory_pipelines.platform.checks import Checks
from memory_pipelines.platform.derived_views import DerivedViews
from memory_pipelines.platform.forgetting import Forgetting
from memory_pipelines.platform.memories import Memories
from memory_pipelines.platform.parts import PlatformParts
from memory_pipelines.platform.runs import Runs
from memory_pipelines.platform.switches import Switches
from memory_pipelines.platform.tenants import Tenants

GROUPS = (Memories, Tenants, DerivedViews, Forgetting, Switches, Backups, Runs, Checks)


def _public(cls: type) -> dict[str, object]:
    return {name: f for name, f in vars(cls).items() if inspect.isfunction(f) and not name.startswith("_")}


def test_the_platform_has_every_method_of_every_group_and_no_other():
    facade = {name for name in _public(MemoryPlatform) if name != "close"}
    owned = [name for group in GROUPS for name in _public(group)]
    assert sorted(facade) == sorted(owned) and len(owned) == len(set(owned))


def test_each_method_shows_its_groups_signature_and_docstring_and_calls_the_group_held(tmp_path):
    mp = MemoryPlatform(settings=Settings(home=tmp_path), store=cast(MemoryStore, InMemoryStore()))
    for group in GROUPS:
        for name, method in _public(group).items():
            delegated = getattr(MemoryPlatform, name)
            assert delegated.__wrapped__ is method
            assert inspect.signature(delegated) == inspect.signature(method)
            assert delegated.__doc__ == method.__doc__ and delegated.__qualname__ == f"MemoryPlatform.{name}"
            held = inspect.getclosurevars(delegated).nonlocals["group"]
            assert type(getattr(mp, held)) is group, f"{name} is delegated to {held}"


def test_a_group_works_alone_on_the_parts_it_is_given(tmp_path):
    store = InMemoryStore()
    parts = PlatformParts(settings=Settings(home=tmp_path), store=cast(MemoryStore, store))
    tenants, memories = Tenants(parts), Memories(parts)
    assert tenants.create_tenant(tenant_id="acme") == {"tenant_id": "acme", "sharing_mode": "strict"}
    store.write(tenant_id="acme", user_id="ann", text="Likes green tea")
    assert [m["text"] for m in memories.list(tenant_id="acme", user_id="ann")] == ["Likes green tea"]
    with pytest.raises(ValidationError) as refused:
        tenants.create_tenant(tenant_id="eval")  # reserved: refused before the store is asked
    assert refused.value.field == "tenant"
    # The same parts behind the platform's front door.
    mp = MemoryPlatform(settings=Settings(home=tmp_path), store=cast(MemoryStore, store))
    assert [m["text"] for m in mp.list(tenant_id="acme", user_id="ann")] == ["Likes green tea"]
