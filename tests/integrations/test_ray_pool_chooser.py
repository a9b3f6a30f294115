"""The Ray router deployment's pool choice, without Ray's replicas: a real SQLite registry of the
demo world's adapters (ranks 4 and 16) and a tenant with its key, pools as `RayPool`s declare them.
A tenant's dedicated pool first, the shared pools after; the lowest max rank first while it has
room; the router's refusals for what no pool open to the caller serves."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("ray")
from loraplex.integrations.ray_router import PoolChooser, pool_spec  # noqa: E402
from loraplex.integrations.ray_serve import RayPool  # noqa: E402
from loraplex.registry import Registry  # noqa: E402
from loraplex.router.catalog import registry_catalog  # noqa: E402
from loraplex.router.routing import Refusal  # noqa: E402
from loraplex.router.serve import registry_callers  # noqa: E402
from loraplex.settings.serve import ServeSettings  # noqa: E402


def _chooser(registry: Registry, pools: list[RayPool]) -> PoolChooser:
    specs = [pool_spec(p) for p in pools]
    return PoolChooser(
        specs, {s.name: 2 for s in specs}, registry_catalog(registry), registry_callers(registry)
    )


@pytest.fixture
def fleet(demo_world, tmp_path):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    registry = Registry(url, base_model_dir=demo_world.model_dir, max_lora_rank=32)
    registry.init()
    for name in ("rotate", "reverse"):  # ranks 4 and 16
        registry.add_revision(demo_world.adapters[name], name, shared=True, status="stable")
    registry.add_tenant("acme")
    key = registry.create_key("acme")
    options = ServeSettings(model=demo_world.model_dir, data_dir=tmp_path, registry=url)
    low = dataclasses.replace(options, max_lora_rank=8)
    pools = {
        "high": RayPool("high", dataclasses.replace(options, max_lora_rank=32), num_replicas=1),
        "low": RayPool("low", low, num_replicas=1),
        "acme-only": RayPool("acme-only", low, num_replicas=1, tenants=("acme",)),
    }
    yield registry, pools, f"Bearer {key}"
    registry.close()


def test_the_pool_is_picked_by_rank_then_tenant_then_room(fleet):
    registry, pools, acme = fleet
    chooser = _chooser(registry, list(pools.values()))
    assert chooser.choose("reverse", None) == "high"  # rank 16: only the rank-32 pool
    assert chooser.choose("rotate", None) == "low"  # rank 4: the lowest max rank first
    assert chooser.choose("rotate", acme) == "acme-only"  # the tenant's dedicated pool first
    assert chooser.choose("reverse", acme) == "high"  # above its pool's rank: a shared pool
    assert chooser.choose(pool_spec(pools["low"]).base_model, None) == "low"  # the bare base
    assert chooser.choose("not-registered", None) == "low"  # its worker's own 404 answers it
    chooser.in_flight["low"] = 2  # the low pool's room taken: the next eligible one
    assert chooser.choose("rotate", None) == "high"
    chooser.in_flight["high"] = 2  # every eligible pool full: the first
    assert chooser.choose("rotate", None) == "low"


def test_what_no_pool_open_to_the_caller_serves_gets_the_routers_refusal(fleet):
    registry, pools, acme = fleet
    chooser = _chooser(registry, [pools["acme-only"]])
    refused = chooser.choose("reverse", acme)
    assert isinstance(refused, Refusal)
    assert (refused.status, refused.code) == (404, "model_not_available")
    assert refused.message.startswith("no worker serves adapters of rank 16 on base model ")
    assert "(the base of reverse@" in refused.message
    closed = chooser.choose("rotate", None)  # a dedicated pool, and no key: the open tenant
    assert closed == Refusal(
        404, "model_not_available", "no pool open to tenant default serves rotate"
    )
