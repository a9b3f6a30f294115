"""The router's fair share at the simulated router: `simulate --fair-share`.

As `loraplex router` does (`router/app.py`, `RouterState.wait_turn` and `admit`): a worker that has
as many requests open as it runs at once is saturated (the router's `worker_queue_limit` 0); a
request whose every worker is saturated, or that arrives while others wait, or whose tenant must
leave the free places to others (`router/holdback.py`'s `Holdback`, the router's own held-back
places), waits at the router in its tenant's queue (`router/fairness.py`'s `FairQueue`, the
router's own), and is granted a worker in fair order when one has room for it again: when a request
ends, and at a quarter of the poll interval while any wait. A tenant whose queue is at its limit is
refused (the router's 429).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, cast

from loraplex.router.fairness import FairQueue, QueueFull, Waiter
from loraplex.router.holdback import Holdback, Place

# the simulator's (`simulator.Simulation`, `simulator.SimRequest`), which imports this module
Simulation = Any
SimRequest = Any


class FairShare:
    def __init__(self, sim: Simulation, weights: dict[str, float], limit: int):
        self.sim = sim
        self.queue: FairQueue[int] = FairQueue(dict(weights), limit)
        self.holdback = Holdback(sim.config.holdback_window_s, dict(weights))
        self._index = {w.url: w.index for w in sim.workers}
        # The grants' futures belong to a loop that never runs (closed at once): the simulation
        # sets and reads them, and nothing awaits them.
        self._loop = asyncio.new_event_loop()
        self._loop.close()
        self._ticking = False
        self.waited = 0
        """Requests that waited at the router."""
        self.held_back: Counter[str] = Counter()
        """Per tenant, its requests that waited while a free place was kept for another tenant
        (the router's `loraplex_router_tenant_held_back_total`)."""

    def arrives(self, seq: SimRequest, reason: str, ranking: tuple[str, ...]) -> bool:
        """The request arrived at the router, picked for `reason` among `ranking`: whether it
        waits its turn (as the router's `_waits`)."""
        r = seq.req
        self.holdback.arrived(r.tenant, r.priority, self.sim.now, ranking)
        if reason == "saturated-fallback" or len(self.queue) > 0:
            return True
        return self._holds_back(r.tenant, ranking)

    def opened(self, seq: SimRequest, index: int) -> None:
        """The request went to worker `index`."""
        self.holdback.opened(seq.req.tenant, self.sim.workers[index].url, self.sim.now)

    def closed(self, seq: SimRequest) -> None:
        """The request ended on its worker: the next waiting ones may go."""
        self.holdback.closed(seq.req.tenant, self.sim.workers[seq.worker].url)
        self.admit()

    def join(self, seq: SimRequest) -> None:
        """The request waits in its tenant's queue (refused when that is full)."""
        try:
            self.queue.join(seq.req.tenant, seq.req.priority, seq, asyncio.Future(loop=self._loop))
        except QueueFull:
            self.sim.refuse(seq)
            return
        self.waited += 1
        self.admit()

    def admit(self) -> None:
        """Waiting requests in fair order, each while a worker it may use has room."""
        if len(self.queue):
            self.queue.admit(self._grant)
        if len(self.queue) and not self._ticking:
            self._ticking = True
            self.sim.schedule(self.sim.now + self.sim.config.router_poll_s / 4, self._tick, None)

    def _tick(self, _) -> None:
        self._ticking = False
        self.admit()

    def _grant(self, waiter: Waiter[int]) -> int | None:
        """The waiter's worker when one it may use has room for it (None: not yet), sent there;
        -1: no pool serves it."""
        seq = cast("SimRequest", waiter.what)
        index, reason, ranking = self.sim.route(seq)
        if index is None:
            self.sim.refuse(seq)
            return -1
        if reason.startswith("saturated"):
            return None
        if self._holds_back(waiter.tenant, ranking):
            if not waiter.held_back:
                waiter.held_back = True
                self.held_back[waiter.tenant] += 1
            return None
        self.sim.send(seq, index, reason)
        return index

    def _holds_back(self, tenant: str, ranking: tuple[str, ...]) -> bool:
        """Whether the free places of the workers in `ranking` are kept for other tenants."""
        capacity, num_open = self.sim.config.max_num_seqs, self.sim.open
        places = [Place(url, capacity, num_open[self._index[url]]) for url in ranking]
        return self.holdback.keeps_from(tenant, places, self.sim.now)
