"""The router's picker: LoRA affinity until saturated, bounded-load consistent hashing for cold
adapters.

Pure functions over plain data, so the simulator and the tests use the very code the router runs.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import random
from collections.abc import Set
from dataclasses import dataclass, field

from loraplex.settings.fields import check_fields
from loraplex.settings.router import DEFAULTS as D
from loraplex.settings.router import POLICIES, WEIGHTS, RouterSettings

AFFINITY = {"gpu": 1.0, "cpu": 0.9, "free-slot": 0.8, "loading": 0.6, "none": 0.0}


@dataclass(frozen=True)
class WorkerView:
    """What the router knows of one worker: its last polled state plus its own optimistic counts."""

    url: str
    healthy: bool = True
    fresh: bool = True
    """False when the last state is older than the staleness limit: its load and residency are
    unknown."""
    waiting: int = 0
    running: int = 0
    active_tokens: int = 0
    kv_usage: float = 0.0
    recent_evictions: int = 0
    free_slots: int = 0
    gpu: Set[str] = frozenset()
    """Names (`name`, `name@revision`) resident there; a set of any kind, read by membership."""
    cpu: Set[str] = frozenset()
    loading: Set[str] = frozenset()
    capacity: int = 0
    """The requests it runs at once (its `max_num_seqs`; 0: not reported)."""
    num_open: int = 0
    """Requests the router has open there: sent and not finished (exact, unlike the polled
    counts, which are as old as the last poll)."""
    in_flight: int = 0
    """Requests the router has open there beyond those the polled state counts (added at once, so
    a burst spreads; a finished one leaves at once, so a steady rate never looks like a queue)."""
    prefix: float = 0.0
    """The share of the request's prompt blocks routed here lately, under its adapter revision
    (`router/prefixes.py`): how much of its prefix the worker likely holds in KV."""

    @property
    def load(self) -> int:
        return (self.waiting + self.running if self.fresh else 0) + self.in_flight

    @property
    def queued(self) -> int:
        """Requests waiting there for a place to run: with a reported capacity, those its free
        places cannot take (one counted as waiting between its arrival and the worker's next step
        has a place, so it is no queue); without one, every waiting request. With the requests
        the router has open there beyond the polled counts."""
        if self.capacity > 0:
            return max(0, self.load - self.capacity)
        return (self.waiting if self.fresh else 0) + self.in_flight

    def full(self, queue_limit: int) -> bool:
        """Whether the router has as many requests open there as it runs at once plus
        `queue_limit` (never, for a limit of -1 or an unknown capacity)."""
        return (
            queue_limit >= 0 and self.capacity > 0 and self.num_open >= self.capacity + queue_limit
        )

    def affinity(self, adapter: str | None) -> str:
        if adapter is None or not self.fresh:
            return "none"
        if adapter in self.gpu:
            return "gpu"
        if adapter in self.cpu:
            return "cpu"
        if adapter in self.loading:
            return "loading"
        return "free-slot" if self.free_slots > 0 else "none"


@dataclass(frozen=True)
class PickerConfig:
    """The fields `loraplex router` sets have their help and defaults in `RouterSettings`."""

    saturation_waiting: int = D.saturation_waiting
    saturation_kv_usage: float = D.saturation_kv_usage
    w_affinity: float = 1.0
    w_queue: float = 0.5
    """Weight of queue depth, as load / saturation_waiting: at the defaults each waiting or running
    request costs 0.1, so a gpu-resident worker keeps an adapter's traffic until it carries two more
    requests than a worker that holds the adapter in cpu, or three more than one with a free slot
    (where it is a cold load from disk or the store); then the hot adapter spreads to a second
    worker instead of waiting on one."""
    w_tokens: float = 0.2
    w_evictions: float = 0.2
    w_prefix: float = 0.5
    """Weight of the share of the prompt's prefix routed to a worker lately: a worker that likely
    holds the whole prefix in KV keeps it until it carries five more requests than one that holds
    none (each costs 0.1 at the defaults: the saturation threshold), or three more when it is the
    busier by active tokens as well (0.2); 0: prefixes ignored."""
    load_factor: float = D.load_factor
    near_equal: float = 0.05
    shed_priority_below: int = D.shed_priority_below
    worker_queue_limit: int = D.worker_queue_limit
    virtual_nodes: int = 64

    def __post_init__(self):
        check_fields(self, RouterSettings)
        weights = (self.w_affinity, self.w_queue, self.w_tokens, self.w_evictions, self.w_prefix)
        if min(weights) < 0:
            raise ValueError("the score weights must be >= 0")

    @classmethod
    def from_settings(cls, s: RouterSettings) -> PickerConfig:
        return cls(
            saturation_waiting=s.saturation_waiting,
            saturation_kv_usage=s.saturation_kv_usage,
            load_factor=s.load_factor,
            shed_priority_below=s.shed_priority_below,
            worker_queue_limit=s.worker_queue_limit,
            **{WEIGHTS[name]: weight for name, weight in s.score_weights},
        )


@dataclass(frozen=True)
class Pick:
    ranking: tuple[str, ...]
    """Worker URLs, best first; the router retries on the second if the first fails before its first
    byte."""
    reason: str

    @property
    def url(self) -> str | None:
        return self.ranking[0] if self.ranking else None


@dataclass
class Picker:
    policy: str = "affinity"
    config: PickerConfig = field(default_factory=PickerConfig)
    rng: random.Random = field(default_factory=random.Random)
    _next: int = 0

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown router policy {self.policy!r}: use {', '.join(POLICIES)}")

    def pick(self, workers: list[WorkerView], adapter: str | None, priority: int = 0) -> Pick:
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            return Pick((), "no-healthy-worker")
        if self.policy == "round-robin":
            self._next += 1
            order = healthy[self._next % len(healthy) :] + healthy[: self._next % len(healthy)]
            return Pick(tuple(w.url for w in order), "round-robin")
        if self.policy == "least-loaded":
            order = sorted(healthy, key=lambda w: (w.load, w.active_tokens, self.rng.random()))
            return Pick(tuple(w.url for w in order), "least-loaded")
        if self.policy == "pure-affinity":
            order = sorted(
                healthy, key=lambda w: (-AFFINITY[w.affinity(adapter)], w.load, self.rng.random())
            )
            return Pick(tuple(w.url for w in order), f"affinity-{order[0].affinity(adapter)}")
        return self._pick_affinity(workers, healthy, adapter, priority)

    def _saturated(self, w: WorkerView) -> bool:
        c = self.config
        return w.full(c.worker_queue_limit) or (
            w.fresh and (w.queued > c.saturation_waiting or w.kv_usage > c.saturation_kv_usage)
        )

    def _pick_affinity(
        self,
        workers: list[WorkerView],
        healthy: list[WorkerView],
        adapter: str | None,
        priority: int,
    ) -> Pick:
        candidates = [w for w in healthy if not self._saturated(w)]
        fallback = not candidates
        if fallback:
            if priority < self.config.shed_priority_below:
                return Pick((), "saturated-shed")
            candidates = healthy
        # asked once per worker: a pick is per request
        tiers = {w.url: w.affinity(adapter) for w in candidates}
        best_affinity = max(tiers.values(), key=AFFINITY.__getitem__)
        cold = adapter is not None and best_affinity in ("none", "free-slot")
        if cold and not (self.config.w_prefix and any(w.prefix for w in candidates)):
            order = self._bounded_hash(workers, candidates, adapter)
            reason = "cold-hash"
        else:
            scores = self._scores(candidates, tiers)
            # On equal scores the better-placed adapter wins (no load for nothing), then chance.
            order = sorted(
                candidates,
                key=lambda w: (
                    -round(scores[w.url], 9),
                    -AFFINITY[tiers[w.url]],
                    self.rng.random(),
                ),
            )
            if priority > 0:
                # a higher-priority tenant takes the less-loaded of near-equals
                best = scores[order[0].url]
                top = [w for w in order if best - scores[w.url] <= self.config.near_equal]
                if len(top) > 1:
                    first = min(top, key=lambda w: (w.load, w.active_tokens))
                    order = [first] + [w for w in order if w is not first]
            reason = f"affinity-{tiers[order[0].url]}" if adapter else "least-loaded"
        if fallback:
            reason = "saturated-fallback"
        if len(order) == len(healthy):
            return Pick(tuple(w.url for w in order), reason)
        # by identity: comparing views field by field is most of a pick
        placed = {id(w) for w in order}
        rest = [w for w in healthy if id(w) not in placed]
        return Pick(tuple(w.url for w in order + rest), reason)

    def _scores(self, workers: list[WorkerView], tiers: dict[str, str]) -> dict[str, float]:
        """Each worker's score by url, given its affinity tier for the adapter."""
        c = self.config

        def norm(values):
            top = max(values) or 1
            return [v / top for v in values]

        saturation_waiting = max(1, c.saturation_waiting)
        queue = [w.load / saturation_waiting for w in workers]
        tokens = norm([w.active_tokens if w.fresh else 0 for w in workers])
        evictions = norm([w.recent_evictions if w.fresh else 0 for w in workers])
        return {
            w.url: c.w_affinity * AFFINITY[tiers[w.url]]
            + c.w_prefix * w.prefix
            - c.w_queue * q
            - c.w_tokens * t
            - c.w_evictions * e
            for w, q, t, e in zip(workers, queue, tokens, evictions)
        }

    def _bounded_hash(
        self, workers: list[WorkerView], candidates: list[WorkerView], adapter: str
    ) -> list[WorkerView]:
        """Consistent hashing with bounded load: walk the ring from the adapter's point, skipping
        workers above load_factor × the mean load, so one cold adapter keeps landing on the same one
        or two workers. The ring is every worker's (built once per fleet): walking it past those
        that are no candidates gives the order the candidates' own ring would."""
        points, urls = _ring(tuple(w.url for w in workers), self.config.virtual_nodes)
        by_url = {w.url: w for w in candidates}
        mean = (sum(w.load for w in candidates) + 1) / len(candidates)
        cap = max(1.0, self.config.load_factor * mean)
        start = bisect.bisect_left(points, _hash(adapter))
        seen: dict[str, WorkerView] = {}  # ring order, each candidate once
        for url in itertools.chain(itertools.islice(urls, start, None), urls[:start]):
            if url in by_url and url not in seen:
                seen[url] = by_url[url]
                if len(seen) == len(by_url):
                    break
        order = list(seen.values())
        within = [w for w in order if w.load + 1 <= cap]
        if len(within) == len(order):
            return order
        placed = {id(w) for w in within}
        return within + [w for w in order if id(w) not in placed]


@functools.lru_cache(maxsize=64)
def _ring(urls: tuple[str, ...], virtual_nodes: int) -> tuple[list[int], list[str]]:
    """The hash ring of a fleet's workers, as its points and the worker at each (built once per
    fleet: fleets change rarely, cold picks are frequent)."""
    ring = sorted((_hash(f"{url}#{i}"), url) for url in set(urls) for i in range(virtual_nodes))
    return [point for point, _ in ring], [url for _, url in ring]


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
