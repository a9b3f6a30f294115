"""The Ray router deployment's pool choice, without Ray's replicas: a real SQLite registry of the
demo world's adapters (ranks 4 and 16) and a tenant with its key, pools as `RayPool`s declare them.
A tenant's dedicated pool first, the shared pools after; the lowest max rank first while it has
room; the router's refusals for what no pool open to the caller serves; a split name's revision
picked by the registry's weights, its canary to a `canary` pool first, a warm adapter to a `warm`
pool first, and the pools where an adapter is placed before the warm ones."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("ray")
from loraplex.integrations.ray_router import PoolChooser, pool_spec  # noqa: E402
from loraplex.integrations.ray_serve import RayPool  # noqa: E402
from loraplex.registry import Registry  # noqa: E402
from loraplex.registry.traffic import pick  # noqa: E402
from loraplex.router.catalog import registry_catalog  # noqa: E402
from loraplex.router.routing import Refusal  # noqa: E402
from loraplex.router.serve import registry_callers  # noqa: E402
from loraplex.router.splits import registry_splits  # noqa: E402
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


def test_a_canary_goes_to_a_canary_pool_and_a_warm_adapter_to_a_warm_pool_first(
    demo_world, tmp_path
):
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    registry = Registry(url, base_model_dir=demo_world.model_dir, max_lora_rank=32)
    registry.init()
    stable = registry.add_revision(
        demo_world.adapters["rotate"], "rotate", shared=True, status="stable"
    )
    canary = registry.add_revision(demo_world.adapters["rot13"], "rotate", shared=True)
    registry.set_traffic("rotate", {stable.revision: 50, canary.revision: 50}, force=True)
    registry.add_revision(
        demo_world.adapters["reverse"], "reverse", shared=True, status="stable", warm_policy="gpu"
    )
    options = ServeSettings(model=demo_world.model_dir, data_dir=tmp_path, registry=url)
    pools = [
        RayPool("canary", options, num_replicas=1, role="canary"),
        RayPool("warm", options, num_replicas=1, role="warm"),
        RayPool("main", options, num_replicas=1),
    ]
    specs = [pool_spec(p) for p in pools]
    chooser = PoolChooser(
        specs,
        {s.name: 2 for s in specs},
        registry_catalog(registry),
        registry_callers(registry),
        registry_splits(registry),
    )
    traffic = list(registry.show("rotate").traffic)
    sides = set()
    for user in (f"user-{i}" for i in range(12)):
        wanted = chooser.wanted("rotate", None, user)
        revision = pick("rotate", traffic, user)
        sides.add(revision)
        assert wanted.model == f"rotate@{revision}"
        assert wanted.canary == (revision == canary.revision)
        first = "canary" if wanted.canary else "main"  # the pools with a role after the others
        assert chooser.candidates(wanted)[0] == first
    assert sides == {stable.revision, canary.revision}
    warm = chooser.wanted("reverse", None)
    assert warm.warm and chooser.candidates(warm) == ["warm", "main", "canary"]
    pinned = chooser.wanted("reverse@" + registry.show("reverse").traffic[0][0], None)
    assert chooser.candidates(pinned)[0] == "warm"  # a name@revision of a warm adapter too
    # where its adapter is placed: after a canary's canary pools, before the warm pools
    assert chooser.candidates(warm, {"main"}) == ["main", "warm", "canary"]
    split = chooser.wanted("rotate", None, "user-0")
    placed = chooser.candidates(split, {"main"})
    assert placed == (["canary", "main", "warm"] if split.canary else ["main", "warm", "canary"])
    registry.close()
