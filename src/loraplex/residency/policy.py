"""Eviction policies: pure functions over plain data, testable without torch."""

from __future__ import annotations

import bisect
import math
import operator
from collections import deque
from dataclasses import dataclass

# Decayed request counts stand in for rolling windows of 5 minutes, 1 hour and 24 hours.
DEMAND_WINDOWS_S = (300.0, 3600.0, 86400.0)


@dataclass(slots=True)
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
    """Seconds that bringing it back would take once evicted from this tier: its bytes times the
    measured seconds per byte of the tiers below (a copy from host memory, a disk read, a
    download)."""
    warm: bool = False
    """In the warm set of the tier it is weighed for (the gpu warm set for a slot, the cpu warm set
    for a host copy)."""
    restored: bool = False
    """Put back in its slot ahead of its requests (the gpu warm set), and not asked for since."""


class DemandTracker:
    """Exponentially decayed request counts per key, one per window, and the keys ranked by each
    window's count.

    Counts are kept in forward-decay form: a request at time t adds exp((t − landmark) / window),
    and reading scales the sum back to now. A read is one multiplication, and the order of keys
    by a window's count only changes when one of them is requested, so each ranking is kept
    sorted as requests come in (no decay pass, no sort over every adapter when the cache needs
    the most demanded ones)."""

    REBASE_AFTER = 200.0
    """Move the landmark once the shortest window's growth reaches e^200 (after ~17 h with 5
    minutes)."""
    LONGEST_GAPS = 3.0
    """`overdue` also waits this many times a key's longest gap between requests in the short
    window: requests that come in batches have a mean gap far shorter than the pauses between the
    batches."""

    def __init__(self, windows: tuple[float, ...] = DEMAND_WINDOWS_S, ranked: bool = True):
        self.windows = windows
        self._landmark: float | None = None
        self._scaled: dict[object, list[float]] = {}
        self._rankings = [_Ranking() for _ in windows] if ranked else []
        self._decay_at: tuple[float, list[float]] = (math.nan, [])
        self.first: dict[object, float] = {}
        self.last: dict[object, float] = {}
        """Each key's first and last request."""
        self._gap: dict[object, tuple[float, float, float, float]] = {}
        """Per key with at least two requests in the short window, as of its last request: (last,
        span, count − 1, longest gap), its mean gap being span / (count − 1). Only a record
        changes it."""
        self._gaps: dict[object, deque[tuple[float, float]]] = {}
        """Per key, (time, gap) of the gaps between its requests within the short window before
        its last one, each longer than every later one: the longest is the first."""
        self.version = 0
        """Moves with every record and discard, the only changes of the counts other than their
        decay with time: a reader may keep what it derived from the counts at one time until it
        moves."""

    def record(self, key, now: float) -> None:
        self.version += 1
        if self._landmark is None:
            self._landmark = now
        elif (now - self._landmark) / min(self.windows) > self.REBASE_AFTER:
            self._rebase(now)
        growth = [math.exp((now - self._landmark) / w) for w in self.windows]
        old = self._scaled.get(key)
        new = growth if old is None else [o + g for o, g in zip(old, growth)]
        if self._rankings:
            for ranking, o, n in zip(self._rankings, old or [None] * len(new), new):
                ranking.move(key, o, n)
        self._scaled[key] = new
        first = self.first.setdefault(key, now)
        previous = self.last.get(key)
        self.last[key] = now
        window = self.windows[0]
        longest = 0.0
        if previous is not None:
            recent, gap = self._gaps.setdefault(key, deque()), now - previous
            while recent and recent[-1][1] <= gap:
                recent.pop()  # shorter than this one and older: never the longest again
            recent.append((now, gap))
            while recent[0][0] < now - window:
                recent.popleft()
            longest = recent[0][1]
        at_last = new[0] * math.exp(-(now - self._landmark) / window)
        if at_last >= 2.0:
            self._gap[key] = (now, min(window, now - first), at_last - 1.0, longest)
        else:
            self._gap.pop(key, None)

    def counts(self, key, now: float) -> list[float]:
        scaled = self._scaled.get(key)
        if scaled is None:
            return [0.0] * len(self.windows)
        return [s * d for s, d in zip(scaled, self._decay(now))]

    def count(self, key, now: float, window: int = 0) -> float:
        scaled = self._scaled.get(key)
        return 0.0 if scaled is None else scaled[window] * self._decay(now)[window]

    def overdue(self, key, now: float, gaps: float) -> bool:
        """Whether `key`'s requests stopped: no request for `gaps` times its mean gap between
        requests, as its short-window count at its last request tells it over the time it has
        been seen (up to the window), nor for `LONGEST_GAPS` times the longest gap between its
        requests in the window (so that a client sending batches is not taken as stopped between
        them). The count itself decays over minutes; a busy adapter that falls silent is overdue
        within seconds. A key with fewer than two requests in the window has no gap to go by and
        is never overdue."""
        g = self._gap.get(key)  # kept by `record`: this is asked for many keys at every eviction
        return (
            g is not None
            and now - g[0] > gaps * g[1] / g[2]
            and now - g[0] > self.LONGEST_GAPS * g[3]
        )

    def any_overdue(self, keys, now: float, gaps: float) -> bool:
        """Whether any of `keys` is overdue."""
        return any(self.overdue(key, now, gaps) for key in keys)

    def shorts_live(self, keys, now: float, gaps: float) -> list[float]:
        """As `shorts`, with 0 for the keys that are overdue (their requests stopped)."""
        decay, scaled, gap = self._decay(now)[0], self._scaled, self._gap
        out = []
        for key in keys:
            s = scaled.get(key)
            if s is None:
                out.append(0.0)
                continue
            count = s[0] * decay
            g = gap.get(key)
            stopped = (
                g is not None
                and now - g[0] > gaps * g[1] / g[2]
                and now - g[0] > self.LONGEST_GAPS * g[3]
            )
            out.append(0.0 if count and stopped else count)
        return out

    def short(self, key, now: float) -> float:
        return self.count(key, now, 0)

    def shorts(self, keys, now: float) -> list[float]:
        """The short-window counts of many keys (one lookup of the decay for all)."""
        decay, scaled = self._decay(now)[0], self._scaled
        return [scaled[k][0] * decay if k in scaled else 0.0 for k in keys]

    def ranked(self, now: float, window: int = 0):
        """(key, count) over the given window, the most demanded first (keys without requests are
        left out)."""
        decay = self._decay(now)[window]
        ranking = self._rankings[window]
        # -(neg × decay), all in C: the callers stop at the first few, and the cache asks on every
        # eviction.
        return zip(ranking.keys, map(float.__neg__, map(decay.__mul__, ranking.neg_values)))

    def top(self, now: float, window: int, floor: float, limit: int) -> list:
        """The keys that `ranked` lists first, up to `limit`, while their count is not below
        `floor`: the same keys as walking `ranked`, the end found by bisection (the counts fall
        along the ranking)."""
        decay = self._decay(now)[window]
        ranking = self._rankings[window]
        hi = min(max(limit, 0), len(ranking.keys))
        end = bisect.bisect_left(
            ranking.neg_values, True, 0, hi, key=lambda neg: -(decay * neg) < floor
        )
        return ranking.keys[:end]

    def discard(self, key) -> None:
        old = self._scaled.pop(key, None)
        self.first.pop(key, None)
        self.last.pop(key, None)
        self._gap.pop(key, None)
        self._gaps.pop(key, None)
        if old is not None:
            self.version += 1
            for ranking, o in zip(self._rankings, old):
                ranking.move(key, o, None)

    def _decay(self, now: float) -> list[float]:
        at, factors = self._decay_at
        if at != now:
            landmark = now if self._landmark is None else self._landmark
            factors = [math.exp(-(now - landmark) / w) for w in self.windows]
            self._decay_at = (now, factors)
        return factors

    def _rebase(self, now: float) -> None:
        factors = [math.exp(-(now - self._landmark) / w) for w in self.windows]
        self._scaled = {k: [s * f for s, f in zip(v, factors)] for k, v in self._scaled.items()}
        for ranking, f in zip(self._rankings, factors):
            ranking.neg_values = [v * f for v in ranking.neg_values]  # the order is unchanged
        self._landmark, self._decay_at = now, (math.nan, [])


class _Ranking:
    """Keys sorted by a value, the largest first: parallel lists of negated values and keys."""

    def __init__(self):
        self.neg_values: list[float] = []
        self.keys: list = []

    def move(self, key, old: float | None, new: float | None) -> None:
        if old is not None:
            i = bisect.bisect_left(self.neg_values, -old)
            while self.keys[i] != key:  # equal values: find this key among them
                i += 1
            del self.neg_values[i], self.keys[i]
        if new is not None:
            i = bisect.bisect_right(self.neg_values, -new)
            self.neg_values.insert(i, -new)
            self.keys.insert(i, key)


_last_access = operator.attrgetter("last_access")


class LRUPolicy:
    """The runtime baseline (vLLM, TensorRT-LLM): evict the least recently used."""

    name = "lru"

    def choose_victim(
        self, candidates: list[Candidate], now: float, incoming: Candidate | None = None
    ):
        if not candidates:
            return None
        return min(candidates, key=_last_access).key


@dataclass(frozen=True)
class ScorePolicy:
    """keep_score = recency + frequency + tenant priority + reload cost − size, with protections.

    A newly loaded gpu-warm adapter is protected for `min_residency_s` against newcomers outside
    the gpu warm set with less demand than it, so a one-off request cannot push out an adapter
    that is proving hot (protecting every adapter made one-offs under Zipf traffic wait up to
    that long for a slot); frequency dominates recency, so a burst of one-off adapters cycles
    through the lowest-value slot instead of the hot adapters' slots."""

    recency_s: float = 60.0
    w_recency: float = 1.0
    w_frequency: float = 2.0
    w_priority: float = 0.5
    w_cost: float = 1.0
    w_size_per_gib: float = 0.1
    w_preferred: float = 2.0
    min_residency_s: float = 1.0
    restores_gpu_warm: bool = True
    """Put an adapter of the gpu warm set back in a slot once the one-off that displaced it is
    done, when it is expected back before the slots turn over (placement decides which)."""
    spares_waiting: bool = True
    """An adapter in a slot whose request waits for admission is not evicted (it is about to be
    used): the waiting request would otherwise lose its adapter to one waiting ahead of it and
    wait for it to come back."""
    yields_for_s: float = 1.0
    """When a slot frees while requests of several adapters wait for one, a gpu-warm adapter's
    request takes it before those of adapters outside the gpu warm set that have waited less than
    this (placement decides which wait)."""
    spare_slot_wait_s: float = 1.0
    """While the gpu warm set and the gpu pins leave slots to spare, a request outside the gpu
    warm set waits up to this long for one of those slots instead of taking a gpu-warm adapter's
    (placement decides: `waits_for_spare_slot`)."""
    overdue_gaps: float = 20.0
    """An adapter silent for this many of its mean gaps between requests (over the 5-minute
    window), and for `DemandTracker.LONGEST_GAPS` of its longest, is no longer counted as
    demanded: out of the gpu and cpu warm sets, and scored without frequency. Its decayed count
    would keep it hot for many minutes after its traffic stops, holding a slot and a place in the
    gpu warm set from the adapters that took over (placement reads it)."""
    weighs_host_copies_by_use: bool = True
    """Weigh the host copy of an adapter that sits in a slot by its slot activations, not its
    requests (the copy is only needed again once the adapter loses its slot); without it such
    copies simply go last."""
    name: str = "score"

    def keep_score(self, c: Candidate, now: float) -> float:
        recency = math.exp(-max(0.0, now - c.last_access) / self.recency_s)
        return (
            self.w_recency * recency
            + self.w_frequency * math.log1p(c.demand)
            + self.w_priority * c.priority
            + self.w_cost * c.reload_cost
            - self.w_size_per_gib * c.nbytes / 2**30
            + self.w_preferred * c.warm
        )

    def choose_victim(
        self, candidates: list[Candidate], now: float, incoming: Candidate | None = None
    ):
        if (
            incoming is not None and not incoming.warm
        ):  # a gpu-warm adapter is no one-off: no protection against it
            residency, demand = self.min_residency_s, incoming.demand
            candidates = [
                c
                for c in candidates
                if not (
                    c.warm
                    and not c.restored
                    and now - c.loaded_at < residency
                    and c.demand > demand
                )
            ]
        if not candidates:
            return None
        ranks = self._ranks(candidates, now)
        return candidates[min(range(len(ranks)), key=ranks.__getitem__)].key

    def victims(self, candidates: list[Candidate], now: float):
        """The keys that choose_victim(candidates, now) would pick one after another, each pick
        taken out of the list before the next: the same picks, the candidates scored once (the
        cache drops host copies this way). A subclass that changes choose_victim must change this
        too."""
        ranks = self._ranks(candidates, now)
        left = list(range(len(ranks)))
        while left:
            i = min(
                left, key=ranks.__getitem__
            )  # as choose_victim over what is left, in the same order
            yield candidates[i].key
            left.remove(i)

    def _ranks(self, candidates: list[Candidate], now: float) -> list[tuple[float, float]]:
        # keep_score inlined (the same operations in the same order, so the same floats): an
        # eviction scores every candidate, and a simulation makes thousands of evictions.
        exp, log1p, recency_s = math.exp, math.log1p, self.recency_s
        w_r, w_f, w_p, w_c = self.w_recency, self.w_frequency, self.w_priority, self.w_cost
        w_s, w_pref = self.w_size_per_gib, self.w_preferred
        # max(0.0, age) as a comparison: the same value for every age, NaN and -0.0 included,
        # without a call.
        return [
            (
                w_r * exp(-(age if (age := now - c.last_access) > 0.0 else 0.0) / recency_s)
                + w_f * log1p(c.demand)
                + w_p * c.priority
                + w_c * c.reload_cost
                - w_s * c.nbytes / 2**30
                + w_pref * c.warm,
                c.last_access,
            )
            for c in candidates
        ]


def make_policy(name: str):
    if name == "lru":
        return LRUPolicy()
    if name == "score":
        return ScorePolicy()
    raise ValueError(f"unknown eviction policy {name!r}: use lru or score")


class LFUPolicy:
    """Least frequently used, frequency being the decayed 5-minute request count (LFU with
    aging); ties go to the least recently used. A comparison baseline for the simulator."""

    name = "lfu"

    def choose_victim(
        self, candidates: list[Candidate], now: float, incoming: Candidate | None = None
    ):
        if not candidates:
            return None
        return min(candidates, key=lambda c: (c.demand, c.last_access)).key


class GDSFPolicy:
    """Greedy-Dual-Size-Frequency (Cherkasova): evict the lowest H = L + frequency × reload cost
    / size, where L, the inflation value, rises to each victim's H so that adapters not touched
    since fall behind.

    Frequency is the decayed 5-minute request count, cost the cache's estimate of reloading it
    (`reload_cost`), size its bytes in GiB; an adapter's L is the inflation value at its last
    access. A comparison baseline for the simulator; one instance serves one cache (it keeps the
    inflation history)."""

    name = "gdsf"

    def __init__(self):
        self._times: list[float] = []
        self._values: list[float] = []

    def inflation_at(self, t: float) -> float:
        i = bisect.bisect_right(self._times, t)
        return self._values[i - 1] if i else 0.0

    def priority(self, c: Candidate) -> float:
        size_gib = max(c.nbytes, 1) / 2**30
        return (
            self.inflation_at(c.last_access)
            + max(c.demand, 1e-9) * max(c.reload_cost, 1e-6) / size_gib
        )

    def choose_victim(
        self, candidates: list[Candidate], now: float, incoming: Candidate | None = None
    ):
        if not candidates:
            return None
        victim = min(candidates, key=lambda c: (self.priority(c), c.last_access))
        h = self.priority(victim)
        if h > (self._values[-1] if self._values else 0.0):
            self._times.append(now)
            self._values.append(h)
        return victim.key
