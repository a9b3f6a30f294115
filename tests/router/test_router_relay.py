"""The router's relay of a streamed answer, over real sockets: every chunk arrives in order, and a
caller that leaves mid-answer closes the worker's stream and frees its place at the router."""

import asyncio
import sys
import time
from pathlib import Path

import httpx
from starlette.responses import StreamingResponse
from starlette.routing import Route

from loraplex.router.app import RouterConfig, create_router_app

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_router_workers import ADMIN, RESIDENT, TOKEN, worker  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from harness import serving  # noqa: E402 (the tests' uvicorn-in-a-thread runner)


def streaming_worker(closed: list[int], chunks: int, gap_s: float):
    """A worker streaming `chunks` SSE events `gap_s` apart; `closed` gets how many it had sent
    when its stream ended (all of them, or fewer when the reader went away)."""

    async def stream(request):
        await request.body()

        async def events():
            sent = 0
            try:
                for i in range(chunks):
                    yield f"data: {i}\n\n".encode()
                    sent += 1
                    await asyncio.sleep(gap_s)
                yield b"data: [DONE]\n\n"
            finally:
                closed.append(sent)

        return StreamingResponse(events(), media_type="text/event-stream")

    app = worker(RESIDENT)
    app.router.routes[-1] = Route("/v1/completions", stream, methods=["POST"])
    return app


def in_flight(url: str) -> int:
    listed = httpx.get(f"{url}/admin/workers", headers=ADMIN).json()["workers"]
    return sum(w["in_flight"] for w in listed)


def test_a_streamed_answer_arrives_whole_and_in_order_with_the_route_named():
    closed: list[int] = []
    with serving(streaming_worker(closed, 50, 0.0)) as one:
        config = RouterConfig(workers=(one,), admin_token=TOKEN)
        with serving(create_router_app(config)) as url:
            with httpx.stream("POST", f"{url}/v1/completions", json={"model": "sql"}) as r:
                lines = [line for line in r.iter_lines() if line]
                headers = r.headers
            assert r.status_code == 200
            assert lines == [f"data: {i}" for i in range(50)] + ["data: [DONE]"]
            assert headers["x-loraplex-worker"] == one
            assert headers["content-type"].startswith("text/event-stream")
            assert in_flight(url) == 0
    assert closed == [50]


def test_a_caller_that_leaves_mid_answer_closes_the_workers_stream():
    closed: list[int] = []
    with serving(streaming_worker(closed, 600, 0.05)) as one:
        config = RouterConfig(workers=(one,), admin_token=TOKEN)
        with serving(create_router_app(config)) as url:
            with httpx.stream("POST", f"{url}/v1/completions", json={"model": "sql"}) as r:
                lines = r.iter_lines()
                assert next(lines) == "data: 0"
                assert in_flight(url) == 1
            deadline = time.monotonic() + 20
            while (not closed or in_flight(url)) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert in_flight(url) == 0
    assert len(closed) == 1 and closed[0] < 600
