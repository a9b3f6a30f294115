"""The comparison baselines for the simulator: LFU (with aging) and GDSF, over plain data."""

from loraplex.residency.policy import Candidate, GDSFPolicy, LFUPolicy


def c(key, last=0.0, demand=0.0, nbytes=2**30, cost=1.0):
    return Candidate(
        key, nbytes=nbytes, last_access=last, loaded_at=0.0, demand=demand, reload_cost=cost
    )


def test_lfu_evicts_the_least_demanded_and_breaks_ties_by_recency():
    policy = LFUPolicy()
    assert policy.choose_victim([c("hot", 1, 9.0), c("cold", 99, 1.0)], now=100) == "cold"
    assert policy.choose_victim([c("old", 1, 2.0), c("new", 50, 2.0)], now=100) == "old"
    assert policy.choose_victim([], now=100) is None


def test_gdsf_weighs_frequency_cost_and_size():
    policy = GDSFPolicy()
    big, small = c("big", demand=2.0, nbytes=2 * 2**30), c("small", demand=2.0, nbytes=2**29)
    assert policy.choose_victim([big, small], now=1) == "big"  # same value per request, more bytes
    cheap, dear = c("cheap", demand=2.0, cost=0.1), c("dear", demand=2.0, cost=2.0)
    assert GDSFPolicy().choose_victim([cheap, dear], now=1) == "cheap"
    assert GDSFPolicy().choose_victim([], now=1) is None


def test_gdsf_inflation_ages_adapters_not_touched_since():
    policy = GDSFPolicy()
    first = policy.choose_victim([c("a", last=1, demand=3.0), c("b", last=1, demand=1.0)], now=2)
    assert first == "b" and policy.inflation_at(2) == 1.0  # L rose to the victim's H
    # An adapter touched after the inflation carries it; one untouched since does not.
    stale, fresh = c("stale", last=1, demand=1.5), c("fresh", last=3, demand=1.0)
    assert policy.priority(fresh) == 2.0 and policy.priority(stale) == 1.5
    assert policy.choose_victim([stale, fresh], now=4) == "stale"
