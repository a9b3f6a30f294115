"""Ray Serve with a deployment per pool, each with real replicas that are loraplex workers over
the demo world: a low-rank pool and a high-rank pool, each answering its own adapters right, the
low-rank one refusing an adapter above its rank."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from test_ray_serve import _stop_handles_loop  # noqa: E402
from world_fleet import checked_inputs  # noqa: E402

from loraplex.demo.world import TRANSFORMS, make_prompt  # noqa: E402
from loraplex.integrations.ray_serve import RayPool, run_pools  # noqa: E402
from loraplex.registry import Registry  # noqa: E402
from loraplex.settings.serve import ServeSettings  # noqa: E402


@pytest.fixture(scope="module")
def pools(demo_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-pools")
    url = f"sqlite:///{root / 'registry.db'}"
    registry = Registry(url, base_model_dir=demo_world.model_dir, max_lora_rank=32)
    registry.init()
    for name in ("rotate", "reverse"):  # ranks 4 and 16
        registry.add_revision(demo_world.adapters[name], name, shared=True, status="stable")
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
        yield handles, checked_inputs(demo_world, n=12)
    finally:
        for handle in handles.values():
            handle.shutdown()
        serve.shutdown()
        _stop_handles_loop()
        ray.shutdown()


async def _ask(handle, model: str, text: str) -> dict:
    body = {"prompt": make_prompt(text), "max_tokens": 40, "temperature": 0}
    return await handle.options(multiplexed_model_id=model).completions.remote(body)


def test_each_pool_is_its_own_deployment_answering_its_adapters(pools):
    handles, good = pools
    assert set(serve.status().applications) == {"low", "high"}
    for name, app in serve.status().applications.items():
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
    handles, good = pools
    answer = asyncio.run(_ask(handles["low"], "reverse", good["reverse"][0]))
    assert answer["status"] == 503, answer
    error = answer["body"]["error"]
    assert error["code"] == "adapter_unavailable" and "(rank)" in error["message"], answer
    served = asyncio.run(_ask(handles["high"], "reverse", good["reverse"][0]))
    assert served["status"] == 200, served


def test_pool_names_are_refused_when_given_twice(demo_world, tmp_path):
    options = ServeSettings(model=demo_world.model_dir, data_dir=tmp_path)
    with pytest.raises(ValueError, match="give each pool its own"):
        run_pools([RayPool("a", options), RayPool("a", options)])
