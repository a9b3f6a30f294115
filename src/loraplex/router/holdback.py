"""Places held back for tenants that are owed them: slots are not preempted, so while one tenant
over its fair share fills every place, another tenant's next request would wait for a place to free
anywhere, however few places it uses. So, while another tenant of the same priority band (or a
higher one) has sent a request within the window and holds less than its share, the tenant over
its share leaves one place free for each such tenant, and that tenant's next request starts at
once. A tenant alone (none other active within the window) is never held back, so it still gets
the whole fleet; in all at most half the places are held.

A tenant's share is the places of the workers a request may use times its weight over the weights
of the active tenants of its band (active: a request sent within the window, or one open)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from loraplex.router.fleet import Worker


class Room(NamedTuple):
    places: int
    """The requests the workers run at once (their reported `max_num_seqs`)."""
    free: int
    """Those not taken by a request the router has open there."""


def room_of(workers: Iterable[Worker]) -> Room:
    """The running places of `workers` that report their capacity, and how many are free."""
    places = free = 0
    for worker in workers:
        capacity = worker.last.capacity if worker.last is not None else 0
        places += capacity
        free += max(0, capacity - worker.in_flight)
    return Room(places, free)


@dataclass
class Holdback:
    window_s: float
    """A tenant that sent a request within this many seconds is active (0: nothing held)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Tenant -> weight (a tenant not named weighs 1), as in the fair-share queue."""
    _seen: dict[str, float] = field(default_factory=dict)
    """Tenant -> when its last request arrived (monotonic seconds)."""
    _priority: dict[str, int] = field(default_factory=dict)
    _open: dict[str, int] = field(default_factory=dict)
    """Tenant -> its requests sent to a worker and not finished."""

    def arrived(self, tenant: str | None, priority: int, now: float) -> None:
        """A caller's request arrived (tenant None: a key no tenant holds, which makes no tenant
        active: a worker refuses it)."""
        if tenant is not None:
            self._seen[tenant] = now
            self._priority[tenant] = priority

    def opened(self, tenant: str | None) -> None:
        """A request of `tenant` went to a worker (None: no caller's, as an upload's)."""
        if tenant is not None:
            self._open[tenant] = self._open.get(tenant, 0) + 1

    def closed(self, tenant: str | None) -> None:
        if tenant is not None:
            self._open[tenant] = max(0, self._open.get(tenant, 0) - 1)

    def num_open(self, tenant: str) -> int:
        return self._open.get(tenant, 0)

    def keeps_from(self, tenant: str, workers: Iterable[Worker], now: float) -> bool:
        """Whether `tenant`'s next request must leave the free places of `workers` (those it may
        use) to other tenants."""
        room = room_of(workers)
        held = self.held(tenant, room.places, now)
        return held > 0 and room.free <= held

    def held(self, tenant: str, places: int, now: float) -> int:
        """The free places `tenant`'s next request must leave to others: one per other active
        tenant of its band or a higher one that holds less than its share, while `tenant` holds
        its share or more; at most half of `places`."""
        if self.window_s <= 0 or places <= 0:
            return 0
        active = {t for t, at in self._seen.items() if now - at <= self.window_s}
        active |= {t for t, n in self._open.items() if n > 0} | {tenant}
        if len(active) == 1 or self.num_open(tenant) < self._share(tenant, active, places):
            return 0
        band = self._priority.get(tenant, 0)
        owed = [
            t
            for t in active - {tenant}
            if self._priority.get(t, 0) >= band
            and self.num_open(t) < self._share(t, active, places)
        ]
        return min(len(owed), places // 2)

    def _share(self, tenant: str, active: set[str], places: int) -> float:
        """The places owed to `tenant` among the active tenants of its band."""
        band = self._priority.get(tenant, 0)
        peers = [t for t in active if self._priority.get(t, 0) == band]
        total = sum(self.weights.get(t, 1.0) for t in peers)
        return places * self.weights.get(tenant, 1.0) / total
