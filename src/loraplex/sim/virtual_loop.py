"""An asyncio event loop on a simulated clock, for code written for a real loop (the vLLM
residency): its timers, `asyncio.sleep` and `wait_for` timeouts, follow `time()`, and when nothing
is ready the clock jumps to the next timer instead of waiting for it. Callbacks run in the order of
their times, as on a real loop, and a run takes as long as its Python work.

Nothing may wait for a thread or a socket: a loop with nothing to run and no timer raises rather
than wait for ever."""

from __future__ import annotations

import asyncio
import selectors


class _Clock:
    now = 0.0


class _JumpingSelector(selectors.BaseSelector):
    """The loop's selector: what is ready now, or else the clock moved on to the loop's next timer
    (the loop asks for a wait of exactly the time until it)."""

    def __init__(self, clock: _Clock):
        self._real = selectors.DefaultSelector()  # the loop's own wake-up pipe
        self._clock = clock

    def register(self, fileobj, events, data=None):
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._real.modify(fileobj, events, data)

    def select(self, timeout=None):
        ready = self._real.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("the simulation waits for nothing: no callback and no timer left")
        self._clock.now += timeout
        return []

    def get_map(self):
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualLoop(asyncio.SelectorEventLoop):
    """`loop.time()` is the simulated clock, in seconds from 0."""

    def __init__(self):
        self._virtual = _Clock()
        super().__init__(_JumpingSelector(self._virtual))

    def time(self) -> float:
        return self._virtual.now
