"""Ray Serve pools routed as `loraplex router` routes, with real replicas that are loraplex workers
over the demo world: a main pool of two replicas and a `canary` pool of one, behind the router
deployment. A split name's canary revision goes to the canary pool and its stable one to the main
pool, by the registry's weights; an adapter of a base no pool serves is refused; a replica whose
worker does not match its pool's declared base never starts; inside a pool, a shared prompt prefix
stays on one replica and a placed adapter goes to the replica it is placed on; and while every
pool is full, a tenant's burst waits its share instead of the line."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from test_ray_serve import _stop_handles_loop  # noqa: E402
from tinymodels import make_adapter, make_model  # noqa: E402
from world_fleet import checked_inputs  # noqa: E402

from loraplex.demo.world import ATTENTION, TRANSFORMS, make_prompt  # noqa: E402
from loraplex.integrations.ray_router import LoraplexPoolRouter, run_router  # noqa: E402
from loraplex.integrations.ray_serve import RayPool, pool_spec, run_pools  # noqa: E402
from loraplex.registry import Registry  # noqa: E402
from loraplex.registry.traffic import pick  # noqa: E402
from loraplex.router.routing import Refusal  # noqa: E402
from loraplex.settings.serve import ServeSettings  # noqa: E402

TOKEN = "ray-fleet-admin-token-0123456789"
SYSTEM = "You are a careful assistant of the loraplex fleet; answer in one word. "


@pytest.fixture(scope="module")
def fleet(demo_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-fleet")
    url = f"sqlite:///{root / 'registry.db'}"
    registry = Registry(url, base_model_dir=demo_world.model_dir, max_lora_rank=32)
    registry.init()
    stable = registry.add_revision(
        demo_world.adapters["rotate"], "rotate", shared=True, status="stable"
    )
    registry.add_revision(demo_world.adapters["reverse"], "reverse", shared=True, status="stable")
    canary_dir = make_adapter(demo_world.model_dir, root / "rotate-2", seed=7, r=4)
    canary = registry.add_revision(canary_dir, "rotate", shared=True)
    registry.set_traffic("rotate", {stable.revision: 50, canary.revision: 50}, force=True)
    other = make_model(root / "other-base")
    registry.add_revision(
        make_adapter(other, root / "alien", r=4, target_modules=list(ATTENTION)),
        "alien",
        shared=True,
        status="stable",
        base_model_dir=other,
    )
    keys = {}
    for tenant, priority in (("alpha", 0), ("beta", 0), ("batch", -1)):  # batch: shed first
        registry.add_tenant(tenant, priority=priority)
        keys[tenant] = f"Bearer {registry.create_key(tenant)}"
    traffic = list(registry.show("rotate").traffic)
    registry.close()
    options = ServeSettings(
        model=demo_world.model_dir,
        registry=url,
        max_loras=2,
        max_lora_rank=16,
        dtype="float32",
        device="cpu",
    )
    pools = [
        RayPool("main", dataclasses.replace(options, data_dir=root / "main"), num_replicas=2),
        RayPool(
            "canary",
            dataclasses.replace(options, data_dir=root / "canary"),
            num_replicas=1,
            role="canary",
        ),
        RayPool(  # a third base model (not alien's), for beta alone
            "beta-only",
            dataclasses.replace(
                options, model=make_model(root / "third-base", "qwen2"), data_dir=root / "b"
            ),
            num_replicas=1,
            tenants=("beta",),
        ),
    ]
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    serve.start(proxy_location="Disabled")
    handles = {}
    try:
        handles = run_pools(pools, admin_token=TOKEN)
        router = run_router(pools)
        # The canary pool alone, one request at a time: every other request waits its turn.
        fair = run_router([pools[1]], max_ongoing_requests=1, name="fair-router")
        # The same pool with two places: one may be held back.
        held = run_router([pools[1]], max_ongoing_requests=2, name="held-router")
        yield {
            "held": held,
            "handles": handles,
            "router": router,
            "fair": fair,
            "pools": pools,
            "keys": keys,
            "traffic": traffic,
            "canary": canary.revision,
            "root": root,
            "good": checked_inputs(demo_world, n=12),
        }
    finally:
        for handle in handles.values():
            handle.shutdown()
        serve.shutdown()
        _stop_handles_loop()
        ray.shutdown()


def _body(model: str | None, prompt: str, **more) -> dict:
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, **more}
    return body if model is None else {**body, "model": model}


def test_a_split_names_canary_goes_to_the_canary_pool_by_the_registrys_weights(fleet):
    router, key, text = fleet["router"], fleet["keys"]["alpha"], fleet["good"]["rotate"][0]
    users = [f"user-{i}" for i in range(16)]

    async def run():
        asks = [
            router.completions.remote(_body("rotate", make_prompt(text), user=u), key)
            for u in users
        ]
        return await asyncio.gather(*asks)

    revisions = set()
    for user, answer in zip(users, asyncio.run(run()), strict=True):
        assert answer["status"] == 200, answer
        revision = pick("rotate", fleet["traffic"], user)  # sticky by user, as the workers pick
        revisions.add(revision)
        assert answer["body"]["model"] == f"rotate@{revision}", answer
        if revision == fleet["canary"]:
            assert answer["pool"] == "canary", answer
        else:  # the stable revision, on the main pool, answering right
            assert answer["pool"] == "main", answer
            assert answer["body"]["choices"][0]["text"].strip() == TRANSFORMS["rotate"](text)
    assert len(revisions) == 2  # both sides of the split served


def test_an_adapter_of_a_base_no_pool_serves_is_refused_by_the_router(fleet):
    router, key = fleet["router"], fleet["keys"]["alpha"]

    async def run():
        return await router.completions.remote(_body("alien", make_prompt("abc")), key)

    answer = asyncio.run(run())
    assert answer["status"] == 404 and answer["pool"] is None, answer
    error = answer["body"]["error"]
    assert (error["code"], error["param"]) == ("model_not_available", "model"), answer
    assert error["type"] == "invalid_request_error", answer
    assert error["message"].startswith("no worker serves base model "), answer
    assert "(the base of alien@" in error["message"], answer


def test_a_replica_that_does_not_match_its_pool_never_starts(fleet):
    pool = fleet["pools"][1]
    wrong = dataclasses.replace(
        pool, name="wrong", role=None, num_replicas=1, base_model_digest="sha256:" + "0" * 64
    )
    try:
        with pytest.raises(Exception, match="its worker serves base model digest sha256:"):
            run_pools([wrong], admin_token=TOKEN)
    finally:
        serve.delete("wrong")


def _workers(fleet, pool: str) -> list[str]:
    files = sorted((fleet["root"] / pool).glob("replica-*/worker.json"))
    return [json.loads(f.read_text())["url"] for f in files]


def test_a_shared_prompt_prefix_stays_on_one_replica(fleet):
    main, key = fleet["handles"]["main"], fleet["keys"]["beta"]
    base = fleet["pools"][0].options.model.resolve().name

    async def run():
        answers = []
        for i in range(8):  # one at a time: load never decides
            body = _body(base, f"{SYSTEM}question {i}?", max_tokens=4)
            answers.append(await main.completions.remote(body, key))
        return answers

    answers = asyncio.run(run())
    assert all(a["status"] == 200 for a in answers), answers
    # At random, 8 picks over 2 replicas land on one with odds of 1 in 128.
    assert len({a["worker"] for a in answers}) == 1, [a["worker"] for a in answers]


def test_a_placed_adapter_goes_to_the_replica_it_is_placed_on(fleet):
    main, key, text = fleet["handles"]["main"], fleet["keys"]["beta"], fleet["good"]["reverse"][0]
    ask = main.options(multiplexed_model_id="reverse").completions

    async def run(n: int) -> list[dict]:
        return [await ask.remote(_body(None, make_prompt(text)), key) for _ in range(n)]

    first = asyncio.run(run(1))[0]
    assert first["status"] == 200, first
    (other,) = [url for url in _workers(fleet, "main") if url != first["worker"]]
    admin = {"Authorization": f"Bearer {TOKEN}"}
    placed = httpx.post(f"{other}/admin/placement/reverse", headers=admin, timeout=60)
    assert placed.status_code == 200, placed.text
    try:
        time.sleep(1.0)  # the pool's router polls every 0.25 s: it reads the placement
        answers = asyncio.run(run(4))
    finally:
        httpx.delete(f"{other}/admin/placement/reverse", headers=admin, timeout=60)
    for answer in answers:  # the adapter is in a slot on the first replica: placement wins
        assert answer["status"] == 200 and answer["worker"] == other, answer
        assert answer["body"]["choices"][0]["text"].strip() == TRANSFORMS["reverse"](text)


def test_a_tenants_burst_waits_its_share_when_the_pool_is_full(fleet):
    fair, keys, good = fleet["fair"], fleet["keys"], fleet["good"]["reverse"]
    order: list[str] = []

    async def ask(tenant: str, text: str) -> dict:
        answer = await fair.completions.remote(_body("reverse", make_prompt(text)), keys[tenant])
        order.append(tenant)
        return answer

    async def run():
        burst = [asyncio.ensure_future(ask("alpha", good[i % len(good)])) for i in range(24)]
        await asyncio.sleep(0.2)  # alpha's burst reaches the router first
        order.append("beta-sent")
        steady = [asyncio.ensure_future(ask("beta", good[i])) for i in range(2)]
        return await asyncio.gather(*burst, *steady)

    answers = asyncio.run(run())
    assert all(a["status"] == 200 and a["pool"] == "canary" for a in answers), answers
    after = order[order.index("beta-sent") + 1 :]
    last_beta = len(after) - 1 - after[::-1].index("beta")
    # First come first would serve beta after the whole burst (about 20 of alpha's first); fair
    # share takes beta's two in turn with alpha's: the ones running, one between them, and the
    # answers' own order through Ray's handles, which finish close together, on a busy machine.
    assert after[:last_beta].count("alpha") <= 6, order
    assert after[last_beta:].count("alpha") >= 8, order  # the burst was still waiting


@pytest.mark.parametrize("window_s", [5.0, 0.0])
def test_the_router_deployment_holds_a_place_back_for_a_tenant_owed_it(fleet, window_s):
    """A router deployment over the canary pool with two places (the class itself, on the
    running fleet's pools and registry): beta sent within the window, so alpha, at its share of
    one place, leaves the other free for beta (`loraplex.router.holdback`); with no window alpha
    takes it."""
    spec = pool_spec(fleet["pools"][1])
    registry_url = str(fleet["pools"][1].options.registry_url)
    router = LoraplexPoolRouter([spec], {spec.name: 2}, registry_url, holdback_window_s=window_s)
    beta = router.chooser.wanted("reverse", fleet["keys"]["beta"])
    alpha = router.chooser.wanted("reverse", fleet["keys"]["alpha"])

    async def turns() -> tuple[str | Refusal, str | Refusal, bool]:
        first = await router._turn(beta)
        router.chooser.in_flight[spec.name] -= 1  # beta's request ended
        router.holdback.closed(beta.tenant, spec.name)
        second = await router._turn(alpha)
        return first, second, router._holds_back(alpha.tenant, [spec.name])

    assert beta.tenant == "beta" and alpha.tenant == "alpha"
    assert asyncio.run(turns()) == ("canary", "canary", window_s > 0)


def test_held_back_places_through_the_router_deployment_answer_every_request(fleet):
    """alpha bursts into the canary pool's two places while beta sends: every answer right."""
    held, keys, good = fleet["held"], fleet["keys"], fleet["good"]["reverse"]

    async def ask(tenant: str, i: int) -> dict:
        answer = await held.completions.remote(_body("reverse", make_prompt(good[i])), keys[tenant])
        return {**answer, "i": i}

    async def run():
        first = await ask("beta", 0)
        burst = [asyncio.ensure_future(ask("alpha", i % len(good))) for i in range(6)]
        await asyncio.sleep(0.2)
        return [first, await ask("beta", 1), *await asyncio.gather(*burst)]

    answers = asyncio.run(run())
    assert all(a["status"] == 200 and a["pool"] == "canary" for a in answers), answers
    texts = [a["body"]["choices"][0]["text"].strip() for a in answers]
    assert texts == [TRANSFORMS["reverse"](good[a["i"]]) for a in answers], texts


def test_the_model_list_through_the_router_is_every_pool_open_to_the_caller(fleet):
    router, keys, pools = fleet["router"], fleet["keys"], fleet["pools"]
    base, third = (pools[i].options.model.resolve().name for i in (0, 2))

    async def run():
        callers = (keys["alpha"], keys["beta"], "Bearer not-a-key")
        return await asyncio.gather(*(router.models.remote(key) for key in callers))

    alpha, beta, unknown = asyncio.run(run())
    assert alpha["status"] == beta["status"] == 200, (alpha, beta)
    alphas = [m["id"] for m in alpha["body"]["data"]]
    betas = [m["id"] for m in beta["body"]["data"]]
    # main's and canary's lists, the same base and adapters, once each; alien's base runs nowhere
    assert len(alphas) == len(set(alphas)) and set(alphas) == {base, "rotate", "reverse"}, alpha
    # beta's own pool adds its base model
    assert len(betas) == len(set(betas)) and set(betas) == {base, third, "rotate", "reverse"}
    assert alpha["body"]["object"] == "list", alpha
    assert unknown["status"] == 401, unknown  # the workers' own refusal of the key
    assert unknown["body"]["error"]["type"] == "authentication_error", unknown


def test_a_tenant_below_the_shedding_band_is_refused_while_the_pool_is_full(fleet):
    fair, keys, good = fleet["fair"], fleet["keys"], fleet["good"]["reverse"]

    def ask(tenant: str, i: int, **more):
        body = _body("reverse", make_prompt(good[i]), **more)
        return fair.completions.remote(body, keys[tenant])

    async def run():
        # long answers (about 1.5 s in all): alpha's fill the pool (room 1) and wait their turn
        long = {"max_tokens": 100, "ignore_eos": True}
        busy = [asyncio.ensure_future(ask("alpha", i % len(good), **long)) for i in range(24)]
        await asyncio.sleep(0.1)
        shed = await ask("batch", 0)
        return shed, await asyncio.gather(*busy)

    shed, busy = asyncio.run(run())
    assert all(a["status"] == 200 for a in busy), busy
    # the HTTP router's answer to a shed request: status, code, type and message
    assert (shed["status"], shed["pool"]) == (429, None), shed
    assert shed["body"] == {
        "error": {
            "message": "no worker can take the request now (saturated-shed)",
            "type": "server_error",
            "code": "saturated",
            "param": None,
        }
    }, shed

    async def alone_() -> dict:
        return await ask("batch", 1)

    alone = asyncio.run(alone_())  # the pool has room: served
    assert alone["status"] == 200, alone
    assert alone["body"]["choices"][0]["text"].strip() == TRANSFORMS["reverse"](good[1])


def test_the_router_prefers_the_pool_an_adapter_is_placed_in(fleet):
    router, key, text = fleet["router"], fleet["keys"]["alpha"], fleet["good"]["reverse"][1]

    async def routed(via) -> dict:
        return await via.completions.remote(_body("reverse", make_prompt(text)), key)

    def ask() -> dict:
        return asyncio.run(routed(router))

    assert ask()["pool"] == "main"  # nothing placed: the pool without a role first
    canary = asyncio.run(routed(fleet["fair"]))["worker"]  # the canary pool's one replica
    admin = {"Authorization": f"Bearer {TOKEN}"}
    placed = httpx.post(f"{canary}/admin/placement/reverse", headers=admin, timeout=60)
    assert placed.status_code == 200, placed.text
    try:
        time.sleep(1.5)  # the router's last answer from each pool stands 1 s
        answers = [ask() for _ in range(3)]
    finally:
        httpx.delete(f"{canary}/admin/placement/reverse", headers=admin, timeout=60)
    for answer in answers:
        assert (answer["status"], answer["pool"], answer["worker"]) == (200, "canary", canary)
        assert answer["body"]["choices"][0]["text"].strip() == TRANSFORMS["reverse"](text)
