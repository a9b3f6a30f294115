"""`simulate --routing`: the fleet routed by today's router, by the router honouring the placement
controller's placements, or by an emulation of the llm-d EPP's default scorer profile.

- `router`: `loraplex router`'s picker (affinity until saturated, bounded-load hashing for cold
  adapters), as `Simulation` runs it.
- `controller`: every `interval_s` the placement controller reads each worker's demand window
  (the requests routed to it over the last `window_s`), runs `PlacementPolicy.plan` and applies
  its moves through the workers' caches as the admin API does (place: pin to cpu and prewarm
  into a slot; release: unpin). The router sends a placed adapter's request to the least loaded
  of its placed workers that holds it warm (`Controller.pick`), and every other request as
  `router` does.
- `epp`: `loraplex.sim.epp`, the EPP's scorers over the same workers.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from loraplex.placement.policy import AdapterView, Move, PlacementPolicy
from loraplex.placement.policy import WorkerView as PlacedWorker
from loraplex.residency.errors import CapacityExceeded
from loraplex.sim.config import ROUTINGS

BASE = "sim-base"


@dataclass(frozen=True)
class ControllerConfig:
    interval_s: float = 10.0
    """How often the controller plans."""
    window_s: float = 60.0
    """The demand window: requests routed to a worker over this long, as requests per second."""
    host_share: float = 0.5
    """The share of a worker's host cache placements may fill."""
    max_replicas: int = 4
    per_replica_rps: float = 4.0
    max_moves_per_hour: int = 3600
    burst: int | None = None
    min_rps: float = 0.1
    min_dwell_s: float = 60.0
    min_hot_s: float = 0.0
    """How long an adapter placed nowhere stays hot before it is placed."""
    release_ratio: float = 0.5
    """A placed adapter is released under this share of `min_rps`."""
    spill_waiting: int = 20
    """A placed worker with more requests waiting than this (its own, and the router's open beyond
    those it runs) is passed over. Four times the picker's saturation: requests waiting there are
    mostly other adapters' loads, and a placed worker holds this adapter warm."""

    def policy(self) -> PlacementPolicy:
        return PlacementPolicy(
            max_replicas=self.max_replicas,
            per_replica_rps=self.per_replica_rps,
            max_moves_per_hour=self.max_moves_per_hour,
            burst=self.burst,
            min_rps=self.min_rps,
            min_dwell_s=self.min_dwell_s,
            min_hot_s=self.min_hot_s,
            release_ratio=self.release_ratio,
        )


class Controller:
    """The placement controller over a simulated fleet, and the placements the router honours."""

    def __init__(self, sim: Any, config: ControllerConfig):
        """`sim`: the `Simulation` it places on (`sim/simulator.py` holds the controller)."""
        self.sim, self.config = sim, config
        self.policy = config.policy()
        n = len(sim.workers)
        self.buckets: list[deque[Counter]] = [deque([Counter()]) for _ in range(n)]
        self.placed: dict[str, set[int]] = {}
        self.placed_on: list[set[str]] = [set() for _ in range(n)]
        self.moves: Counter = Counter()
        self.log: list[tuple[float, Move]] = []
        """Each move applied, with its time."""
        self.turns: Counter = Counter()
        self.refused = 0
        ranks: dict[str, int] = {}
        for r in sim.trace:
            if r.model is not None:
                ranks[r.model] = r.rank
        self.max_rank = max(ranks.values(), default=1)
        self.adapters = {
            m: AdapterView(m, BASE, rank, sim.nbytes[sim.refs[m].key], None)
            for m, rank in ranks.items()
        }

    def record(self, worker: int, model: str) -> None:
        self.buckets[worker][-1][model] += 1

    def demand(self, worker: int) -> dict[str, float]:
        total: Counter = Counter()
        for bucket in self.buckets[worker]:
            total.update(bucket)
        # over the whole window from the start too: a first request is no rate
        return {m: count / self.config.window_s for m, count in total.items()}

    def view(self, i: int) -> PlacedWorker:
        c = self.sim.config
        return PlacedWorker(
            self.sim.workers[i].url,
            "default",
            BASE,
            self.max_rank,
            c.gpu_slots,
            int(c.cpu_bytes * self.config.host_share),
            placed=frozenset(self.placed_on[i]),
            demand=self.demand(i),
        )

    def tick(self, _) -> None:
        sim = self.sim
        views = [self.view(i) for i in range(len(sim.workers))]
        for move in self.policy.plan(views, self.adapters, sim.now):
            index = int(move.worker.rsplit("-", 1)[1])
            if (self._place if move.kind == "place" else self._release)(move.adapter, index):
                self.log.append((sim.now, move))
        keep = max(1, math.ceil(self.config.window_s / self.config.interval_s))
        for buckets in self.buckets:
            buckets.append(Counter())
            while len(buckets) > keep:
                buckets.popleft()
        if sim.next_arrival_time() < math.inf:
            sim.schedule(sim.now + self.config.interval_s, self.tick, None)

    def _place(self, model: str, index: int) -> bool:
        worker, ref = self.sim.workers[index], self.sim.refs[model]
        try:
            worker.cache.pin(ref, "cpu")
        except CapacityExceeded:
            self.refused += 1
            return False
        worker.cache.prewarm(ref, "gpu")
        self.placed.setdefault(model, set()).add(index)
        self.placed_on[index].add(model)
        self.moves["place"] += 1
        return True

    def _release(self, model: str, index: int) -> bool:
        self.sim.workers[index].cache.unpin(self.sim.refs[model].key)
        self.placed.get(model, set()).discard(index)
        self.placed_on[index].discard(model)
        self.moves["release"] += 1
        return True

    def pick(self, model: str) -> int | None:
        """The least loaded placed worker of `model` that holds it warm and has no more than
        `spill_waiting` requests waiting, equals in turn (None: the router's picker decides)."""
        holders = self.placed.get(model)
        if not holders:
            return None
        views, open_ = self.sim.views(), self.sim.open
        spill = self.config.spill_waiting
        loads = {}
        for i in sorted(holders):
            v = views[i]
            in_flight = max(0, open_[i] - v.waiting - v.running)
            warm = model in v.gpu or model in v.cpu  # a placement counts once its load landed
            if warm and v.waiting + in_flight <= spill:
                loads[i] = v.waiting + v.running + in_flight
        if not loads:
            return None
        least = min(loads.values())
        equals = [i for i, load in loads.items() if load == least]
        self.turns[model] += 1
        return equals[self.turns[model] % len(equals)]


__all__ = ["ROUTINGS", "ControllerConfig", "Controller"]
