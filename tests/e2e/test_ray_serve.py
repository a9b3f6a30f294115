"""Ray Serve with two real replicas, each a loraplex worker over the demo world: affinity until
saturated, a replica killed mid-run, every answer checked against its adapter's transform."""

from __future__ import annotations

import asyncio
import collections
import json
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402
from ray.serve._private.router import SingletonThreadRouter  # noqa: E402
from world_fleet import checked_inputs  # noqa: E402

from loraplex.demo.world import TRANSFORMS, make_prompt  # noqa: E402
from loraplex.integrations.ray_serve import deployment  # noqa: E402
from loraplex.registry import Registry  # noqa: E402
from loraplex.router.fleet import Worker  # noqa: E402
from loraplex.router.picker import Picker  # noqa: E402
from loraplex.settings.serve import ServeSettings  # noqa: E402

ADAPTERS = ("reverse", "rot13", "rotate")
TOKEN = "ray-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def fleet(demo_world, tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    url = f"sqlite:///{root / 'registry.db'}"
    registry = Registry(url, base_model_dir=demo_world.model_dir, max_lora_rank=32)
    registry.init()
    for name, path in sorted(demo_world.adapters.items()):
        registry.add_revision(path, name, shared=True, status="stable")
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
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False)
    serve.start(proxy_location="Disabled")
    handle = None
    try:
        handle = serve.run(
            deployment(options, num_replicas=2, admin_token=TOKEN),
            name="loraplex",
            route_prefix=None,
        )
        yield handle, checked_inputs(demo_world, n=30), root / "data"
    finally:
        if handle is not None:
            # its router's thread (shared by every `options()` of it) would otherwise call into Ray
            # after `ray.shutdown()`, and Ray ends the process that does
            handle.shutdown()
        serve.shutdown()
        _stop_handles_loop()
        ray.shutdown()


def _stop_handles_loop() -> None:
    """Ray's handles share one event loop in a thread of their own. Its tasks (the queue-length
    probes, our router's poller) outlive `handle.shutdown()`, and one that calls into Ray after
    `ray.shutdown()` ends the process: they are cancelled, and the loop stopped, first."""
    loop = SingletonThreadRouter._asyncio_loop
    if loop is None or not loop.is_running():
        return

    async def cancel_all() -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    # the next Ray session's handles (another test module's) start a loop of their own
    SingletonThreadRouter._asyncio_loop = None


async def _ask(handle, model: str, text: str) -> dict:
    body = {"prompt": make_prompt(text), "max_tokens": 40, "temperature": 0}
    answer = await handle.options(multiplexed_model_id=model).completions.remote(body)
    assert answer["status"] == 200, answer
    assert answer["body"]["choices"][0]["text"].strip() == TRANSFORMS[model](text), (
        model,
        text,
        answer,
    )
    return answer


def test_a_warm_adapter_stays_on_its_holder_until_it_saturates_then_spreads(fleet):
    handle, good, _ = fleet

    async def run():
        first = await _ask(handle, "reverse", good["reverse"][0])
        sequential = [await _ask(handle, "reverse", t) for t in good["reverse"][1:8]]
        burst = await asyncio.gather(*(_ask(handle, "reverse", t) for t in good["reverse"][:24]))
        return first, sequential, burst

    first, sequential, burst = asyncio.run(run())
    holder = first["replica"]
    # One at a time the holder never saturates: every request stays with the adapter, warm in
    # its slot.
    assert {a["replica"] for a in sequential} == {holder}
    assert [a["tier"] for a in sequential] == ["gpu"] * len(sequential)
    # 24 at once: the holder takes its share until it is loaded, then the other replica takes
    # the rest.
    counts = collections.Counter(a["replica"] for a in burst)
    assert len(counts) == 2 and counts[holder] >= 3, counts


def test_a_replica_killed_mid_run_costs_at_most_its_requests_in_flight(fleet):
    handle, good, data_dir = fleet

    async def run():
        warm = [await _ask(handle, name, good[name][0]) for name in ADAPTERS]
        victim = warm[0]
        # the adapters in turn (the last requests routed, when the victim's count is read, are of
        # every adapter, its own among them), three rounds: enough in flight that the victim is
        # seen holding some before they end
        rows = zip(*(good[name] for name in ADAPTERS))
        texts = [(name, t) for row in rows for name, t in zip(ADAPTERS, row)] * 3
        for _ in range(3):  # a run whose victim finished before the last request reached a worker
            tasks = [asyncio.ensure_future(_ask(handle, n, t)) for n, t in texts]
            in_flight = await _in_flight_on(victim, tasks, data_dir)
            if in_flight:
                break
            await asyncio.gather(*tasks)  # every one answered right, nothing killed: again
        else:
            raise AssertionError("three runs ended before the victim held any request")
        _kill(victim["replica"])
        results = await asyncio.gather(*tasks, return_exceptions=True)
        after = [await _ask(handle, name, good[name][1]) for name in ADAPTERS for _ in range(2)]
        return victim, in_flight, results, after

    victim, in_flight, results, after = asyncio.run(run())
    failed = [r for r in results if isinstance(r, BaseException)]
    # never a wrong answer
    assert all(isinstance(r, ray.exceptions.RayError) for r in failed), failed
    assert len(failed) <= in_flight
    # The survivors serve every adapter, those of the dead replica too, from memory (a slot, or
    # host memory where the cache policy keeps the slots for hotter adapters) from their second
    # request on.
    assert victim["replica"] not in {a["replica"] for a in after}
    by_adapter = collections.defaultdict(list)
    for name, a in zip([n for n in ADAPTERS for _ in range(2)], after):
        by_adapter[name].append(a["tier"])
    assert all(tiers[-1] in ("gpu", "cpu") for tiers in by_adapter.values()), by_adapter


async def _in_flight_on(victim: dict, tasks: list, data_dir) -> int:
    """The victim's requests in flight, read from its worker once every request not yet answered has
    reached a worker (none is still being routed): from then on that count can only fall until
    the kill. 0 if the requests end first without the victim seen holding any then."""
    workers = [json.loads(p.read_text()) for p in data_dir.glob("replica-*/worker.json")]
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            done = sum(t.done() for t in tasks)
            counts = {}
            for w in workers:
                try:
                    state = await http.get(f"{w['url']}/admin/state", headers=ADMIN)
                except httpx.TransportError:  # a replica that died earlier: it holds nothing
                    continue
                counts[w["url"]] = state.json()["load"]["in_flight"]
            mine = counts.get(victim["worker"], 0)
            if mine and done + sum(counts.values()) >= len(tasks):
                return mine
            if done == len(tasks):
                return 0
            await asyncio.sleep(0.01)


def _kill(replica: str) -> None:
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith(replica) and "SERVE_REPLICA" in actor["name"]:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            return
    raise AssertionError(f"no actor for replica {replica}")


def test_the_router_ranks_a_replica_holding_the_adapter_in_host_memory_first(fleet):
    """Ray's multiplexed routing knows only which replicas were asked for a model; loraplex's view
    has each worker's tiers: a replica with the adapter in host memory ranks before one with a
    free slot."""
    _, _, data_dir = fleet
    urls = [
        json.loads(p.read_text())["url"] for p in sorted(data_dir.glob("replica-*/worker.json"))
    ]
    states = {}
    for url in urls:
        try:
            states[url] = httpx.get(f"{url}/admin/state", headers=ADMIN, timeout=10)
        except httpx.TransportError:  # the replica killed by another test
            continue
    live = [u for u, r in states.items() if r.status_code == 200][:2]
    holder = live[-1]
    httpx.post(
        f"{holder}/admin/adapters/double-letters/prewarm",
        json={"tier": "cpu"},
        headers=ADMIN,
        timeout=10,
    ).raise_for_status()
    workers = []
    for url in live:
        worker = Worker(url)
        held = url == holder
        worker.apply_state(
            _wait_state(url, lambda s, held=held: not held or _tier(s, "double-letters") == "cpu")
        )
        workers.append(worker.last)
    assert Picker().pick(workers, "double-letters").ranking[0] == holder
    assert Picker().pick(workers, "double-letters@r1").ranking[0] == holder


def _tier(state: dict, name: str) -> str | None:
    return next((a["tier"] for a in state["adapters"] if a["name"] == name), None)


def _wait_state(url: str, predicate) -> dict:
    for _ in range(600):  # a bound against hangs
        state = httpx.get(f"{url}/admin/state", headers=ADMIN, timeout=10).json()
        if predicate(state):
            return state
        time.sleep(0.05)
    raise AssertionError(f"{url} never reached the state")
