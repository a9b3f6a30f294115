"""Fair share of saturated workers: while every worker a request may use is saturated, it waits
at the router in its tenant's queue, and a worker that has room again takes the next request in
fair order, not the next to arrive.

The order: the higher priority band first (the registry's tenant priority); within a band,
start-time fair queueing over tenants: a tenant that starts waiting takes the virtual clock as its
start tag (or its last finish, if later), each grant moves its tag on by 1/weight, and the tenant
whose next finish tag is lowest goes next; first come first within a tenant. A
tenant that bursts therefore gets its share, not the line: another tenant's request waits for at
most one grant per other tenant with a lower tag.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueFull(Exception):
    """The tenant already has its limit of requests waiting."""


@dataclass
class Waiter(Generic[T]):
    tenant: str
    priority: int
    seq: int
    granted: asyncio.Future[T]
    what: object = None
    """What the grant's check reads (the request as routing reads it)."""
    held_back: bool = False
    """A free place was kept from it for another tenant (counted once)."""


@dataclass
class FairQueue(Generic[T]):
    weights: dict[str, float] = field(default_factory=dict)
    """Tenant -> weight (a tenant not named weighs 1)."""
    limit: int = 256
    """Requests a tenant may have waiting."""
    _queues: dict[str, deque[Waiter[T]]] = field(default_factory=dict)
    _start: dict[str, float] = field(default_factory=dict)
    """The start tag of each waiting tenant's next grant."""
    _finish: dict[str, float] = field(default_factory=dict)
    _clock: float = 0.0
    _seq: itertools.count = field(default_factory=itertools.count)
    granted_total: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def waiting(self, tenant: str) -> int:
        return len(self._queues.get(tenant, ()))

    def join(
        self,
        tenant: str,
        priority: int,
        what: object = None,
        granted: asyncio.Future[T] | None = None,
    ) -> Waiter[T]:
        """A request of `tenant` waits (QueueFull: the tenant's queue is at its limit).
        `granted`: the future its grant sets (a new one on the running loop; the simulator, which
        runs no loop, gives its own)."""
        if self.waiting(tenant) >= self.limit:
            raise QueueFull(tenant)
        future = granted if granted is not None else asyncio.get_running_loop().create_future()
        waiter = Waiter(tenant, priority, next(self._seq), future, what)
        if tenant not in self._queues:
            self._start[tenant] = max(self._finish.get(tenant, 0.0), self._clock)
        self._queues.setdefault(tenant, deque()).append(waiter)
        return waiter

    def leave(self, waiter: Waiter[T]) -> None:
        """A waiter that gave up (its client left, or it timed out)."""
        queue = self._queues.get(waiter.tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._queues[waiter.tenant], self._start[waiter.tenant]

    def _tag(self, tenant: str) -> float:
        """The virtual finish tag of the tenant's next grant."""
        return self._start[tenant] + 1.0 / self.weights.get(tenant, 1.0)

    def order(self) -> list[Waiter[T]]:
        """Each tenant's first waiter, in the order they are granted."""
        heads = [q[0] for q in self._queues.values()]
        return sorted(heads, key=lambda w: (-w.priority, self._tag(w.tenant), w.seq))

    def admit(self, grant: Callable[[Waiter[T]], T | None]) -> int:
        """Grant waiters in fair order while `grant` finds them room (None: no room for that one,
        whose workers are saturated; the next in order may use others). Returns how many."""
        count = 0
        while True:
            for waiter in self.order():
                if waiter.granted.done():  # cancelled by its client: drop it
                    self.leave(waiter)
                    break
                value = grant(waiter)
                if value is not None:
                    self._granted(waiter)
                    waiter.granted.set_result(value)
                    count += 1
                    break
            else:
                return count

    def _granted(self, waiter: Waiter[T]) -> None:
        tenant = waiter.tenant
        self._clock = self._start[tenant]
        self._finish[tenant] = self._start[tenant] = self._tag(tenant)
        self.granted_total[tenant] = self.granted_total.get(tenant, 0) + 1
        self.leave(waiter)
