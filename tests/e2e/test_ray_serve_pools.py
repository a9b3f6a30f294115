"""Ray Serve with a deployment per pool, each with real replicas that are loraplex workers over
the demo world: a low-rank pool and a high-rank pool, each answering its own adapters right, the
low-rank one refusing an adapter above its rank; and the router deployment in front of them, which
sends a request that names only its model to a pool that serves it, and refuses one no pool
serves as `loraplex router` does."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from test_ray_serve import _stop_handles_loop  # noqa: E402
from tinymodels import make_adapter  # noqa: E402
from world_fleet import checked_inputs  # noqa: E402

from loraplex.demo.world import ATTENTION, TRANSFORMS, make_prompt  # noqa: E402
from loraplex.integrations.ray_router import pool_spec, run_router  # noqa: E402
from loraplex.integrations.ray_serve import RayPool, run_pools  # noqa: E402
from loraplex.registry import Registry  # noqa: E402
from loraplex.settings.serve import ServeSettings  # noqa: E402


@pytest.fixture(scope="module")
def pools(demo_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-pools")
    url = f"sqlite:///{root / 'registry.db'}"
    registry = Registry(url, base_model_dir=demo_world.model_dir, max_lora_rank=64)
    registry.init()
    for name in ("rotate", "reverse"):  # ranks 4 and 16
        registry.add_revision(demo_world.adapters[name], name, shared=True, status="stable")
    wide = make_adapter(demo_world.model_dir, root / "wide", r=64, target_modules=list(ATTENTION))
    registry.add_revision(wide, "wide", shared=True, status="stable")  # above every pool's rank
    registry.close()
    options = ServeSettings(
        model=demo_world.model_dir,
        data_dir=root / "data",
        registry=url,
        max_loras=2,
        max_lora_rank=32,
        dtype="float32",
        device="cpu",
    )
    fleet = [
        RayPool("low", dataclasses.replace(options, max_lora_rank=8), num_replicas=1),
        RayPool("high", options, num_replicas=1),
    ]
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    serve.start(proxy_location="Disabled")
    handles = {}
    try:
        handles = run_pools(fleet)
        router = run_router(fleet)
        yield handles, router, fleet, checked_inputs(demo_world, n=12)
    finally:
        for handle in handles.values():  # the router's goes with serve.shutdown
            handle.shutdown()
        serve.shutdown()
        _stop_handles_loop()
        ray.shutdown()


async def _ask(handle, model: str, text: str) -> dict:
    body = {"prompt": make_prompt(text), "max_tokens": 40, "temperature": 0}
    return await handle.options(multiplexed_model_id=model).completions.remote(body)


def test_each_pool_is_its_own_deployment_answering_its_adapters(pools):
    handles, _, _, good = pools
    apps = serve.status().applications
    assert set(apps) == {"low", "high", "loraplex-router"}
    for name in ("low", "high"):
        app = apps[name]
        assert set(app.deployments) == {name}
        assert app.deployments[name].status == "HEALTHY"

    async def run():
        asks = [("low", "rotate", t) for t in good["rotate"][:4]]
        asks += [("high", "reverse", t) for t in good["reverse"][:4]]
        asks += [("high", "rotate", t) for t in good["rotate"][4:6]]
        answers = await asyncio.gather(*(_ask(handles[p], m, t) for p, m, t in asks))
        return list(zip(asks, answers, strict=True))

    workers = {}
    for (pool, model, text), answer in asyncio.run(run()):
        assert answer["status"] == 200, answer
        assert answer["body"]["choices"][0]["text"].strip() == TRANSFORMS[model](text), answer
        workers.setdefault(pool, set()).add(answer["worker"])
    # one replica per pool, each its own worker
    assert len(workers["low"]) == len(workers["high"]) == 1
    assert workers["low"] != workers["high"]


def test_a_pool_refuses_an_adapter_above_its_max_rank(pools):
    handles, _, _, good = pools
    answer = asyncio.run(_ask(handles["low"], "reverse", good["reverse"][0]))
    assert answer["status"] == 503, answer
    error = answer["body"]["error"]
    assert error["code"] == "adapter_unavailable" and "(rank)" in error["message"], answer
    served = asyncio.run(_ask(handles["high"], "reverse", good["reverse"][0]))
    assert served["status"] == 200, served


async def _route(router, model: str, text: str) -> dict:
    body = {"model": model, "prompt": make_prompt(text), "max_tokens": 40, "temperature": 0}
    return await router.completions.remote(body)


def test_the_router_sends_each_adapter_to_a_pool_that_serves_its_rank(pools):
    _, router, fleet, good = pools

    async def run():
        asks = [("reverse", t) for t in good["reverse"][:4]]  # rank 16: the high pool only
        asks += [("rotate", t) for t in good["rotate"][:4]]  # rank 4: either pool
        answers = await asyncio.gather(*(_route(router, m, t) for m, t in asks))
        return list(zip(asks, answers, strict=True))

    for (model, text), answer in asyncio.run(run()):
        assert answer["status"] == 200, answer
        assert answer["body"]["choices"][0]["text"].strip() == TRANSFORMS[model](text), answer
        assert answer["pool"] in ({"high"} if model == "reverse" else {"low", "high"}), answer
    base = pool_spec(fleet[0]).base_model
    bare = asyncio.run(_route(router, base, good["copy"][0]))
    assert bare["status"] == 200 and bare["pool"] in {"low", "high"}, bare
    assert bare["body"]["choices"][0]["text"].strip() == TRANSFORMS["copy"](good["copy"][0]), bare


def test_the_router_refuses_an_adapter_no_pool_serves(pools):
    _, router, _, good = pools
    answer = asyncio.run(_route(router, "wide", good["rotate"][0]))
    assert answer["status"] == 404 and answer["pool"] is None, answer
    error = answer["body"]["error"]
    assert error["code"] == "model_not_available" and error["param"] == "model", answer
    rank = "no worker serves adapters of rank 64 on base model "
    assert error["message"].startswith(rank), answer
    assert "the base of wide@" in error["message"], answer


def test_pool_names_are_refused_when_given_twice(demo_world, tmp_path):
    options = ServeSettings(model=demo_world.model_dir, data_dir=tmp_path)
    with pytest.raises(ValueError, match="give each pool its own"):
        run_pools([RayPool("a", options), RayPool("a", options)])
