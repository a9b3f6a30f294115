"""The placement policy: replica counts from the fleet's demand, eligibility, packing, drains,
dead workers, hotspots, the moves-per-hour bound and hysteresis."""

import random

import pytest

from loraplex.placement.cli import policy_of
from loraplex.placement.policy import (
    AdapterView,
    Move,
    PlacementPolicy,
    WorkerView,
    fleet_demand,
)
from loraplex.settings.placement import PlacementSettings

MB = 1 << 20


def worker(name, pool="p", base="llama", max_rank=16, slots=8, host_bytes=64 * MB, **kw):
    return WorkerView(name, pool, base, max_rank, slots, host_bytes, **kw)


def adapter(key, base="llama", rank=8, nbytes=4 * MB, tenant=None):
    return AdapterView(key, base, rank, nbytes, tenant)


def apply(workers, moves):
    """The workers as they are once the controller applied `moves`."""
    placed = {w.name: set(w.placed) for w in workers}
    for m in moves:
        (placed[m.worker].add if m.kind == "place" else placed[m.worker].discard)(m.adapter)
    return [WorkerView(**{**w.__dict__, "placed": frozenset(placed[w.name])}) for w in workers]


def holders(workers, key):
    return sorted(w.name for w in workers if key in w.placed)


def test_target_is_proportional_bounded_and_steady():
    p = PlacementPolicy(max_replicas=4, per_replica_rps=10.0, min_rps=1.0, hysteresis=0.25)
    assert [p.target(rps, 0) for rps in (0.5, 1.0, 10.0, 10.1, 35.0, 500.0)] == [0, 1, 1, 2, 4, 4]
    assert p.target(24.0, 2) == 2  # up only past 2 * 1.25 replicas' worth
    assert p.target(26.0, 2) == 3
    assert p.target(9.0, 2) == 2  # down only once 1.25x the demand fits fewer
    assert p.target(7.0, 2) == 1
    assert p.target(0.6, 1) == 1  # placed: released under half the hot threshold
    assert p.target(0.4, 1) == 0


def test_fleet_demand_sums_the_windows():
    ws = [worker("a", demand={"x@1": 1.5, "y@1": 2.0}), worker("b", demand={"x@1": 0.5})]
    assert fleet_demand(ws) == {"x@1": 2.0, "y@1": 2.0}


def test_hot_adapter_goes_on_as_many_workers_as_its_demand_asks():
    ws = [worker(f"w{i}") for i in range(6)]
    ws[0] = worker("w0", demand={"hot@1": 25.0, "warm@1": 5.0, "cold@1": 0.01})
    ads = {k: adapter(k) for k in ("hot@1", "warm@1", "cold@1")}
    moves = PlacementPolicy(per_replica_rps=10.0, min_rps=1.0).plan(ws, ads, now=0.0)
    after = apply(ws, moves)
    assert len(holders(after, "hot@1")) == 3
    assert holders(after, "warm@1") == ["w0"]  # where its traffic already goes
    assert holders(after, "cold@1") == []
    assert all(m.kind == "place" for m in moves)


def test_only_eligible_workers_and_the_lowest_rank_that_serves():
    ws = [
        worker("other-base", base="qwen", max_rank=64),
        worker("rank8", max_rank=8),
        worker("rank64", max_rank=64),
        worker("rank16", max_rank=16),
        worker("tenant-b", max_rank=64, tenants=frozenset({"b"})),
        worker("tenant-a", max_rank=64, tenants=frozenset({"a"})),
    ]
    ws[1] = worker("rank8", max_rank=8, demand={"r16@1": 3.0, "a16@1": 3.0, "s16@1": 3.0})
    ads = {
        "r16@1": adapter("r16@1", rank=16),
        "a16@1": adapter("a16@1", rank=16, tenant="a"),
        "s16@1": adapter("s16@1", rank=16, tenant="c"),
    }
    p = PlacementPolicy(per_replica_rps=10.0, min_rps=1.0)
    after = apply(ws, p.plan(ws, ads, now=0.0))
    assert holders(after, "r16@1") == ["rank16"]  # shared pool, lowest max rank >= 16
    assert holders(after, "a16@1") == ["tenant-a"]  # its tenant's dedicated pool first
    assert holders(after, "s16@1") == ["rank16"]  # no pool of its own: a shared one


def test_no_worker_of_its_base_means_no_placement():
    ws = [worker("q", base="qwen", demand={"x@1": 50.0})]
    assert PlacementPolicy(min_rps=1.0).plan(ws, {"x@1": adapter("x@1")}, now=0.0) == []


def test_slots_bytes_and_tenant_budgets_bound_the_packing():
    demand = {f"a{i}@1": 10.0 - i * 0.1 for i in range(20)}
    ws = [
        worker("w0", slots=4, host_bytes=64 * MB, demand=demand),
        worker("w1", slots=8, host_bytes=10 * MB),
    ]
    ads = {k: adapter(k, nbytes=4 * MB, tenant="t" if k < "a2" else None) for k in demand}
    p = PlacementPolicy(
        per_replica_rps=100.0,
        min_rps=1.0,
        placed_slot_share=0.5,
        tenant_budgets={"t": 1},
        max_moves_per_hour=3600,
    )
    after = apply(ws, p.plan(ws, ads, now=0.0))
    placed = {w.name: w.placed for w in after}
    assert len(placed["w0"]) == 2  # half of 4 slots
    assert len(placed["w1"]) == 2  # 10 MB holds two 4 MB adapters
    tenant_t = [k for k in ads if ads[k].tenant == "t"]
    assert sum(len(set(tenant_t) & p_) for p_ in placed.values()) == 1
    # the hottest that fit: a0 (tenant t's one), then a2.. in order of demand
    assert placed["w0"] | placed["w1"] == {"a0@1", "a2@1", "a3@1", "a4@1"}


def test_a_draining_worker_hands_its_placements_over_first():
    ws = [
        worker("leaving", draining=True, placed=frozenset({"x@1", "y@1"}), demand={"x@1": 5.0}),
        worker("stay1"),
        worker("stay2", base="qwen"),
    ]
    ads = {"x@1": adapter("x@1"), "y@1": adapter("y@1")}
    moves = PlacementPolicy(min_rps=1.0).plan(ws, ads, now=0.0)
    assert moves == [
        Move("place", "x@1", "stay1"),
        Move("release", "x@1", "leaving"),
        Move("release", "y@1", "leaving"),  # cold: not placed again
    ]


def test_a_dead_workers_placements_are_placed_again():
    demand = {"x@1": 5.0, "y@1": 5.0}
    ws = [worker("a", demand=demand), worker("b"), worker("c")]
    ads = {k: adapter(k) for k in demand}
    p = PlacementPolicy(min_rps=1.0)
    after = apply(ws, p.plan(ws, ads, now=0.0))
    assert holders(after, "x@1") == ["a"] and holders(after, "y@1") == ["a"]
    survivors = [w for w in after if w.name != "a"]
    survivors[0] = WorkerView(**{**survivors[0].__dict__, "demand": demand})
    again = apply(survivors, p.plan(survivors, ads, now=60.0))
    assert holders(again, "x@1") == ["b"] and holders(again, "y@1") == ["b"]


def test_moves_per_hour_are_bounded_by_the_token_bucket():
    demand = {f"a{i:03}@1": 5.0 for i in range(200)}
    ws = [worker(f"w{i}", slots=64, host_bytes=1 << 40) for i in range(8)]
    ws[0] = worker("w0", slots=64, host_bytes=1 << 40, demand=demand)
    ads = {k: adapter(k) for k in demand}
    p = PlacementPolicy(min_rps=1.0, max_moves_per_hour=60, burst=10)
    first = p.plan(ws, ads, now=0.0)
    assert len(first) == 10  # the burst
    ws = apply(ws, first)
    assert p.plan(ws, ads, now=30.0) == []  # half a token since
    total = len(first)
    for t in range(60, 3601, 60):  # one token a minute
        moves = p.plan(ws, ads, now=float(t))
        ws = apply(ws, moves)
        total += len(moves)
    assert total == 70  # 10 + 60 over the hour


def test_small_demand_changes_move_nothing():
    ws = [worker(f"w{i}") for i in range(4)]
    ws[0] = worker("w0", demand={"x@1": 25.0, "y@1": 2.0})
    ads = {"x@1": adapter("x@1"), "y@1": adapter("y@1")}
    p = PlacementPolicy(per_replica_rps=10.0, min_rps=1.0, min_dwell_s=0.0)
    ws = apply(ws, p.plan(ws, ads, now=0.0))
    assert len(holders(ws, "x@1")) == 3
    for t, x, y in ((600.0, 22.0, 1.2), (1200.0, 28.0, 0.8), (1800.0, 21.0, 2.4)):
        ws[0] = WorkerView(**{**ws[0].__dict__, "demand": {"x@1": x, "y@1": y}})
        assert p.plan(ws, ads, now=t) == []
    ws[0] = WorkerView(**{**ws[0].__dict__, "demand": {"x@1": 8.0, "y@1": 0.3}})
    moves = p.plan(ws, ads, now=2400.0)
    after = apply(ws, moves)
    assert len(holders(after, "x@1")) == 1 and holders(after, "y@1") == []
    assert all(m.kind == "release" for m in moves)


def test_cold_placements_stay_their_dwell_time():
    ws = [worker("w0", demand={"x@1": 5.0})]
    ads = {"x@1": adapter("x@1")}
    p = PlacementPolicy(min_rps=1.0, min_dwell_s=300.0)
    ws = apply(ws, p.plan(ws, ads, now=0.0))
    cold = [WorkerView(**{**ws[0].__dict__, "demand": {}})]
    assert p.plan(cold, ads, now=100.0) == []
    assert p.plan(cold, ads, now=400.0) == [Move("release", "x@1", "w0")]


def test_a_full_worker_makes_room_by_releasing_an_unwanted_placement():
    demand = {"new@1": 5.0, "old@1": 0.1}
    ws = [worker("w0", slots=4, placed=frozenset({"old@1", "older@1"}), demand=demand)]
    ads = {k: adapter(k) for k in ("old@1", "older@1", "new@1")}
    moves = PlacementPolicy(min_rps=1.0, placed_slot_share=1.0).plan(ws, ads, now=0.0)
    # the coldest unwanted one leaves first, to make room; the other is released after
    assert moves[:2] == [Move("release", "older@1", "w0"), Move("place", "new@1", "w0")]
    assert moves[2:] == [Move("release", "old@1", "w0")]


def test_a_worker_keeps_min_free_slots_out_of_placement_at_any_share():
    """The adapters placed nowhere share a worker's unpinned slots, and its residency keeps a
    newly loaded one a second against less demanded ones: with one such slot, their requests
    wait in turn. So a 4-slot worker gets 2 placements at the default share (0.75 would allow 3),
    and never its last slot, which the engines refuse to pin; a reserve of all its slots still
    leaves it one placement."""
    ads = {k: adapter(k) for k in ("a@1", "b@1", "c@1", "d@1")}
    ws = [worker("w0", slots=4, demand=dict.fromkeys(ads, 5.0))]
    for policy, placed in [
        (PlacementPolicy(min_rps=1.0), 2),
        (PlacementPolicy(min_rps=1.0, placed_slot_share=1.0), 2),
        (PlacementPolicy(min_rps=1.0, placed_slot_share=1.0, min_free_slots=1), 3),
        (PlacementPolicy(min_rps=1.0, min_free_slots=4), 1),
    ]:
        moves = policy.plan(ws, ads, now=0.0)
        assert len(apply(ws, moves)[0].placed) == placed
        assert {m.kind for m in moves} <= {"place"}


def test_a_worker_of_two_slots_takes_one_placement_and_one_of_a_single_slot_none():
    """vLLM at `--max-loras 2`: the default reserve of 2 would leave it no placement at all, so
    the reserve gives way to one placement (the worker keeps its other slot free); a worker of
    one slot pins nothing, so it takes none, and the hot adapters go to the others."""
    ads = {k: adapter(k) for k in ("a@1", "b@1", "c@1")}
    demand = dict.fromkeys(ads, 5.0)
    ws = [
        worker("two", slots=2, demand=demand),
        worker("one", slots=1, demand=demand),
        worker("three", slots=3, demand=demand),
    ]
    default, reserving = (
        PlacementPolicy(min_rps=1.0),
        PlacementPolicy(min_rps=1.0, min_free_slots=9),
    )
    for policy in (default, reserving):
        placed = {w.name: len(w.placed) for w in apply(ws, policy.plan(ws, ads, now=0.0))}
        assert placed == {"two": 1, "one": 0, "three": 1}
    assert [default.placeable_slots(n) for n in (0, 1, 2, 3, 4, 8)] == [0, 0, 1, 1, 2, 6]
    assert [reserving.placeable_slots(n) for n in (0, 1, 2, 3, 4, 8)] == [0, 0, 1, 1, 1, 1]
    tight = PlacementPolicy(min_rps=1.0, placed_slot_share=0.1)
    assert [tight.placeable_slots(n) for n in (1, 2, 8, 20)] == [0, 1, 1, 2]


def test_a_hotter_adapter_takes_the_place_of_a_settled_colder_one_when_the_fleet_is_full():
    ads = {k: adapter(k) for k in ("early@1", "warm@1", "hot@1")}

    def full(**demand):
        return [worker("w0", slots=4, placed=frozenset({"early@1", "warm@1"}), demand=demand)]

    def policy():
        return PlacementPolicy(min_rps=1.0, placed_slot_share=1.0, min_dwell_s=60.0)

    hotter = {"early@1": 2.0, "warm@1": 4.0, "hot@1": 9.0}
    assert policy().plan(full(**hotter), ads, now=0.0) == [
        Move("release", "early@1", "w0"),
        Move("place", "hot@1", "w0"),
    ]
    # within the hysteresis (2.4 against 2.0 x 1.25) the placement stays
    close = {"early@1": 2.0, "warm@1": 4.0, "hot@1": 2.4}
    assert policy().plan(full(**close), ads, now=0.0) == []
    # placed by this policy, it stays its dwell time first
    p = policy()
    ws = [worker("w0", slots=4, demand={"early@1": 2.0, "warm@1": 4.0})]
    ws = apply(ws, p.plan(ws, ads, now=0.0))
    assert holders(ws, "early@1") == ["w0"] and holders(ws, "warm@1") == ["w0"]
    ws = [WorkerView(**{**ws[0].__dict__, "demand": hotter})]
    assert p.plan(ws, ads, now=30.0) == []
    assert p.plan(ws, ads, now=90.0) == [
        Move("release", "early@1", "w0"),
        Move("place", "hot@1", "w0"),
    ]


def moves_over_an_hour(policy, series):
    """The moves `policy` makes, planning every 10 s for an hour, on one worker whose demand for
    each adapter follows `series(key, round)` (its plans applied as the controller would)."""
    ads = {k: adapter(k) for k in ("steady@1", "swinging@1")}
    ws = [worker("w0", slots=8)]
    made = []
    for i in range(360):
        demand = {k: series(k, i) for k in ads}
        ws = [WorkerView(**{**ws[0].__dict__, "demand": demand})]
        moves = policy.plan(ws, ads, now=10.0 * i)
        ws = apply(ws, moves)
        made += [(10.0 * i, m) for m in moves]
    return made


def test_an_adapter_swinging_across_min_rps_is_placed_only_once_it_stays_hot():
    """Demand read from a window of few requests swings across `min_rps` and back: with
    `min_hot_s`, an adapter placed nowhere is placed only once it has stayed hot that long; a
    placed one stays until its demand falls under `release_ratio` of the threshold."""

    def across(key, i):  # min_rps 1.0; release under 0.5
        return 5.0 if key == "steady@1" else (1.2 if i % 4 < 2 else 0.3)

    def policy(**kw):
        return PlacementPolicy(min_rps=1.0, min_dwell_s=20.0, **kw)

    eager = moves_over_an_hour(policy(), across)
    assert [m for _, m in eager if m.adapter == "steady@1"] == [Move("place", "steady@1", "w0")]
    assert len([m for _, m in eager if m.adapter == "swinging@1"]) == 180  # place, release, ...
    patient = moves_over_an_hour(policy(min_hot_s=30.0), across)
    assert patient == [(30.0, Move("place", "steady@1", "w0"))]

    def within_the_band(key, i):
        return 5.0 if key == "steady@1" else (1.2 if i % 4 < 2 else 0.6)

    moves = moves_over_an_hour(policy(), within_the_band)
    assert [m for _, m in moves] == [
        Move("place", "steady@1", "w0"),
        Move("place", "swinging@1", "w0"),
    ]


def test_a_hotspot_hands_an_adapter_to_the_least_loaded_worker():
    demand = {"a@1": 6.0, "b@1": 5.0, "c@1": 4.0, "d@1": 1.0}
    ws = [
        worker("hot", placed=frozenset({"a@1", "b@1", "c@1"}), demand=demand),
        worker("cool1", placed=frozenset({"d@1"})),
        worker("cool2"),
    ]
    ads = {k: adapter(k) for k in demand}
    moves = PlacementPolicy(per_replica_rps=10.0, min_rps=0.5).plan(ws, ads, now=0.0)
    # loads 15, 1, 0: mean 5.33; "hot" gives the largest share that leaves it at or above the mean
    assert moves == [Move("place", "a@1", "cool2"), Move("release", "a@1", "hot")]


def test_an_unregistered_adapter_is_released():
    ws = [worker("w0", placed=frozenset({"gone@1"}), demand={"gone@1": 9.0})]
    moves = PlacementPolicy(min_rps=1.0).plan(ws, {}, now=0.0)
    assert moves == [Move("release", "gone@1", "w0")]


def test_plans_are_deterministic_whatever_the_order_of_the_view():
    rng = random.Random(7)
    ws = [
        worker(f"w{i}", max_rank=rng.choice((8, 16, 64)), demand={f"a{j}@1": rng.random() * 20})
        for i in range(12)
        for j in [rng.randrange(30)]
    ]
    ads = {f"a{j}@1": adapter(f"a{j}@1", rank=rng.choice((8, 16))) for j in range(30)}
    first = PlacementPolicy(min_rps=1.0).plan(ws, ads, now=0.0)
    shuffled = list(ws)
    rng.shuffle(shuffled)
    assert PlacementPolicy(min_rps=1.0).plan(shuffled, ads, now=0.0) == first
    assert first


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_replicas": 0},
        {"per_replica_rps": 0.0},
        {"max_moves_per_hour": -1},
        {"placed_slot_share": 0.0},
        {"hotspot_ratio": 0.5},
        {"min_free_slots": 0},
        {"min_hot_s": -1.0},
    ],
)
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        PlacementPolicy(**kwargs)


def test_loraplex_placement_settings_reach_the_policy():
    where = {"registry": "sqlite:///registry.db", "worker": ("http://w0:8000",)}
    defaults = policy_of(PlacementSettings(**where))
    assert (defaults.min_free_slots, defaults.min_hot_s, defaults.release_ratio) == (2, 30.0, 0.5)
    given = PlacementSettings(**where, min_free_slots=3, min_hot_s=12.0, release_ratio=0.25)
    p = policy_of(given)
    assert (p.min_free_slots, p.min_hot_s, p.release_ratio) == (3, 12.0, 0.25)
    with pytest.raises(ValueError, match="--release-ratio"):
        PlacementSettings(**where, release_ratio=1.5)
