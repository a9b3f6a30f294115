"""Eviction policies: pure functions over plain data, testable without torch."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

# Decayed request counts stand in for rolling windows of 5 minutes, 1 hour and 24 hours.
DEMAND_WINDOWS_S = (300.0, 3600.0, 86400.0)


@dataclass(frozen=True)
class Candidate:
    """A resident adapter (or one that wants to be) as a policy sees it."""

    key: object
    nbytes: int
    last_access: float
    loaded_at: float
    demand: float = 0.0
    """Decayed request count over the short (5 min) window."""
    tenant: str = "default"
    priority: int = 0
    reload_cost: float = 0.0
    """Seconds its last load took: what evicting it would cost again."""
    preferred: bool = False
    """Promoted by its demand to the tier it is resident in (tier A for gpu, tier B for cpu)."""


class DemandTracker:
    """Exponentially decayed request counts per key, one per window."""

    def __init__(self):
        self._counts: dict[object, tuple[float, list[float]]] = {}

    def record(self, key, now: float) -> None:
        counts = self.counts(key, now)
        self._counts[key] = (now, [c + 1 for c in counts])

    def counts(self, key, now: float) -> list[float]:
        at, counts = self._counts.get(key, (now, [0.0] * len(DEMAND_WINDOWS_S)))
        return [c * math.exp(-(now - at) / w) for c, w in zip(counts, DEMAND_WINDOWS_S)]

    def short(self, key, now: float) -> float:
        return self.counts(key, now)[0]


class LRUPolicy:
    """The runtime baseline (vLLM, TensorRT-LLM): evict the least recently used."""

    name = "lru"

    def choose_victim(self, candidates: list[Candidate], now: float, incoming: Candidate | None = None):
        if not candidates:
            return None
        return min(candidates, key=lambda c: c.last_access).key


@dataclass(frozen=True)
class ScorePolicy:
    """keep_score = recency + frequency + tenant priority + reload cost − size, with protections.

    A newly loaded adapter is protected for `min_residency_s` against newcomers with less demand than it,
    so a one-off request cannot push out an adapter that is proving hot; frequency dominates recency, so
    a burst of one-off adapters cycles through the lowest-value slot instead of the hot adapters' slots.
    """

    recency_s: float = 60.0
    w_recency: float = 1.0
    w_frequency: float = 2.0
    w_priority: float = 0.5
    w_cost: float = 1.0
    w_size_per_gib: float = 0.1
    w_preferred: float = 2.0
    min_residency_s: float = 1.0
    restores_preferred: bool = True
    """Put adapters promoted by demand (tier A) back in a slot once the one-off that displaced them is done."""
    name: str = "score"

    def keep_score(self, c: Candidate, now: float) -> float:
        recency = math.exp(-max(0.0, now - c.last_access) / self.recency_s)
        return (
            self.w_recency * recency
            + self.w_frequency * math.log1p(c.demand)
            + self.w_priority * c.priority
            + self.w_cost * c.reload_cost
            - self.w_size_per_gib * c.nbytes / 2**30
            + self.w_preferred * c.preferred
        )

    def choose_victim(self, candidates: list[Candidate], now: float, incoming: Candidate | None = None):
        if incoming is not None:
            candidates = [
                c for c in candidates if not (now - c.loaded_at < self.min_residency_s and c.demand > incoming.demand)
            ]
        if not candidates:
            return None
        return min(candidates, key=lambda c: (self.keep_score(c, now), c.last_access)).key


def make_policy(name: str):
    if name == "lru":
        return LRUPolicy()
    if name == "score":
        return ScorePolicy()
    raise ValueError(f"unknown eviction policy {name!r}: use lru or score")


class LFUPolicy:
    """Least frequently used, frequency being the decayed 5-minute request count (LFU with aging); ties go to
    the least recently used. A comparison baseline for the simulator."""

    name = "lfu"

    def choose_victim(self, candidates: list[Candidate], now: float, incoming: Candidate | None = None):
        if not candidates:
            return None
        return min(candidates, key=lambda c: (c.demand, c.last_access)).key


class GDSFPolicy:
    """Greedy-Dual-Size-Frequency (Cherkasova): evict the lowest H = L + frequency × reload cost / size, where
    L, the inflation value, rises to each victim's H so that adapters not touched since fall behind.

    Frequency is the decayed 5-minute request count, cost the seconds of the adapter's last load, size its bytes
    in GiB; an adapter's L is the inflation value at its last access. A comparison baseline for the simulator;
    one instance serves one cache (it keeps the inflation history)."""

    name = "gdsf"

    def __init__(self):
        self._times: list[float] = []
        self._values: list[float] = []

    def inflation_at(self, t: float) -> float:
        i = bisect.bisect_right(self._times, t)
        return self._values[i - 1] if i else 0.0

    def priority(self, c: Candidate) -> float:
        size_gib = max(c.nbytes, 1) / 2**30
        return self.inflation_at(c.last_access) + max(c.demand, 1e-9) * max(c.reload_cost, 1e-6) / size_gib

    def choose_victim(self, candidates: list[Candidate], now: float, incoming: Candidate | None = None):
        if not candidates:
            return None
        victim = min(candidates, key=lambda c: (self.priority(c), c.last_access))
        h = self.priority(victim)
        if h > (self._values[-1] if self._values else 0.0):
            self._times.append(now)
            self._values.append(h)
        return victim.key
