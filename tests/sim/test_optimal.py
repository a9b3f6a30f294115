"""The offline optimum against brute force on small traces."""

import functools
import random

import pytest

from loraplex.sim.optimal import (
    OraclePolicy,
    belady_misses,
    gap,
    lp_miss_cost,
    next_uses,
)


def brute_force(seq, sizes, costs, capacity):
    """Least summed miss cost over every eviction choice (any subset may be dropped at any miss)."""
    items = sorted(set(seq))

    @functools.cache
    def best(t, cached):
        if t == len(seq):
            return 0.0
        item = seq[t]
        if item in cached:
            return best(t + 1, cached)
        pool = [i for i in cached]
        options = []
        for mask in range(1 << len(pool)):
            kept = frozenset(pool[j] for j in range(len(pool)) if mask >> j & 1) | {item}
            if sum(sizes[i] for i in kept) <= capacity:
                options.append(best(t + 1, kept))
        return costs[item] + min(options)

    assert items
    return best(0, frozenset())


def random_trace(rng, n_items, length):
    return [rng.randrange(n_items) for _ in range(length)]


def test_next_uses():
    assert next_uses(list("abca")) == [3, 4, 4, 4]


@pytest.mark.parametrize("seed", range(30))
def test_belady_is_optimal_for_unit_sizes(seed):
    rng = random.Random(seed)
    seq = random_trace(rng, rng.randint(2, 6), rng.randint(1, 14))
    capacity = rng.randint(1, 4)
    ones = {i: 1 for i in seq}
    assert sum(belady_misses(seq, capacity)) == brute_force(seq, ones, ones, capacity)


@pytest.mark.parametrize("seed", range(30))
def test_interval_lp_is_exact_for_unit_sizes_with_weights(seed):
    rng = random.Random(100 + seed)
    seq = random_trace(rng, rng.randint(2, 6), rng.randint(1, 14))
    capacity = rng.randint(1, 4)
    ones = {i: 1 for i in seq}
    costs = {i: rng.choice([0.5, 1.0, 3.0, 7.0]) for i in seq}
    assert lp_miss_cost(seq, ones, costs, capacity) == pytest.approx(
        brute_force(seq, ones, costs, capacity)
    )


@pytest.mark.parametrize("seed", range(30))
def test_interval_lp_bounds_variable_sizes_from_below(seed):
    rng = random.Random(200 + seed)
    seq = random_trace(rng, rng.randint(2, 6), rng.randint(1, 13))
    sizes = {i: rng.choice([1, 2, 3]) * 10**8 for i in seq}  # bytes-like magnitudes
    capacity = max(sizes.values()) + rng.choice([0, 1, 2, 3]) * 10**8
    costs = {i: 0.05 + sizes[i] / 2e8 for i in seq}
    optimum = brute_force(seq, sizes, costs, capacity)
    bound = lp_miss_cost(seq, sizes, costs, capacity)
    compulsory = sum(costs[i] for i in set(seq))
    assert compulsory - 1e-9 <= bound <= optimum + 1e-9


def test_lp_with_room_for_everything_is_the_compulsory_cost():
    seq = list("abcabcab")
    sizes = {i: 10**9 for i in "abc"}
    costs = {"a": 1.0, "b": 2.0, "c": 3.0}
    assert lp_miss_cost(seq, sizes, costs, 3 * 10**9) == pytest.approx(6.0)
    assert lp_miss_cost(seq, sizes, costs, 10**9) == pytest.approx(sum(costs[i] for i in seq))


def test_oracle_evicts_the_adapter_needed_last():
    class C:
        def __init__(self, key, nbytes=1):
            self.key, self.nbytes = key, nbytes

    future = {"a": 5.0, "b": 9.0, "c": float("inf"), "d": 1.0}
    oracle = OraclePolicy(future.get)
    assert oracle.choose_victim([C("a"), C("b"), C("d")], now=0) == "b"
    assert oracle.choose_victim([C("a"), C("c")], now=0) == "c"
    assert oracle.choose_victim([], now=0) is None


def test_gap():
    assert gap(110.0, 100.0) == pytest.approx(0.1)
    assert gap(0.0, 0.0) == 0.0


def test_the_bound_holds_when_queued_requests_are_admitted_together():
    """Overloaded (20 requests/s over 12 adapters on 4 slots): requests of one adapter queue up and
    are admitted together, with one load, so the runs pay less (10.7 s) than the bound on the
    arrival order (13.7 s). The reported bound is then the least of the bounds on the orders the
    runs admitted, below every run's cost."""
    from loraplex.sim import workload as W
    from loraplex.sim.report import compare
    from loraplex.sim.simulator import SimConfig

    trace = W.generate(W.WorkloadSpec(name="t", seed=0, duration_s=60, rate=20, num_adapters=12))
    entries = compare(trace, SimConfig(gpu_slots=4, cpu_bytes=8 * 2**30), ["lru", "score"])
    optimal = entries["optimal"]
    assert optimal["lower_bound"]["order"] == "admission"
    for entry in entries.values():
        assert entry.get("miss_cost_oracle", entry["miss_cost"]) >= optimal["miss_cost"]
        assert entry["gap"] >= 0
