"""A request's outputs as an async iterator, for both ways of running the engine: on a thread of
the server's process (async_engine.py) and in a process of its own (client.py). Each delivers a
request's outputs to the queue that `request_stream` registers under its id."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable

from loraplex.engines.contract import Generation, Tokenizer
from loraplex.engines.requests import RequestOutput, SamplingParams
from loraplex.residency.key import AdapterRef

Streams = dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]]
"""Request id -> the loop and queue its outputs are delivered to."""


async def request_stream(
    streams: Streams,
    request_id: str,
    num_seqs: int,
    start: Callable[[], Awaitable[None]],
    abort: Callable[[], None],
) -> AsyncGenerator[RequestOutput, None]:
    """Outputs of the request that `start` submits, until each of its `num_seqs` sequences has
    finished; an output's error is raised. Leaving before then (a client gone, an error) calls
    `abort`."""
    if request_id in streams:  # its outputs and aborts would reach the other request
        raise ValueError(f"request id {request_id!r} is already in use")
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    streams[request_id] = (asyncio.get_running_loop(), queue)
    running = num_seqs  # each of the prompt's sequences ends with a finished output
    try:
        await start()
        while running:
            out = await queue.get()
            running -= out.finished
            if out.error is not None:
                raise out.error
            yield out
    finally:
        streams.pop(request_id, None)
        if running:
            abort()


async def complete_text(
    generation: Generation, tokenizer: Tokenizer, prompt: str, ref: AdapterRef, max_tokens: int
) -> str:
    """Greedy completion of `prompt` with the adapter (the release checks)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    ids = tokenizer.encode(prompt)
    return "".join([out.text async for out in generation.generate(ids, params, ref)])
