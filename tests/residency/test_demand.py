"""Decayed request counts: forward decay against the direct sum, rankings, landmark moves."""

import math
import random

import pytest

from loraplex.residency.policy import DEMAND_WINDOWS_S, DemandTracker


def direct(times, now):
    return [sum(math.exp(-(now - t) / w) for t in times) for w in DEMAND_WINDOWS_S]


def test_counts_are_the_decayed_sums_of_past_requests():
    rng = random.Random(0)
    demand, times = DemandTracker(), {}
    now = 1000.0
    for _ in range(300):
        now += rng.expovariate(0.5)
        key = rng.choice("abcdef")
        demand.record(key, now)
        times.setdefault(key, []).append(now)
    later = now + 123.0
    for key, ts in times.items():
        assert demand.counts(key, later) == pytest.approx(direct(ts, later), rel=1e-9)
        assert demand.short(key, later) == pytest.approx(direct(ts, later)[0], rel=1e-9)
    assert demand.counts("never", later) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("window", range(len(DEMAND_WINDOWS_S)))
def test_ranked_is_every_requested_key_most_demanded_first(window):
    rng = random.Random(window)
    demand = DemandTracker()
    now = 0.0
    for _ in range(500):
        now += rng.expovariate(2.0)
        demand.record(f"k{min(int(rng.paretovariate(1.0)), 30)}", now)
    ranked = list(demand.ranked(now + 50.0, window))
    counts = [count for _, count in ranked]
    assert counts == sorted(counts, reverse=True)
    assert {key for key, _ in ranked} == set(demand._scaled)
    for key, count in ranked:
        assert count == pytest.approx(demand.counts(key, now + 50.0)[window])
    assert demand.shorts([key for key, _ in ranked], now + 50.0) == pytest.approx(
        [demand.short(key, now + 50.0) for key, _ in ranked]
    )


def test_counts_survive_moving_the_landmark_over_days():
    demand = DemandTracker()
    step = DEMAND_WINDOWS_S[0] * DemandTracker.REBASE_AFTER / 3  # three rebases a day or so
    times = [i * step / 7 for i in range(40)]
    for t in times:
        demand.record("k", t)
        demand.record("other", t + 1.0)
    now = times[-1] + 10.0
    assert demand.counts("k", now) == pytest.approx(direct(times, now), rel=1e-9)
    assert [key for key, _ in demand.ranked(now)] == ["other", "k"]


def test_discard_forgets_a_key():
    demand = DemandTracker()
    for t in range(5):
        demand.record("a", float(t))
        demand.record("b", float(t) + 0.5)
    demand.discard("b")
    assert demand.short("b", 10.0) == 0.0 and [k for k, _ in demand.ranked(10.0)] == ["a"]
    demand.discard("never")


def test_top_is_the_ranking_walked_while_counts_reach_the_floor():
    rng = random.Random(3)
    demand, now = DemandTracker(), 0.0
    for _ in range(400):
        now += rng.expovariate(1.0)
        demand.record(f"k{min(int(rng.paretovariate(1.0)), 25)}", now)
    for later in (now, now + 30.0, now + 600.0):
        for window in range(len(DEMAND_WINDOWS_S)):
            for floor in (0.0, 1.0, 2.0, 5.0, 1e9):
                for limit in (-1, 0, 1, 3, 8, 100):
                    walked = []
                    for key, count in demand.ranked(later, window):
                        if len(walked) >= limit or count < floor:
                            break
                        walked.append(key)
                    assert demand.top(later, window, floor, limit) == walked


def test_version_moves_with_every_change_of_counts():
    demand = DemandTracker()
    versions = [demand.version]
    demand.record("a", 1.0)
    versions.append(demand.version)
    demand.record("a", 2.0)
    versions.append(demand.version)
    demand.discard("never")  # nothing to forget: nothing changes
    assert demand.version == versions[-1]
    demand.discard("a")
    versions.append(demand.version)
    assert len(set(versions)) == len(versions)


def test_an_adapter_is_overdue_after_so_many_of_its_mean_gaps_without_a_request():
    demand = DemandTracker()
    for i in range(600):
        # 2 requests a second for 5 minutes; the decayed count puts its mean gap near 0.8 s
        demand.record("busy", i / 2)
    last = 299.5
    assert not demand.overdue("busy", last + 10, gaps=20)
    assert demand.overdue("busy", last + 20, gaps=20)
    demand.record("busy", last + 30)  # a request ends it at once
    assert not demand.overdue("busy", last + 31, gaps=20)
    demand.discard("busy")
    assert not demand.overdue("busy", last + 100, gaps=20)


def test_a_young_adapter_s_gap_comes_from_the_time_it_has_been_seen_and_a_single_request_has_none():
    demand = DemandTracker()
    for i in range(10):  # one request a second for 10 s: a count of 10, not 10 in 5 minutes
        demand.record("young", 1000.0 + i)
    demand.record("once", 1000.0)
    assert not demand.overdue("young", 1009 + 15, gaps=20)
    # 20 gaps of about a second, not of 30 s (300 s / 10)
    assert demand.overdue("young", 1009 + 25, gaps=20)
    assert not demand.overdue("once", 1000 + 10_000, gaps=20)
    assert not demand.overdue("never", 1000, gaps=20)


def test_a_client_sending_batches_is_not_taken_as_stopped_between_them():
    """32 requests at once every 10 s: a mean gap of a third of a second, but pauses of 10 s. The
    longest gap in the window keeps it from being overdue between batches; once the batches stop, it
    is overdue after 3 pauses."""
    demand, t = DemandTracker(), 0.0
    for batch in range(30):
        for i in range(32):
            demand.record("batches", t + i * 0.001)
        if batch >= 1:  # after its first pause, the longest gap is known
            assert not any(demand.overdue("batches", t + s, gaps=20) for s in range(1, 10))
        t += 10.0
    last = t - 10.0 + 0.031
    assert not demand.overdue("batches", last + 29, gaps=20)
    assert demand.overdue("batches", last + 31, gaps=20)
    assert demand.any_overdue(["batches"], last + 31, gaps=20)
    assert demand.shorts_live(["batches"], last + 31, gaps=20) == [0.0]
    assert demand.shorts_live(["batches"], last + 29, gaps=20) == demand.shorts(
        ["batches"], last + 29
    )


def test_the_longest_gap_is_the_longest_in_the_window_only():
    demand = DemandTracker()
    demand.record("k", 0.0)
    demand.record("k", 100.0)  # a long pause, early on
    for i in range(1, 800):  # then a request a second
        demand.record("k", 100.0 + i)
    last = 899.0
    # The 100 s pause left the 5-minute window long ago: the rule goes by the mean gap (about 1 s)
    # again.
    assert demand.overdue("k", last + 25, gaps=20)
    assert not demand.overdue("k", last + 15, gaps=20)
