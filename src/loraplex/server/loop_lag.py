"""How late the API server's event loop runs what is due. Every stream, request and admin call of a
worker goes through one loop: while a callback holds it, all of them wait. A timer due every 5 ms
measures it; each lateness goes to `loraplex_event_loop_lag_seconds`. A lateness over X means the
loop ran nothing else for more than X (it is at most the stall, and less by up to one interval).
The timer is a plain callback, no task: a tick costs a few microseconds.
"""

from __future__ import annotations

import asyncio
import time

from prometheus_client import Histogram

INTERVAL_S = 0.005


class LoopLag:
    def __init__(self, histogram: Histogram, interval_s: float = INTERVAL_S):
        self.histogram, self.interval_s = histogram, interval_s
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self.loop: asyncio.AbstractEventLoop | None = None
        """The loop watched, once started."""

    def start(self) -> None:
        """On the loop to watch."""
        self.loop = asyncio.get_running_loop()
        self._next()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _next(self) -> None:
        assert self.loop is not None  # started
        self._due = time.monotonic() + self.interval_s
        self._timer = self.loop.call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        self.histogram.observe(max(0.0, time.monotonic() - self._due))
        self._next()
