"""A client that leaves stops the work done for it: `watch` sees it go, `until_gone` stops what the
handler awaits meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client left before the awaited work ended (the work was cancelled)."""


def watch(request: Request) -> asyncio.Task:
    """Done when the client has gone; cancel it when the answer is out. Call it once the body is
    read: the next message the server gives is then the disconnect."""
    return asyncio.ensure_future(_disconnected(request))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_gone(work: Awaitable[T], gone: asyncio.Future) -> T:
    """`work`'s result, awaited in the calling task; if `gone` ends first, `work` is cancelled
    (it unwinds as under any cancellation) and ClientGone is raised, whatever error the cancelled
    work ended with; a result it still gives stands (a slot it acquired must be released). No task
    of its own for `work`, and no `asyncio.wait`."""
    task = asyncio.current_task()
    armed, fired = True, False

    def cancel(_: asyncio.Future) -> None:
        nonlocal fired
        if armed:  # it may run after `work` ended, scheduled when `gone` ended
            fired = True
            task.cancel()

    gone.add_done_callback(cancel)
    try:
        result = await work
    except (Exception, asyncio.CancelledError):
        # cancelled by someone else too, or not cancelled: the error is the answer; once cancelled,
        # whatever `work` made of it (vLLM answers an error response, say) is the client's leave
        if not fired or task.cancelling() > 1:
            raise
        task.uncancel()
        raise ClientGone from None
    finally:
        armed = False
        gone.remove_done_callback(cancel)
    if fired:  # `work` took the cancellation in and ended all the same: its result stands
        task.uncancel()
    return result
