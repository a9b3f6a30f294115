"""The offline optimum: Belady's MIN for the gpu slots, a lower bound for the whole hierarchy, and
an oracle.

The reference string is the trace's adapter requests in arrival order, every cache starting empty.

- `belady_misses`: MIN (evict the item whose next request is farthest), optimal for unit sizes and
  costs.
- `lp_miss_cost`: the interval LP of generalized caching (Bar-Noy et al.) solved as a min-cost flow:
  item intervals between consecutive requests are kept fractionally. For unit sizes the constraint
  matrix is an interval matrix (totally unimodular), so the LP optimum is the exact optimum of
  weighted paging; for variable sizes it is a lower bound.
- `lower_bound`: the cost of a schedule splits into levels: every activation pays a host-to-device
  copy (level gpu, S slots), every load into host memory pays a disk read (level gpu+cpu, at most
  cpu_bytes plus what the slots hold), every download pays the remote store (level gpu+cpu+disk).
  Each level's cost is at least its own optimum, so the sum of the levels' LP bounds is a lower
  bound of the optimal miss cost.
- `OraclePolicy`: farthest-next-use eviction inside the real cache, so the simulator can show an
  achievable schedule's TTFT next to the bound (its miss cost is an upper bound of the optimum).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Sequence

import numpy as np


def next_uses(seq: Sequence[Hashable]) -> list[int]:
    """For each position, the position of the next request of the same item (len(seq) when none)."""
    out, last = [0] * len(seq), {}
    for t in range(len(seq) - 1, -1, -1):
        out[t] = last.get(seq[t], len(seq))
        last[seq[t]] = t
    return out


def belady_misses(seq: Sequence[Hashable], capacity: int) -> list[bool]:
    """Per request, whether MIN misses it with `capacity` unit-size slots."""
    if capacity < 1:
        return [True] * len(seq)
    nxt = next_uses(seq)
    cached: dict[Hashable, int] = {}  # item -> its next request
    heap: list[tuple[int, int]] = []  # (-next request, t) with lazy deletion
    misses = []
    for t, item in enumerate(seq):
        hit = item in cached
        misses.append(not hit)
        if not hit and len(cached) >= capacity:
            while True:
                neg, at = heapq.heappop(heap)
                victim = seq[at]
                if cached.get(victim) == -neg:
                    del cached[victim]
                    break
        cached[item] = nxt[t]
        heapq.heappush(heap, (-nxt[t], t))
    return misses


def lp_miss_cost(seq: Sequence[Hashable], sizes: dict, costs: dict, capacity: float) -> float:
    """Least summed miss cost of a cache of `capacity` (in the unit of `sizes`) over `seq`, by the
    interval LP.

    Network form: nodes 0..T, a chain arc per request t (node t → t+1) carrying the capacity not
    used by kept intervals, at least the requested item's size; an arc per interval between
    consecutive requests of an item (node s+1 → node e) carrying the kept amount y ∈ [0, size] and
    earning cost/size per unit kept. Flow C leaves node 0 and reaches node T, so at each request the
    kept intervals spanning it hold at most C − size(requested item).
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_array

    T = len(seq)
    if T == 0:
        return 0.0
    seen, intervals, compulsory = {}, [], 0.0
    for t, item in enumerate(seq):
        if item in seen:
            s = seen[item]
            if t > s + 1:
                intervals.append((s + 1, t, item))
        else:
            compulsory += costs[item]
        seen[item] = t
    if not intervals:
        return compulsory
    # sizes of order 1: the solver's tolerances are absolute
    scale = max(sizes[item] for item in seen)
    sizes = {item: sizes[item] / scale for item in seen}
    capacity = capacity / scale
    n_int = len(intervals)
    rows = np.empty(2 * (n_int + T), dtype=np.int64)
    cols = np.empty_like(rows)
    vals = np.empty(2 * (n_int + T), dtype=float)
    src = np.array([a for a, _, _ in intervals] + list(range(T)))
    dst = np.array([b for _, b, _ in intervals] + list(range(1, T + 1)))
    var = np.arange(n_int + T)
    rows[0::2], cols[0::2], vals[0::2] = dst, var, 1.0  # inflow at the arc's head
    rows[1::2], cols[1::2], vals[1::2] = src, var, -1.0  # outflow at its tail
    a_eq = coo_array((vals, (rows, cols)), shape=(T + 1, n_int + T)).tocsr()
    b_eq = np.zeros(T + 1)
    b_eq[0], b_eq[T] = -capacity, capacity
    widths = np.array([sizes[item] for _, _, item in intervals], dtype=float)
    gains = np.array([costs[item] for _, _, item in intervals], dtype=float) / widths
    c = np.concatenate([-gains, np.zeros(T)])
    floor = np.minimum([sizes[item] for item in seq], capacity)
    bounds = np.concatenate(
        [np.stack([np.zeros(n_int), widths], 1), np.stack([floor, np.full(T, capacity)], 1)]
    )
    res = linprog(c, A_eq=a_eq, b_eq=b_eq, bounds=bounds, method="highs")
    if res.status != 0:
        raise RuntimeError(f"interval LP failed: {res.message}")
    repeat_cost = sum(costs[item] for _, _, item in intervals)
    return compulsory + repeat_cost + float(res.fun)


def lower_bound(
    seq: Sequence[Hashable],
    nbytes: dict,
    *,
    gpu_slots: int,
    cpu_bytes: int,
    max_cpu_loras: int | None,
    disk_bytes: int | None,
    local: bool,
    costs,
) -> dict:
    """Lower bound of the optimal miss cost (seconds) of the hierarchy, per level and in total.

    `costs` is a simulator `LoadCosts`; `seq` are the requested keys in arrival order; `nbytes`
    their sizes."""
    items = set(seq)
    h2d = {k: costs.h2d.seconds(nbytes[k]) for k in items}
    disk = {k: costs.disk.seconds(nbytes[k]) for k in items}
    remote = {k: costs.remote.seconds(nbytes[k]) for k in items}
    ones = {k: 1 for k in items}
    largest = sorted((nbytes[k] for k in items), reverse=True)
    slot_bytes = sum(largest[:gpu_slots])
    parts = {"gpu": lp_miss_cost(seq, ones, h2d, gpu_slots)}
    memory = cpu_bytes + slot_bytes
    if memory >= sum(nbytes[k] for k in items):
        parts["cpu"] = sum(disk.values())
    else:
        parts["cpu"] = lp_miss_cost(seq, nbytes, disk, memory)
        if max_cpu_loras is not None:
            parts["cpu"] = max(
                parts["cpu"], lp_miss_cost(seq, ones, disk, max_cpu_loras + gpu_slots)
            )
    if local:
        parts["disk"] = 0.0
    elif disk_bytes is None or disk_bytes + memory >= sum(nbytes[k] for k in items):
        parts["disk"] = sum(remote.values())
    else:
        parts["disk"] = lp_miss_cost(seq, nbytes, remote, disk_bytes + memory)
    misses = belady_misses(seq, gpu_slots)
    return {
        "miss_cost": sum(parts.values()),
        "parts": parts,
        "gpu_misses_min": sum(misses),
        "gpu_hit_rate_max": 1 - sum(misses) / len(seq) if seq else 1.0,
    }


class OraclePolicy:
    """Evict the adapter needed farthest in the future (Belady), tie-broken by size: an offline
    policy that only a simulator can run, giving an achievable schedule beside the lower bound."""

    name = "optimal"
    restores_gpu_warm = False

    def __init__(self, next_use):
        self.next_use = next_use

    def choose_victim(self, candidates, now: float, incoming=None):
        if not candidates:
            return None
        return max(candidates, key=lambda c: (self.next_use(c.key), c.nbytes, str(c.key))).key


def gap(cost: float, optimum: float) -> float:
    """Relative distance of a miss cost from the optimum's (0.1 = 10% above)."""
    if optimum <= 0:
        return 0.0 if cost <= 0 else math.inf
    return cost / optimum - 1


class PopularityOracle:
    """A0: evict the adapter with the fewest requests over the whole trace. Under independent
    requests it is the best an online policy can do (it knows the true popularity, nothing of the
    order), so it shows how much of a policy's gap to the offline optimum any online policy must
    pay."""

    name = "a0"
    restores_gpu_warm = False

    def __init__(self, requests: dict):
        self.requests = requests

    def choose_victim(self, candidates, now: float, incoming=None):
        if not candidates:
            return None
        return min(candidates, key=lambda c: (self.requests.get(c.key, 0), c.last_access)).key
