"""The router against workers that misbehave, over real sockets. The workers are small stand-ins at
the HTTP boundary (a worker shutting down, one that answers its state in an unexpected shape, one
that is slow to answer)."""

import asyncio
import sys
import time
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from loraplex.router.app import RouterConfig, create_router_app

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from harness import serving  # noqa: E402 (the tests' uvicorn-in-a-thread runner)

TOKEN = "admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def worker(
    state: dict, answer_after_s: float = 0.0, calls: list | None = None, answer=None
) -> Starlette:
    """`answer`: the completions endpoint, in place of the default one."""

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def admin_state(request):
        return JSONResponse(state)

    async def completions(request):
        await request.body()
        if calls is not None:
            calls.append(time.monotonic())
        await asyncio.sleep(answer_after_s)
        return JSONResponse({"choices": [{"text": "ok"}]})

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/admin/state", admin_state),
            Route("/v1/completions", answer or completions, methods=["POST"]),
        ]
    )


RESIDENT = {
    "adapters": [{"name": "sql", "revision": "r1", "tier": "gpu", "loading": False}],
    "load": {"waiting": 0, "running": 0, "free_slots": 1},
}


def workers_seen(url: str) -> dict[str, bool]:
    listed = httpx.get(f"{url}/admin/workers", headers=ADMIN).json()["workers"]
    return {w["url"]: w["healthy"] for w in listed}


def test_a_worker_shutting_down_gets_no_traffic():
    draining = {**RESIDENT, "draining": True}  # /health still 200 while it finishes what it has
    with (
        serving(worker(draining)) as leaving,
        serving(worker({"adapters": [], "load": {"free_slots": 2}})) as other,
    ):
        with serving(
            create_router_app(RouterConfig(workers=(leaving, other), admin_token=TOKEN))
        ) as url:
            assert workers_seen(url) == {leaving: False, other: True}
            routed = [
                httpx.post(f"{url}/v1/completions", json={"model": "sql", "prompt": "x"})
                for _ in range(5)
            ]
            assert {(r.status_code, r.headers["x-loraplex-worker"]) for r in routed} == {
                (200, other)
            }


def test_a_bad_answer_from_one_worker_does_not_stop_the_polling():
    """A state of an unexpected shape, or a worker URL httpx cannot use, marked out that one worker
    and stopped the fleet's polling for good (a worker once marked out never came back)."""
    shapes = {"load": None, "adapters": [{"name": "x"}]}
    with serving(worker(shapes)) as odd, serving(worker(RESIDENT)) as good:
        app = create_router_app(
            RouterConfig(workers=(odd, good), admin_token=TOKEN, poll_interval_s=0.05)
        )
        with serving(app) as url:
            bad_url = httpx.post(
                f"{url}/admin/workers", headers=ADMIN, json={"url": "http://host:80o0"}
            )
            assert bad_url.status_code == 400
            assert workers_seen(url) == {odd: False, good: True}
            app.state.fleet.workers[good].healthy = False  # as a failed request marks it out
            deadline = time.monotonic() + 10
            while not workers_seen(url)[good] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert workers_seen(url)[good]  # the polling went on: it rejoined


def test_a_slow_answer_is_a_timeout_not_a_dead_worker_and_is_not_run_twice():
    calls = []
    with (
        serving(worker(RESIDENT, answer_after_s=1.5, calls=calls)) as slow,
        serving(worker({"adapters": [], "load": {"free_slots": 2}})) as other,
    ):
        config = RouterConfig(workers=(slow, other), admin_token=TOKEN, request_timeout_s=0.5)
        with serving(create_router_app(config)) as url:
            answer = httpx.post(f"{url}/v1/completions", json={"model": "sql", "prompt": "x"})
            assert answer.status_code == 504 and answer.json()["error"]["code"] == "gateway_timeout"
            # not retried elsewhere, not marked out
            assert len(calls) == 1 and workers_seen(url)[slow]


def test_a_body_that_is_not_utf8_is_a_400():
    with serving(worker(RESIDENT)) as one:
        with serving(create_router_app(RouterConfig(workers=(one,), admin_token=TOKEN))) as url:
            bad = httpx.post(f"{url}/v1/completions", content=b'{"model": "\xff"}')
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


def test_more_than_a_hundred_streams_at_once_are_all_carried():
    """httpx's default pool of 100 connections made the 101st request wait for one and fail as if
    its worker had (PoolTimeout: the worker marked out, the client answered 502). The fair-share
    queue is off, so that all 110 are open on the worker at once."""

    async def stream(request):
        await request.body()

        async def chunks():
            # Each stream outlasts the proxy's pool timeout (1.5 s, the request timeout) by a
            # second, with gaps a second shorter than its read timeout (0.6 s gaps against 1.0 s
            # failed once on a loaded machine).
            for i in range(5):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.5)

        return StreamingResponse(chunks(), media_type="text/event-stream")

    app = worker(RESIDENT)
    app.router.routes[-1] = Route("/v1/completions", stream, methods=["POST"])
    with serving(app) as one:
        config = RouterConfig(
            workers=(one,), admin_token=TOKEN, request_timeout_s=1.5, queue_per_tenant=0
        )
        with serving(create_router_app(config)) as url:

            async def all_at_once():
                async with httpx.AsyncClient(
                    timeout=30, limits=httpx.Limits(max_connections=None)
                ) as client:

                    async def one_stream():
                        async with client.stream(
                            "POST", f"{url}/v1/completions", json={"model": "sql"}
                        ) as r:
                            return r.status_code, len(
                                [line async for line in r.aiter_lines() if line]
                            )

                    return await asyncio.gather(*(one_stream() for _ in range(110)))

            assert asyncio.run(all_at_once()) == [(200, 5)] * 110
            assert workers_seen(url)[one]


def tenant_worker(state: dict) -> Starlette:
    """A worker where only the key `alice-key` may use the adapter `sql` (a 404 otherwise, as for a
    name that does not exist)."""

    async def completions(request):
        body = await request.json()
        if (
            body.get("model") == "sql"
            and request.headers.get("authorization") == "Bearer alice-key"
        ):
            return JSONResponse({"choices": [{"text": "ok"}]})
        return JSONResponse(
            {
                "error": {
                    "message": "no such model",
                    "type": "invalid_request_error",
                    "code": "model_not_found",
                    "param": "model",
                }
            },
            status_code=404,
        )

    return worker(state, answer=completions)


def picks(url: str, token: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}).text
    return {
        line.split('"')[1]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("loraplex_router_picks_total{")
    }


def test_a_refused_caller_learns_nothing_of_where_an_adapter_is_resident():
    """The router picks from the model name before a worker checks the key: a 404 for another
    tenant's adapter carried `x-loraplex-route: affinity-gpu` (an unknown name `cold-hash`), and the
    picks counter moved the same way. Now refusals carry no route or worker header and are not
    counted; /metrics can require a token."""
    metrics_token = "metrics-token-0123456789"
    with serving(tenant_worker(RESIDENT)) as w:
        config = RouterConfig(workers=(w,), admin_token=TOKEN, metrics_token=metrics_token)
        with serving(create_router_app(config)) as url:
            assert workers_seen(url) == {w: True}
            assert httpx.get(f"{url}/metrics").status_code == 401
            # the admin token is not it
            assert httpx.get(f"{url}/metrics", headers=ADMIN).status_code == 401
            for model in ("sql", "nothing-here"):
                refused = httpx.post(
                    f"{url}/v1/completions",
                    json={"model": model, "prompt": "x"},
                    headers={"Authorization": "Bearer bob-key"},
                )
                assert refused.status_code == 404
                assert (
                    "x-loraplex-route" not in refused.headers
                    and "x-loraplex-worker" not in refused.headers
                )
            assert picks(url, metrics_token) == {}
            served = httpx.post(
                f"{url}/v1/completions",
                json={"model": "sql", "prompt": "x"},
                headers={"Authorization": "Bearer alice-key"},
            )
            assert (
                served.status_code == 200 and served.headers["x-loraplex-route"] == "affinity-gpu"
            )
            assert served.headers["x-loraplex-worker"] == w
            assert picks(url, metrics_token) == {"affinity-gpu": 1.0}
