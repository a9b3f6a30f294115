"""Histograms merge across workers by their buckets; a fleet's percentile is taken from the sum."""

from __future__ import annotations

import math
import random

import pytest

from loraplex.rollout.figures import BOUNDS_S, GROWTH, Histogram, RevisionFigures, merge


def hist(values):
    h = Histogram()
    for v in values:
        h.observe(v)
    return h


def test_quantile_is_the_upper_bound_of_the_bucket_holding_the_rank():
    values = [0.010] * 98 + [0.200, 0.900]
    q = hist(values).quantile(0.99)
    assert q is not None and 0.200 <= q < 0.200 * GROWTH
    assert hist([]).quantile(0.99) is None
    assert hist([10_000.0]).quantile(0.5) == BOUNDS_S[-1]


def test_merged_p99_is_that_of_all_requests_not_the_mean_of_the_workers_p99s():
    rng = random.Random(1)
    fast = [rng.uniform(0.005, 0.010) for _ in range(990)]
    slow = [rng.uniform(0.400, 0.500) for _ in range(10)]
    a, b = hist(fast), hist(fast[:500] + slow)
    merged = a.merged(b)
    every = sorted(fast + fast[:500] + slow)
    true_p99 = every[math.ceil(0.99 * len(every)) - 1]
    assert merged.total == 1500
    assert true_p99 <= merged.quantile(0.99) < true_p99 * GROWTH
    mean_of_p99s = (a.quantile(0.99) + b.quantile(0.99)) / 2
    assert abs(mean_of_p99s - merged.quantile(0.99)) > 0.1  # averaging would be far off


def test_since_is_the_window_and_a_restart_counts_everything_new():
    early = RevisionFigures()
    for _ in range(5):
        early.record(True, 0.01, 0.002)
    later = RevisionFigures.from_json(early.to_json())
    later.record(False, 0.3, None)
    window = later.since(early)
    assert (window.requests, window.errors, window.ttft.total, window.tpot.total) == (1, 1, 1, 0)
    assert window.ttft.quantile(0.5) >= 0.3
    restarted = RevisionFigures()
    restarted.record(True, 0.02, None)
    assert restarted.since(later).requests == 1


def test_json_round_trip_and_bad_buckets_refused():
    f = RevisionFigures()
    f.record(True, 0.05, 0.01)
    back = RevisionFigures.from_json(f.to_json())
    assert back.ttft.counts == f.ttft.counts and back.ttft.sum_s == pytest.approx(0.05)
    with pytest.raises(ValueError, match="bucket"):
        Histogram.from_json({"counts": {"999": 1}})


def test_from_cumulative_reads_prometheus_buckets():
    h = hist([0.001, 0.001, 0.05])
    cumulative, total = {}, 0.0
    for bound, count in zip([*BOUNDS_S, math.inf], h.counts):
        total += count
        cumulative[bound] = total
    assert Histogram.from_cumulative(cumulative, h.sum_s).counts == h.counts


def test_merge_sums_by_revision():
    a, b = RevisionFigures(), RevisionFigures()
    a.record(True, 0.01, None)
    b.record(False, 0.01, None)
    out = merge([{"r1": a}, {"r1": b, "r2": RevisionFigures(3, 0)}])
    assert (out["r1"].requests, out["r1"].errors, out["r2"].requests) == (2, 1, 3)
