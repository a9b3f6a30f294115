"""Held-back places over real sockets: while acme, over its share, fills the fleet and beta has a
request open or sent one within the window, the router keeps a place free and beta's next request
starts at once; once beta is quiet past the window acme gets the whole fleet again; acme alone is
never held back. The workers are stand-ins at the HTTP boundary that report their running
capacity as `loraplex serve` does and answer each model's requests only as the test allows."""

import asyncio
import contextlib
import threading

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from test_router_fair_share import waiting_gauge
from test_router_pools import KEYS, TOKEN, complete, serving, state_of, wait_for

from loraplex.router.app import RouterConfig, create_router_app
from loraplex.router.picker import PickerConfig
from loraplex.router.pools import PoolSpec

KEY = {"sql": "acme-key", "chat": "beta-key"}


def gated_worker(arrived: list[str], gate: dict[str, int], base: str = "base-a") -> Starlette:
    """Runs 2 at once (its reported `max_num_seqs`); records each completion's model as it
    arrives and answers a model's requests only while `gate[model]` allows more."""
    state = state_of(base)
    state["load"]["max_num_seqs"] = 2
    answered = {model: 0 for model in gate}

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def admin_state(request: Request):
        return JSONResponse(state)

    async def completions(request: Request):
        model = (await request.json())["model"]
        arrived.append(model)
        while answered[model] >= gate[model]:
            await asyncio.sleep(0.01)
        answered[model] += 1
        return JSONResponse({"choices": [{"text": "ok"}]})

    routes = [
        Route("/health", health),
        Route("/admin/state", admin_state),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes)


class Fleet:
    """Two gated workers (4 places) behind a router with the given window."""

    def __init__(self, window_s: float):
        self.arrived: list[str] = []
        self.gate = {"sql": 0, "chat": 0}
        self.statuses: list[int] = []
        self.clients: list[threading.Thread] = []
        self.window_s = window_s

    @contextlib.contextmanager
    def running(self):
        with contextlib.ExitStack() as stack:
            urls = [stack.enter_context(serving(gated_worker(self.arrived, self.gate)))]
            urls.append(stack.enter_context(serving(gated_worker(self.arrived, self.gate))))
            config = RouterConfig(
                workers=tuple(urls),
                admin_token=TOKEN,
                poll_interval_s=0.1,
                caller_of=lambda key: KEYS.get(key, (None, 0)),
                picker=PickerConfig(saturation_waiting=8),  # the places alone saturate
                holdback_window_s=self.window_s,
            )
            self.url = stack.enter_context(serving(create_router_app(config)))
            try:
                yield self
            finally:
                self.gate.update(sql=100, chat=100)
                for client in self.clients:
                    client.join()

    def send(self, model: str, count: int = 1) -> None:
        for _ in range(count):
            client = threading.Thread(
                target=lambda: self.statuses.append(
                    complete(self.url, model, KEY[model]).status_code
                )
            )
            client.start()
            self.clients.append(client)

    def metric(self, name: str, tenant: str) -> str | None:
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(f'{name}{{tenant="{tenant}"}}'):
                return line.split()[-1]
        return None


def acme_bursts_while_beta_has_one_open(fleet: Fleet) -> None:
    """beta's request runs; acme sends 6: it takes its share of 2 of the 4 places and leaves one
    free for beta (beta is under its share of 2), the other 4 wait."""
    fleet.send("chat")
    wait_for(lambda: fleet.arrived == ["chat"], "beta's request to reach a worker")
    fleet.send("sql", 6)
    wait_for(lambda: waiting_gauge(fleet.url, "acme") == "4.0", "acme's burst to wait")
    wait_for(lambda: len(fleet.arrived) >= 3, "acme's share to reach the workers")
    assert fleet.arrived == ["chat", "sql", "sql"]
    assert fleet.metric("loraplex_router_tenant_held_back_total", "acme") == "1.0"


def test_a_place_is_kept_free_and_the_other_tenant_s_next_request_starts_at_once():
    with Fleet(window_s=600).running() as fleet:
        acme_bursts_while_beta_has_one_open(fleet)
        fleet.send("chat")  # no request has finished: it takes the place kept free
        wait_for(lambda: len(fleet.arrived) == 4, "beta's second request to reach a worker")
        assert fleet.arrived == ["chat", "sql", "sql", "chat"]
        assert waiting_gauge(fleet.url, "acme") == "4.0"
        assert fleet.metric("loraplex_router_tenant_held_back_total", "beta") is None
        fleet.gate.update(sql=6, chat=2)
        for client in fleet.clients:
            client.join()
        assert fleet.statuses == [200] * 8


def test_a_tenant_that_lately_ran_two_at_once_finds_two_places_kept():
    """beta ran two requests at once within the window: acme, over its share of 2 of the 4
    places, leaves both free, so beta's next two start at once, not only the first."""
    with Fleet(window_s=600).running() as fleet:
        fleet.send("chat", 2)
        wait_for(lambda: fleet.arrived.count("chat") == 2, "beta's two requests to run")
        fleet.gate["chat"] = 2
        wait_for(lambda: len(fleet.statuses) == 2, "beta's two requests to finish")
        fleet.send("sql", 6)
        wait_for(lambda: waiting_gauge(fleet.url, "acme") == "4.0", "acme's burst to wait")
        wait_for(lambda: fleet.arrived.count("sql") == 2, "acme's share to reach the workers")
        fleet.send("chat", 2)
        wait_for(lambda: fleet.arrived.count("chat") == 4, "beta's next two to reach a worker")
        assert fleet.arrived.count("sql") == 2 and waiting_gauge(fleet.url, "acme") == "4.0"
        assert fleet.metric("loraplex_router_tenant_held_back_total", "beta") is None
        fleet.gate.update(sql=6, chat=4)
        for client in fleet.clients:
            client.join()
        assert fleet.statuses == [200] * 10


def test_once_the_other_tenant_is_quiet_past_the_window_the_burst_gets_every_place():
    with Fleet(window_s=0.5).running() as fleet:
        acme_bursts_while_beta_has_one_open(fleet)
        fleet.gate["chat"] = 1  # beta's request finishes and beta sends no more
        wait_for(lambda: fleet.arrived.count("sql") == 4, "acme to take every place")
        assert fleet.arrived.count("chat") == 1
        assert waiting_gauge(fleet.url, "acme") == "2.0"


def test_a_tenant_alone_on_an_idle_fleet_is_never_held_back():
    with Fleet(window_s=600).running() as fleet:
        fleet.send("sql", 6)
        wait_for(lambda: waiting_gauge(fleet.url, "acme") == "2.0", "the rest of the burst")
        wait_for(lambda: len(fleet.arrived) == 4, "the fleet's places to fill")
        assert fleet.arrived == ["sql"] * 4
        assert fleet.metric("loraplex_router_tenant_held_back_total", "acme") is None


@contextlib.contextmanager
def two_pools(arrived: list[str], gate: dict[str, int], weights=()):
    """Pool a (base-a) and pool b (base-b), one gated worker of 2 places each, behind a router;
    at the end every request is let through."""
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(serving(gated_worker(arrived, gate, "base-a")))
        b = stack.enter_context(serving(gated_worker(arrived, gate, "base-b")))
        pools = (
            PoolSpec("pool-a", base_model="base-a", workers=(a,)),
            PoolSpec("pool-b", base_model="base-b", workers=(b,)),
        )
        config = RouterConfig(
            workers=(),
            admin_token=TOKEN,
            pools=pools,
            poll_interval_s=0.1,
            caller_of=lambda key: KEYS.get(key, (None, 0)),
            picker=PickerConfig(saturation_waiting=8),
            tenant_weights=weights,
            holdback_window_s=600,
        )
        try:
            yield stack.enter_context(serving(create_router_app(config)))
        finally:
            gate.update({"base-a": 100, "base-b": 100})


def sent(url: str, model: str, key: str, statuses: list[int]) -> threading.Thread:
    client = threading.Thread(target=lambda: statuses.append(complete(url, model, key).status_code))
    client.start()
    return client


def held_back_lines(url: str) -> list[str]:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return [line for line in lines if line.startswith("loraplex_router_tenant_held_back_total{")]


def test_a_tenant_active_on_one_pool_holds_no_place_on_another():
    """beta's request went to pool b; acme then fills pool a's 2 places: beta, active on pool b
    only, is owed nothing on pool a, so acme's second request is not held back there."""
    arrived: list[str] = []
    gate, statuses = {"base-a": 0, "base-b": 1}, []
    with two_pools(arrived, gate) as url:
        sent(url, "base-b", "beta-key", statuses).join()
        clients = [sent(url, "base-a", "acme-key", statuses) for _ in range(2)]
        wait_for(lambda: arrived.count("base-a") == 2, "acme's requests to reach pool a")
        assert arrived == ["base-b", "base-a", "base-a"]
        assert held_back_lines(url) == [] and waiting_gauge(url, "acme") in (None, "0.0")
        gate["base-a"] = 2
        for client in clients:
            client.join()
    assert statuses == [200] * 3


def test_a_tenant_busy_on_one_pool_is_not_held_back_on_another():
    """acme (weight 3: a share of 1.5 of pool b's 2 places beside beta) has 2 open on pool a and
    1 on pool b: under its share of pool b, its second request there starts at once, though beta,
    active there, holds none; its requests on pool a do not count there."""
    arrived: list[str] = []
    gate, statuses = {"base-a": 0, "base-b": 1}, []
    with two_pools(arrived, gate, weights=(("acme", 3.0),)) as url:
        sent(url, "base-b", "beta-key", statuses).join()
        clients = [sent(url, "base-a", "acme-key", statuses) for _ in range(2)]
        wait_for(lambda: arrived.count("base-a") == 2, "acme's requests to reach pool a")
        clients += [sent(url, "base-b", "acme-key", statuses) for _ in range(2)]
        wait_for(lambda: arrived.count("base-b") == 3, "acme's requests to reach pool b")
        assert held_back_lines(url) == [] and waiting_gauge(url, "acme") in (None, "0.0")
        gate.update({"base-a": 2, "base-b": 3})
        for client in clients:
            client.join()
    assert statuses == [200] * 5
