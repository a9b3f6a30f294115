"""The placement controller's policy: from the fleet's demand, how many workers each hot adapter
is warm on and which ones, as a list of moves (place, release) to apply in order.

Pure over plain data, apart from three pieces of memory that make it steady: a token bucket on
`now` that bounds the moves per hour, the time each placement was made, so that a placement
stays at least `min_dwell_s`, and since when each adapter has been hot, so that one is placed
only after `min_hot_s`. The same calls in the same order give the same moves.

One `plan` does, in this order, while the bucket has tokens:
1. releases placements of adapters no longer registered;
2. drains: each adapter placed on a draining worker is placed elsewhere, then released from it;
3. places each hot adapter (one placed nowhere: hot for `min_hot_s`), hottest first, until it is
   on its target number of workers (a dead worker's placements are gone from the view, so its
   adapters come back here), making room on a full worker by releasing a placement that is no
   longer wanted;
4. releases placements no longer wanted (cold adapters, replicas over the target);
5. rebalances hotspots: a worker whose placed demand is above `hotspot_ratio` times the fleet's
   mean, and above what one replica serves, hands one adapter to the least loaded worker that
   may take it, as long as that leaves neither worker above the other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from loraplex.placement.fleet import Fleet, placeable_slots
from loraplex.placement.records import AdapterView, Move, WorkerView

__all__ = ["AdapterView", "Move", "PlacementPolicy", "WorkerView", "fleet_demand"]


def fleet_demand(workers: Iterable[WorkerView]) -> dict[str, float]:
    """Adapter key -> requests per second over the whole fleet (the sum of the windows)."""
    total: dict[str, float] = {}
    for w in workers:
        for key, rps in w.demand.items():
            total[key] = total.get(key, 0.0) + rps
    return total


class PlacementPolicy:
    def __init__(
        self,
        *,
        max_replicas: int = 4,
        per_replica_rps: float = 8.0,
        max_moves_per_hour: int = 600,
        burst: int | None = None,
        min_rps: float = 0.05,
        release_ratio: float = 0.5,
        hysteresis: float = 0.25,
        min_dwell_s: float = 300.0,
        min_hot_s: float = 0.0,
        hotspot_ratio: float = 1.5,
        placed_slot_share: float = 0.75,
        min_free_slots: int = 2,
        tenant_budgets: Mapping[str, int] | None = None,
    ):
        """`per_replica_rps`: the requests per second one warm worker serves for one adapter;
        `burst`: the bucket's size (default a tenth of the hourly bound, at least 1): moves in
        any hour stay within `max_moves_per_hour + burst`; `min_rps`: the demand that makes an
        adapter hot, and `release_ratio` of it the demand under which a placed one is released;
        `hysteresis`: the share a demand must move past a replica count before the count
        changes; `min_hot_s`: how long an adapter placed nowhere stays at `min_rps` or more
        before it is placed (a window's few requests swing it across the threshold and back);
        `placed_slot_share`: the share of a worker's slots placement may fill, the rest left to
        the worker's own residency; `min_free_slots`: the slots of each worker placement
        leaves unpinned whatever the share (the adapters placed nowhere share them, and the
        worker's residency keeps a newly loaded one for a second against less demanded ones, so
        with one such slot their requests wait in turn), except that a worker of two or more
        slots always takes one placement (`placeable_slots`); `tenant_budgets`: tenant -> most
        placements."""
        if max_replicas < 1:
            raise ValueError("max_replicas must be at least 1")
        if per_replica_rps <= 0 or min_rps <= 0:
            raise ValueError("per_replica_rps and min_rps must be positive")
        if max_moves_per_hour < 0:
            raise ValueError("max_moves_per_hour must be at least 0")
        if not 0 < placed_slot_share <= 1 or not 0 <= release_ratio <= 1:
            raise ValueError("placed_slot_share must be in (0, 1], release_ratio in [0, 1]")
        if min_free_slots < 1:
            raise ValueError("min_free_slots must be at least 1 (the engines keep one slot free)")
        if hysteresis < 0 or hotspot_ratio < 1 or min_hot_s < 0:
            raise ValueError("hysteresis, min_hot_s must be at least 0, hotspot_ratio at least 1")
        self.max_replicas = max_replicas
        self.per_replica_rps = per_replica_rps
        self.max_moves_per_hour = max_moves_per_hour
        self.burst = max(1, max_moves_per_hour // 10) if burst is None else burst
        self.min_rps = min_rps
        self.release_ratio = release_ratio
        self.hysteresis = hysteresis
        self.min_dwell_s = min_dwell_s
        self.min_hot_s = min_hot_s
        self.hotspot_ratio = hotspot_ratio
        self.placed_slot_share = placed_slot_share
        self.min_free_slots = min_free_slots
        self.tenant_budgets = dict(tenant_budgets or {})
        self.tokens = float(self.burst)
        self._refilled_at: float | None = None
        self._placed_at: dict[tuple[str, str], float] = {}
        self._hot_since: dict[str, float] = {}

    def placeable_slots(self, slots: int) -> int:
        """How many placements a worker of `slots` device slots takes."""
        return placeable_slots(slots, self.placed_slot_share, self.min_free_slots)

    def target(self, rps: float, current: int) -> int:
        """How many workers an adapter with `rps` of demand should be warm on, now on `current`:
        1..max_replicas in proportion to its demand, 0 when cold, unchanged for small moves."""
        if rps < self.min_rps * (self.release_ratio if current else 1.0):
            return 0
        raw = rps / self.per_replica_rps
        if current == 0 or raw > current * (1 + self.hysteresis):
            want = math.ceil(raw)
        else:
            want = min(current, math.ceil(raw * (1 + self.hysteresis)))
        return max(1, min(self.max_replicas, want))

    def plan(
        self, workers: Sequence[WorkerView], adapters: Mapping[str, AdapterView], now: float
    ) -> list[Move]:
        """The moves to apply, in order: each place before the release it stands in for."""
        self._refill(now)
        names = {w.name for w in workers}
        self._placed_at = {kw: t for kw, t in self._placed_at.items() if kw[1] in names}
        demand = fleet_demand(workers)
        fleet = Fleet(
            workers,
            adapters,
            demand,
            self.placed_slot_share,
            self.tenant_budgets,
            self.min_free_slots,
        )
        self._hot_since = {
            k: self._hot_since.get(k, now) for k, rps in demand.items() if rps >= self.min_rps
        }
        targets = {
            k: self.target(demand.get(k, 0.0), fleet.replicas(k))
            if fleet.replicas(k) or self._hot_long_enough(k, now)
            else 0
            for k in set(fleet.registered()) | fleet.placed_keys()
            if k in adapters
        }
        moves: list[Move] = []
        self._forget_unregistered(fleet, moves, now)
        self._drain(fleet, targets, moves, now)
        self._fill(fleet, targets, moves, now)
        self._shrink(fleet, targets, moves, now)
        self._rebalance(fleet, moves, now)
        return moves

    def _refill(self, now: float) -> None:
        if self._refilled_at is not None and now > self._refilled_at:
            rate = self.max_moves_per_hour / 3600.0
            self.tokens = min(self.burst, self.tokens + (now - self._refilled_at) * rate)
        if self._refilled_at is None or now > self._refilled_at:
            self._refilled_at = now

    def _spend(self, n: int) -> bool:
        if self.tokens < n:
            return False
        self.tokens -= n
        return True

    def _hot_long_enough(self, key: str, now: float) -> bool:
        """Whether `key`'s demand has stood at `min_rps` or more for `min_hot_s`."""
        since = self._hot_since.get(key)
        return since is not None and now - since >= self.min_hot_s

    def _settled(self, key: str, worker: str, now: float) -> bool:
        """Whether a placement has stood long enough to be moved for load or demand."""
        placed_at = self._placed_at.get((key, worker))
        return placed_at is None or (placed_at < now and now - placed_at >= self.min_dwell_s)

    def _forget_unregistered(self, fleet: Fleet, moves: list[Move], now: float) -> None:
        for w in fleet.live():
            for key in sorted(fleet.placed_on(w.name) - fleet.adapters.keys()):
                if not self._spend(1):
                    return
                self._move(fleet, moves, Move("release", key, w.name), now)

    def _drain(
        self, fleet: Fleet, targets: Mapping[str, int], moves: list[Move], now: float
    ) -> None:
        for w in fleet.draining():
            placed = sorted(fleet.placed_on(w.name), key=lambda k: (-fleet.demand.get(k, 0.0), k))
            for key in placed:
                wanted = fleet.replicas(key) < targets.get(key, 0)
                spot = fleet.best_worker(key) if wanted else None
                if not self._spend(1 + (spot is not None)):
                    return
                if spot is not None:
                    self._move(fleet, moves, Move("place", key, spot), now)
                self._move(fleet, moves, Move("release", key, w.name), now)

    def _fill(self, fleet: Fleet, targets: Mapping[str, int], moves: list[Move], now: float):
        hot = [k for k, t in targets.items() if t > fleet.replicas(k)]
        hot.sort(key=lambda k: (-fleet.demand.get(k, 0.0), k))
        full: set[tuple[str, int, str | None]] = set()  # (base, rank, tenant) with no room left
        for key in hot:
            a = fleet.adapters[key]
            while fleet.replicas(key) < targets[key] and (a.base, a.rank, a.tenant) not in full:
                if self.tokens < 1:
                    return
                spot, victim = fleet.best_worker(key), None
                if spot is None:
                    spot, victim = self._room_by_release(fleet, key, targets, now)
                if spot is None:
                    full.add((a.base, a.rank, a.tenant))
                    break
                if not self._spend(1 + (victim is not None)):
                    return
                if victim is not None:
                    self._move(fleet, moves, Move("release", victim, spot), now)
                self._move(fleet, moves, Move("place", key, spot), now)

    def _room_by_release(
        self, fleet: Fleet, key: str, targets: Mapping[str, int], now: float
    ) -> tuple[str | None, str | None]:
        """A worker that can take `key` once one placement leaves it, and that one: a placement no
        longer wanted, else a settled one whose holders each serve less than `key`'s would by more
        than the hysteresis, so that the placed set follows the hottest adapters, not those that
        were hot first."""
        share = fleet.demand.get(key, 0.0) / (fleet.replicas(key) + 1)
        for colder in (False, True):
            for name in fleet.candidates(key, ignore_room=True):
                placed = sorted(fleet.placed_on(name), key=lambda k: (fleet.demand.get(k, 0.0), k))
                for victim in placed:
                    if colder:
                        gives_way = fleet.share(victim) * (1 + self.hysteresis) < share
                    else:
                        gives_way = fleet.replicas(victim) > targets.get(victim, 0)
                    settled = self._settled(victim, name, now)
                    if gives_way and settled and fleet.has_room(key, name, victim):
                        return name, victim
        return None, None

    def _shrink(self, fleet: Fleet, targets: Mapping[str, int], moves: list[Move], now: float):
        placed = sorted(fleet.placed_keys(), key=lambda k: (fleet.demand.get(k, 0.0), k))
        for key in placed:
            for name in fleet.most_loaded_holders(key):
                if fleet.replicas(key) <= targets.get(key, 0):
                    break
                if self.tokens < 1:
                    return
                if self._settled(key, name, now) and self._spend(1):
                    self._move(fleet, moves, Move("release", key, name), now)

    def _rebalance(self, fleet: Fleet, moves: list[Move], now: float) -> None:
        mean = fleet.mean_load()
        if mean <= 0:
            return
        # a worker whose placed demand one replica's worth could serve is never a hotspot
        for name in fleet.hot_workers(max(self.hotspot_ratio * mean, self.per_replica_rps)):
            load = fleet.load(name)
            for key in fleet.shares_by_size(name):
                share = fleet.share(key)
                if share > load - mean or not self._settled(key, name, now):
                    continue
                below = min(self.hotspot_ratio * mean, load - share) - share
                spot = fleet.best_worker(key, below=below)
                if spot is None:
                    continue
                if not self._spend(2):
                    return
                self._move(fleet, moves, Move("place", key, spot), now)
                self._move(fleet, moves, Move("release", key, name), now)
                break

    def _move(self, fleet: Fleet, moves: list[Move], move: Move, now: float) -> None:
        if move.kind == "place":
            fleet.place(move.adapter, move.worker)
            self._placed_at[(move.adapter, move.worker)] = now
        else:
            fleet.release(move.adapter, move.worker)
            self._placed_at.pop((move.adapter, move.worker), None)
        moves.append(move)
