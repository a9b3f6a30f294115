"""The rank-skew histograms both engines keep, as /metrics renders them: Prometheus's `le` rule (a
value on a bound counts in it), cumulative buckets, per rank bucket."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraplex.engines.rank_skew import RANK_BUCKETS, STEP_BOUNDS, RankSkew
from loraplex.server.metrics import _rank_skew_histograms


class _Families:
    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        return _rank_skew_histograms(self.snapshot)

    def describe(self):
        return []


def rendered(skew: RankSkew) -> dict[tuple, float]:
    registry = CollectorRegistry()
    registry.register(_Families(skew.snapshot()))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_steps_count_in_their_bound_and_every_bound_above():
    skew = RankSkew()
    skew.step.observe("<=16", 0.001)  # on a bound
    skew.step.observe("<=16", 0.0011)
    skew.step.observe("<=16", 9.0)  # above the last bound
    skew.step.observe("base", 0.0004)
    s = rendered(skew)

    def bucket(rank, le):
        return s[("loraplex_engine_step_seconds_bucket", (("le", le), ("rank_bucket", rank)))]

    assert bucket("<=16", "0.0005") == 0
    assert bucket("<=16", "0.001") == 1
    assert bucket("<=16", "0.0025") == 2
    assert bucket("<=16", str(STEP_BOUNDS[-1])) == 2
    assert bucket("<=16", "+Inf") == 3
    assert s[("loraplex_engine_step_seconds_count", (("rank_bucket", "<=16"),))] == 3
    total = s[("loraplex_engine_step_seconds_sum", (("rank_bucket", "<=16"),))]
    assert total == pytest.approx(0.001 + 0.0011 + 9.0)
    assert bucket("base", "0.0005") == 1
    for rank in set(RANK_BUCKETS) - {"<=16", "base"}:  # every bucket exported, at 0
        assert bucket(rank, "+Inf") == 0


def test_tpot_is_its_own_family():
    skew = RankSkew()
    skew.tpot.observe(">64", 0.02)
    s = rendered(skew)
    assert s[("loraplex_request_tpot_by_rank_seconds_count", (("rank_bucket", ">64"),))] == 1
    assert s[("loraplex_engine_step_seconds_count", (("rank_bucket", ">64"),))] == 0
