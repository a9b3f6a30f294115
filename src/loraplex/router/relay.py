"""A worker's answer relayed to the caller chunk by chunk, as it arrives.

The relay runs in the request's own task: each chunk read from the worker is sent on at once, with
no task group or second task per chunk. A caller that leaves mid-answer ends the relay: a small
listener, the only other task, waits for the caller's disconnect and cancels the relay, which
closes the worker's stream (so the worker stops generating for nobody)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class Relay(Response):
    """The streamed answer of `upstream` (a response opened with `stream=True`); `finished` runs
    once it is closed, however the relay ends."""

    def __init__(
        self, upstream: httpx.Response, headers: Mapping[str, str], finished: Callable[[], None]
    ):
        self.upstream, self.finished = upstream, finished
        self.status_code = upstream.status_code
        self.background = None
        self.raw_headers = [
            (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = asyncio.current_task()
        assert relay is not None
        streaming, left = True, False

        async def listen() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            if streaming:  # the caller left mid-answer (not the answer's own end)
                left = True
                relay.cancel()

        listener = asyncio.ensure_future(listen())
        try:
            start = {"type": "http.response.start", "status": self.status_code}
            await send({**start, "headers": self.raw_headers})
            async for chunk in self.upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            streaming = False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left:  # cancelled from outside
                raise
            relay.uncancel()
        finally:
            streaming = False
            listener.cancel()  # before any await here: the listener cannot cancel the close
            try:
                await self.upstream.aclose()
            finally:
                self.finished()
        if self.background is not None:
            await self.background()
