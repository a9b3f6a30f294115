"""The router's fair-share queue over real sockets: a request whose workers are all saturated
waits at the router and goes on when a poll shows room; a tenant's full queue is a 429, and so is
the request of a tenant below the shedding band, at once; a burst held at the router lets another
tenant's requests go ahead of it. The worker is a small stand-in at the HTTP boundary that reports
its queue (and its running capacity) as `loraplex serve` does."""

import asyncio
import threading

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from test_router_pools import KEYS, TOKEN, complete, serving, stand_in, state_of, wait_for

from loraplex.router.app import RouterConfig, create_router_app
from loraplex.router.picker import PickerConfig


def waiting_gauge(url: str, tenant: str) -> str | None:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(f'loraplex_router_tenant_waiting{{tenant="{tenant}"}}'):
            return line.split()[-1]
    return None


def test_a_saturated_fleet_holds_requests_at_the_router_until_a_poll_shows_room():
    state = state_of("base-a", waiting=9)  # above the saturation threshold of 5
    with serving(stand_in(state)) as one:
        config = RouterConfig(
            workers=(one,),
            admin_token=TOKEN,
            poll_interval_s=0.05,
            caller_of=lambda key: {**KEYS, "batch-key": ("batch", -1)}.get(key, (None, 0)),
            queue_per_tenant=1,
        )
        with serving(create_router_app(config)) as url:
            shed = complete(url, "sql", "batch-key")  # below the shedding band: no queue place
            assert (shed.status_code, shed.headers["retry-after"]) == (429, "1")
            assert shed.json() == {  # the Ray router deployment answers the same body
                "error": {
                    "message": "no worker can take the request now (saturated-shed)",
                    "type": "server_error",
                    "code": "saturated",
                    "param": None,
                }
            }
            answers: list[httpx.Response] = []
            waiting = threading.Thread(
                target=lambda: answers.append(complete(url, "sql", "acme-key"))
            )
            waiting.start()
            wait_for(lambda: waiting_gauge(url, "acme") == "1.0", "the request to wait")
            full = complete(url, "sql", "acme-key")
            assert full.status_code == 429 and full.json()["error"]["code"] == "saturated"
            assert "1 requests of tenant acme are waiting" in full.json()["error"]["message"]
            other = threading.Thread(
                target=lambda: answers.append(complete(url, "sql", "beta-key"))
            )
            other.start()  # another tenant's queue has room of its own
            wait_for(lambda: waiting_gauge(url, "beta") == "1.0", "beta's request to wait")
            assert answers == []
            state["load"]["waiting"] = 0
            waiting.join()
            other.join()
            assert sorted(r.status_code for r in answers) == [200, 200]
            assert waiting_gauge(url, "acme") == "0.0"
            metrics = httpx.get(f"{url}/metrics").text
            assert 'loraplex_router_tenant_granted_total{tenant="acme"} 1.0' in metrics


def held_worker(max_num_seqs: int) -> tuple[Starlette, list[str], dict[str, int]]:
    """A stand-in that reports running capacity `max_num_seqs` and an idle queue, records each
    completion's model as it arrives, and answers them only as the test allows (`gate`)."""
    arrived: list[str] = []
    gate = {"allowed": 0, "answered": 0}
    state = state_of("base-a")
    state["load"]["max_num_seqs"] = max_num_seqs

    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def admin_state(request: Request):
        return JSONResponse(state)

    async def completions(request: Request):
        arrived.append((await request.json())["model"])
        while gate["answered"] >= gate["allowed"]:
            await asyncio.sleep(0.01)
        gate["answered"] += 1
        return JSONResponse({"choices": [{"text": "ok"}]})

    routes = [
        Route("/health", health),
        Route("/admin/state", admin_state),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    return Starlette(routes=routes), arrived, gate


def burst_then_steady(worker_queue_limit: int) -> tuple[list[str], list[int], str]:
    """acme sends 6 requests at once to a worker that runs 2, then beta sends 2; the worker
    answers one at a time. (the models in the order they reached the worker, the statuses, the
    router's metrics)."""
    app, arrived, gate = held_worker(max_num_seqs=2)
    with serving(app) as worker:
        config = RouterConfig(
            workers=(worker,),
            admin_token=TOKEN,
            poll_interval_s=30,
            stale_after_s=300,
            caller_of=lambda key: KEYS.get(key, (None, 0)),
            # the saturation threshold above the burst: only the limit holds requests back
            picker=PickerConfig(saturation_waiting=8, worker_queue_limit=worker_queue_limit),
            holdback_window_s=0,  # the queue's order alone (`test_router_holdback.py`: with it)
        )
        with serving(create_router_app(config)) as url:
            statuses: list[int] = []

            def send(model: str, key: str) -> threading.Thread:
                client = threading.Thread(
                    target=lambda: statuses.append(complete(url, model, key).status_code)
                )
                client.start()
                return client

            clients = [send("sql", "acme-key") for _ in range(6)]
            held = 6 if worker_queue_limit < 0 else 2
            wait_for(lambda: len(arrived) == held, "acme's burst to reach the worker")
            wait_for(lambda: waiting_gauge(url, "acme") in (None, f"{6.0 - held}"), "the rest")
            clients += [send("chat", "beta-key") for _ in range(2)]
            if worker_queue_limit < 0:
                wait_for(lambda: len(arrived) == 8, "beta's requests to reach the worker")
            else:
                wait_for(lambda: waiting_gauge(url, "beta") == "2.0", "beta's requests to wait")
            for answered in range(1, 9):
                gate["allowed"] = answered
                reached = min(8, held + answered)
                wait_for(lambda n=reached: len(arrived) >= n, "the next request")
            for client in clients:
                client.join()
            return arrived, statuses, httpx.get(f"{url}/metrics").text


def test_a_burst_waits_at_the_router_and_another_tenant_goes_ahead_of_it():
    """With a worker's queue limited to its running capacity, acme's burst waits at the router,
    and as places free, beta's requests take every other one, ahead of acme's that wait: a
    first-come worker queue would have run all six of acme's first."""
    arrived, statuses, metrics = burst_then_steady(worker_queue_limit=0)
    assert statuses == [200] * 8
    assert arrived == ["sql", "sql"] + ["sql", "chat", "sql", "chat", "sql", "sql"]
    assert 'loraplex_router_tenant_granted_total{tenant="acme"} 4.0' in metrics
    assert 'loraplex_router_tenant_granted_total{tenant="beta"} 2.0' in metrics


def test_without_the_limit_a_burst_fills_the_worker_queue_ahead_of_another_tenant():
    arrived, statuses, metrics = burst_then_steady(worker_queue_limit=-1)
    assert statuses == [200] * 8
    assert arrived == ["sql"] * 6 + ["chat"] * 2
    assert 'granted_total{tenant="beta"}' not in metrics  # nothing waited at the router
