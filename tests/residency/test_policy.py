"""Eviction policies over plain data (no torch)."""

import random

from loraplex.residency.policy import (
    Candidate,
    DemandTracker,
    LRUPolicy,
    ScorePolicy,
    make_policy,
)


def c(key, last=0.0, loaded=0.0, demand=0.0, **kw):
    return Candidate(key, nbytes=1000, last_access=last, loaded_at=loaded, demand=demand, **kw)


def test_lru_evicts_least_recently_used():
    assert LRUPolicy().choose_victim([c("a", 5), c("b", 1), c("c", 9)], now=10) == "b"
    assert LRUPolicy().choose_victim([], now=10) is None


def test_score_keeps_a_frequent_adapter_over_a_more_recent_one_off():
    hot = c("hot", last=90, loaded=0, demand=40)
    one_off = c("one-off", last=99, loaded=99 - 30, demand=1)
    assert ScorePolicy().choose_victim([hot, one_off], now=100) == "one-off"
    assert LRUPolicy().choose_victim([hot, one_off], now=100) == "hot"


def test_min_residency_protects_a_new_gpu_warm_adapter_only_against_colder_newcomers():
    policy = ScorePolicy(min_residency_s=5)
    young_hot = c("young-hot", last=99, loaded=98, demand=6, warm=True)
    old_cold = c("old-cold", last=50, loaded=10, demand=0.5)
    cold_incoming = c("incoming", demand=1)
    # Only the young adapter can go by score alone, but it is protected: nothing may be evicted yet.
    assert policy.choose_victim([young_hot], now=100, incoming=cold_incoming) is None
    assert (
        policy.choose_victim([young_hot, old_cold], now=100, incoming=cold_incoming) == "old-cold"
    )
    # A newcomer with more demand than the young adapter may displace it; so may anyone after 5 s.
    assert policy.choose_victim([young_hot], now=100, incoming=c("hotter", demand=9)) == "young-hot"
    assert policy.choose_victim([young_hot], now=102.9, incoming=cold_incoming) is None
    assert policy.choose_victim([young_hot], now=103.1, incoming=cold_incoming) == "young-hot"
    # A gpu-warm newcomer is no one-off: it may take the slot of a younger adapter with more demand.
    assert (
        policy.choose_victim([young_hot], now=100, incoming=c("gpu-warm", demand=4, warm=True))
        == "young-hot"
    )
    # Outside the gpu warm set there is no protection: a one-off does not wait for a slot that a
    # middling adapter just took.
    young_middling = c("young-middling", last=99, loaded=98, demand=3)
    assert (
        policy.choose_victim([young_middling], now=100, incoming=cold_incoming) == "young-middling"
    )
    # Nor for a gpu-warm adapter the cache put back ahead of its requests: a request must not wait
    # for a guess.
    restored = c("restored", last=90, loaded=99.5, demand=6, warm=True, restored=True)
    assert policy.choose_victim([restored], now=100, incoming=cold_incoming) == "restored"


def test_score_weighs_priority_reload_cost_and_preference():
    policy = ScorePolicy()
    a, b = c("a", last=100, demand=3), c("b", last=100, demand=3, priority=2)
    assert policy.choose_victim([a, b], now=100) == "a"
    cheap, dear = c("cheap", last=100, demand=3), c("dear", last=100, demand=3, reload_cost=2.0)
    assert policy.choose_victim([cheap, dear], now=100) == "cheap"
    plain, preferred = c("plain", last=100, demand=3), c("pref", last=100, demand=3, warm=True)
    assert policy.choose_victim([plain, preferred], now=100) == "plain"


def test_demand_decays_over_its_windows():
    demand = DemandTracker()
    for t in range(10):
        demand.record("k", float(t))
    five_min, hour, day = demand.counts("k", 9.0)
    assert 9.5 < five_min <= 10 and 9.9 < hour <= 10 and day <= 10
    later = demand.counts("k", 9.0 + 600)  # ten minutes on: the 5-minute count has mostly gone
    assert later[0] < 1.5 and later[1] > 8 and later[2] > 9.8


def test_make_policy_names():
    assert make_policy("lru").name == "lru" and make_policy("score").name == "score"


def test_score_victim_is_the_lowest_keep_score_to_the_last_bit():
    """choose_victim scores candidates inline for speed: it must pick what keep_score ranks
    lowest, ties included."""
    rng = random.Random(0)
    policy = ScorePolicy()
    for _ in range(2000):
        candidates = [
            Candidate(
                i,
                nbytes=rng.choice([2**20, 5 * 2**20, 2**30]),
                loaded_at=rng.uniform(0, 100),
                last_access=rng.choice([0.0, 50.0, rng.uniform(0, 100)]),
                demand=rng.choice([0.0, 1.0, rng.uniform(0, 9)]),
                priority=rng.choice([0, 1]),
                reload_cost=rng.choice([0.0, rng.random()]),
                warm=rng.random() < 0.3,
            )
            for i in range(rng.randint(1, 12))
        ]
        now, incoming = rng.choice([0.0, 50.0, 100.0]), rng.choice([None, candidates[0]])
        kept = [
            x
            for x in candidates
            if incoming is None
            or incoming.warm
            or not (
                x.warm and now - x.loaded_at < policy.min_residency_s and x.demand > incoming.demand
            )
        ]
        expected = (
            min(kept, key=lambda x: (policy.keep_score(x, now), x.last_access)).key
            if kept
            else None
        )
        assert policy.choose_victim(candidates, now, incoming) == expected


def test_score_victims_in_order_are_repeated_choose_victim():
    """The cache drops host copies through `victims` (scored once): the same picks as asking
    choose_victim again after taking out each pick, ties included."""
    rng = random.Random(1)
    policy = ScorePolicy()
    for _ in range(500):
        candidates = [
            Candidate(
                i,
                nbytes=rng.choice([2**20, 2**30]),
                loaded_at=rng.choice([0.0, 40.0]),
                last_access=rng.choice([0.0, 50.0, rng.uniform(0, 100)]),
                demand=rng.choice([0.0, 1.0]),
                reload_cost=rng.choice([0.0, 0.5]),
                warm=rng.random() < 0.3,
            )
            for i in range(rng.randint(0, 12))
        ]
        now, left, expected = rng.choice([50.0, 100.0]), list(candidates), []
        while left:
            victim = policy.choose_victim(left, now)
            expected.append(victim)
            left = [x for x in left if x.key != victim]
        assert list(policy.victims(candidates, now)) == expected
