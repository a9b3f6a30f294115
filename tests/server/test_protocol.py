"""`serve`'s HTTP protocol (one socket send per connection per loop turn): whole responses, in
order, on keep-alive connections, pipelined requests, streams and closes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from loraplex.server.preflight import bind
from loraplex.server.protocol import OneSendPerTurn


async def _json(request):
    return JSONResponse({"path": request.url.path, "n": int(request.query_params.get("n", 0))})


async def _stream(request):
    async def parts():
        for i in range(3):
            yield f"part {i}\n".encode()
            await asyncio.sleep(0.01)  # each part in a turn of its own

    return StreamingResponse(parts(), media_type="text/plain")


async def _close(request):
    return JSONResponse({"bye": True}, headers={"connection": "close"})


APP = Starlette(routes=[Route("/json", _json), Route("/stream", _stream), Route("/close", _close)])


@contextlib.contextmanager
def _serving():
    sock = bind("127.0.0.1", 0)
    config = uvicorn.Config(APP, http=OneSendPerTurn, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def test_keep_alive_responses_arrive_whole_and_in_order():
    with _serving() as port, httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        for n in range(20):
            answer = client.get("/json", params={"n": n})
            assert answer.status_code == 200 and answer.json() == {"path": "/json", "n": n}
            assert answer.headers["content-type"] == "application/json"
        streamed = client.get("/stream")
        assert streamed.text == "part 0\npart 1\npart 2\n"
        assert client.get("/json", params={"n": 99}).json()["n"] == 99


def test_pipelined_requests_get_their_answers_in_order():
    with _serving() as port, socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        requests = b"".join(
            f"GET /json?n={n} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for n in range(5)
        )
        conn.sendall(requests + b"GET /close HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := conn.recv(65536):  # the server closes after /close: all is sent first
            data += chunk
    bodies = [part.split(b"\r\n\r\n", 1)[1] for part in data.split(b"HTTP/1.1 ")[1:]]
    expected = [b'{"path":"/json","n":%d}' % n for n in range(5)] + [b'{"bye":true}']
    assert bodies == expected
