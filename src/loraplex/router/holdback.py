"""Places held back for tenants that are owed them: slots are not preempted, so while one tenant
over its fair share fills every place, another tenant's next request would wait for a place to free
anywhere, however few places it uses. So, while another tenant of the same priority band (or a
higher one) is active on the workers a request may use and holds less than its share there, the
tenant over its share there leaves free places for each such tenant, and that tenant's next
request starts at once: as many as that tenant had open at once (anywhere) within the last minute
(or the window, if longer) less those it holds there, at least one and no more than its share (a
tenant whose requests overlap finds a place for the second too, not only for the first). A tenant
alone (none other active there) is never held back, so it still gets the whole fleet; in all at
most half the places are held.

Everything is counted on the workers the request may use (its pools' workers), never fleet-wide:
a tenant's share is their places times its weight over the weights of the tenants of its band
active there (active: a request that could go there arrived within the window, or one is open
there), and what it holds is its requests open there. So a tenant busy on one pool is not held
back on another.

Plain data in and out, so the simulator runs the very rule the router runs (`sim/fair_share.py`)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass, field
from typing import NamedTuple

from loraplex.router.fleet import Worker

PEAK_MEMORY_S = 60.0
"""A tenant's peak of requests open at once is remembered this long (or the window, if longer)."""


class Place(NamedTuple):
    """A worker as the hold-back reads it."""

    url: str
    capacity: int
    """The requests it runs at once (its reported `max_num_seqs`; 0: not reported)."""
    num_open: int
    """The requests the router has open there."""


def places_of(workers: Iterable[Worker]) -> list[Place]:
    """The router's workers as places: their reported capacity and the requests open there."""
    return [
        Place(w.url, w.last.capacity if w.last is not None else 0, w.in_flight) for w in workers
    ]


@dataclass
class Holdback:
    window_s: float
    """A tenant whose request arrived within this many seconds is active (0: nothing held)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Tenant -> weight (a tenant not named weighs 1), as in the fair-share queue."""
    _seen: dict[tuple[str, str], float] = field(default_factory=dict)
    """(tenant, worker url) -> when its last request that could go there arrived, within about
    two windows (`_forget_quiet`)."""
    _forgot_at: float = float("-inf")
    _priority: dict[str, int] = field(default_factory=dict)
    _open: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(tenant, worker url) -> its requests sent there and not finished."""
    _total: Counter[str] = field(default_factory=Counter)
    """Tenant -> its requests open on any worker."""
    _peak: dict[str, tuple[int, float]] = field(default_factory=dict)
    """Tenant -> (the most requests it had open at once lately, when it last had that many); a
    peak older than `peak_memory_s` gives way to the next count."""

    @property
    def peak_memory_s(self) -> float:
        """How long a tenant's peak is remembered: a minute, or the window if longer (a peak is
        its traffic's shape, which changes more slowly than whether it is active)."""
        return max(PEAK_MEMORY_S, self.window_s)

    def arrived(self, tenant: str | None, priority: int, now: float, urls: Iterable[str]) -> None:
        """A caller's request arrived that could go to the workers `urls` (tenant None: a key no
        tenant holds, which makes no tenant active: a worker refuses it)."""
        if tenant is None or self.window_s <= 0:
            return
        self._priority[tenant] = priority
        for url in urls:
            self._seen[tenant, url] = now
        self._forget_quiet(now)

    def _forget_quiet(self, now: float) -> None:
        """Forget the arrivals past the window (a tenant gone quiet, a worker gone from the
        fleet): they make no tenant active any more. Once a window at most, so each arrival
        costs little and the pairs kept are those of the last two windows."""
        if now - self._forgot_at < self.window_s:
            return
        self._forgot_at = now
        self._seen = {key: at for key, at in self._seen.items() if now - at <= self.window_s}
        memory = self.peak_memory_s
        self._peak = {t: peak for t, peak in self._peak.items() if now - peak[1] <= memory}

    def opened(self, tenant: str | None, url: str, now: float) -> None:
        """A request of `tenant` went to worker `url` (None: no caller's, as an upload's)."""
        if tenant is None:
            return
        self._open[tenant, url] += 1
        self._total[tenant] += 1
        count = self._total[tenant]
        peak, at = self._peak.get(tenant, (0, now))
        if count >= peak or now - at > self.peak_memory_s:
            self._peak[tenant] = (count, now)

    def closed(self, tenant: str | None, url: str) -> None:
        if tenant is None:
            return
        for counter, key in ((self._open, (tenant, url)), (self._total, tenant)):
            if counter[key] > 1:
                counter[key] -= 1
            else:
                counter.pop(key, None)

    def keeps_from(self, tenant: str, places: Sequence[Place], now: float) -> bool:
        """Whether `tenant`'s next request must leave the free places of `places` (the workers it
        may use) to other tenants."""
        total = sum(p.capacity for p in places)
        free = sum(max(0, p.capacity - p.num_open) for p in places)
        urls = {p.url for p in places if p.capacity > 0}
        held = self.held(tenant, urls, total, now)
        return held > 0 and free <= held

    def held(self, tenant: str, urls: Set[str], places: int, now: float) -> int:
        """The free places of the workers `urls` (`places` in all) that `tenant`'s next request
        must leave to others, while `tenant` holds its share or more: for each other tenant of
        its band or a higher one active there that holds less than its share there, its recent
        peak (`_peak`, at most its share) less what it holds, at least one; at most half of
        `places`."""
        if self.window_s <= 0 or places <= 0:
            return 0
        holding: Counter[str] = Counter()
        for (t, url), n in self._open.items():
            if url in urls:
                holding[t] += n
        seen = self._seen.items()
        active = {t for (t, url), at in seen if url in urls and now - at <= self.window_s}
        active |= set(holding) | {tenant}
        if len(active) == 1 or holding[tenant] < self._share(tenant, active, places):
            return 0
        band = self._priority.get(tenant, 0)
        kept = 0
        for t in active - {tenant}:
            share = self._share(t, active, places)
            if self._priority.get(t, 0) >= band and holding[t] < share:
                kept += max(1, min(self._recent_peak(t, now), math.floor(share)) - holding[t])
        return min(kept, places // 2)

    def _recent_peak(self, tenant: str, now: float) -> int:
        peak, at = self._peak.get(tenant, (0, now))
        return peak if now - at <= self.peak_memory_s else 0

    def _share(self, tenant: str, active: set[str], places: int) -> float:
        """The places owed to `tenant` among the active tenants of its band."""
        band = self._priority.get(tenant, 0)
        peers = [t for t in active if self._priority.get(t, 0) == band]
        total = sum(self.weights.get(t, 1.0) for t in peers)
        return places * self.weights.get(tenant, 1.0) / total
