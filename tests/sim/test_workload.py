"""Workload generators: seeded, with the statistics they claim; traces and audit logs read back."""

import json
from collections import Counter

import numpy as np
import pytest

from loraplex.sim import workload as W


def test_named_workloads_are_reproducible_and_seeded():
    for name in W.NAMED:
        assert W.named(name, seed=3) == W.named(name, seed=3), name
    assert W.named("zipf", seed=1) != W.named("zipf", seed=2)


def test_zipf_rank_frequency_slope_matches_s():
    spec = W.WorkloadSpec(name="z", seed=0, s=1.1, rate=200.0, duration_s=200.0, num_adapters=500)
    counts = np.array(
        sorted(Counter(r.adapter for r in W.generate(spec)).values(), reverse=True), dtype=float
    )
    k = np.arange(1, 51)
    slope = np.polyfit(np.log(k), np.log(counts[:50]), 1)[0]
    assert slope == pytest.approx(-1.1, abs=0.1)


def test_poisson_arrivals_have_the_rate_and_unit_cv():
    times = W.arrival_times(np.random.default_rng(0), rate=50.0, duration_s=400.0)
    gaps = np.diff(times)
    assert len(times) / 400.0 == pytest.approx(50.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
    assert times.min() >= 0 and times.max() < 400.0


def test_gamma_arrivals_have_the_requested_cv():
    times = W.arrival_times(
        np.random.default_rng(1), rate=50.0, duration_s=400.0, arrival="gamma", cv=2.0
    )
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)
    assert len(times) / 400.0 == pytest.approx(50.0, rel=0.1)


def test_power_sampler_matches_slora_distribution():
    n, alpha = 20, 0.5
    w = W.popularity_weights(n, "power", alpha=alpha)
    assert w[0] == pytest.approx((1 / n) ** alpha)  # P(floor(n·x) = 0) with CDF x^α
    assert np.all(np.diff(w) <= 1e-12) and w.sum() == pytest.approx(1.0)
    assert np.allclose(W.popularity_weights(n, "power", alpha=1.0), 1 / n)  # α = 1 is uniform


def test_rank_mix_and_tenants_follow_the_spec():
    spec = W.WorkloadSpec(
        name="t",
        seed=5,
        rate=50,
        duration_s=100,
        num_adapters=400,
        ranks={8: 3.0, 64: 1.0},
        tenants=(W.Tenant("a", 0.5, 2), W.Tenant("b", 0.5, 0)),
    )
    trace = W.generate(spec)
    ranks = {r.adapter: r.rank for r in trace}
    assert set(ranks.values()) == {8, 64}
    assert sum(v == 8 for v in ranks.values()) / len(ranks) == pytest.approx(0.75, abs=0.08)
    assert {(r.tenant, r.priority) for r in trace} == {("a", 2), ("b", 0)}
    owners = {}
    for r in trace:  # an adapter belongs to one tenant
        assert owners.setdefault(r.adapter, r.tenant) == r.tenant


def test_hot_burst_sweeps_each_cold_adapter_once_inside_the_burst():
    trace = W.hot_burst(seed=0, burst_start_s=100, burst_s=30)
    cold = [r for r in trace if r.tenant == "batch"]
    hot = [r for r in trace if r.tenant == "interactive"]
    assert len({r.adapter for r in cold}) == len(cold) == 200
    assert all(100 <= r.time < 130 for r in cold) and all(r.priority == 0 for r in cold)
    assert len({r.adapter for r in hot}) == 4 and all(r.priority == 1 for r in hot)
    assert [r.time for r in trace] == sorted(r.time for r in trace)


def test_rollout_brings_revision_two_in_the_second_half_only():
    trace = W.rollout(seed=0, duration_s=400)
    new = [r for r in trace if r.revision == "2"]
    assert new and min(r.time for r in new) >= 200
    late = [r for r in trace if r.time >= 350 and r.adapter == new[0].adapter]
    assert all(r.revision == "2" for r in late)  # 100% at the last step


def test_diurnal_rate_and_hot_set_follow_the_day():
    trace = W.diurnal(seed=0, period_s=400, duration_s=800)
    phase = np.array([(r.time % 400) / 400 for r in trace])
    noon, midnight = (
        np.sum((phase > 0.15) & (phase < 0.35)),
        np.sum((phase > 0.65) & (phase < 0.85)),
    )
    assert noon > 2 * midnight

    def day_share(lo, hi):
        return np.mean([r.tenant == "day" for r, p in zip(trace, phase) if lo < p < hi])

    assert day_share(0.15, 0.35) > 0.7 and day_share(0.65, 0.85) < 0.3


def test_trace_round_trips_through_jsonl(tmp_path):
    trace = W.named("rollout")[:200]
    W.write_trace(trace, tmp_path / "t.jsonl")
    assert W.read_trace(tmp_path / "t.jsonl") == trace
    assert W.load(str(tmp_path / "t.jsonl")) == trace


def test_audit_log_is_replayed_from_its_arrivals(tmp_path):
    lines = [
        {
            "ts": 1000.5,
            "request_id": "a",
            "tenant": "t1",
            "adapter": "x",
            "revision": "3",
            "digest": "sha256:1",
            "rank": 8,
            "cache_tier": "gpu",
            "queue_wait_ms": 1.0,
            "ttft_ms": 100.0,
            "tpot_ms": 10.0,
            "prompt_tokens": 12,
            "completion_tokens": 11,
            "status": 200,
        },
        {
            "ts": 1000.0,
            "request_id": "b",
            "tenant": "t2",
            "adapter": "y",
            "revision": "1",
            "rank": 16,
            "ttft_ms": 50.0,
            "tpot_ms": None,
            "prompt_tokens": 5,
            "completion_tokens": 1,
            "status": 200,
        },
        {
            "ts": 1000.2,
            "request_id": "c",
            "tenant": "t2",
            "adapter": "y",
            "status": 429,
            "prompt_tokens": None,
            "completion_tokens": None,
        },
    ]
    path = tmp_path / "audit.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))
    trace = W.read_trace(path)
    assert [(r.adapter, r.revision, r.rank, r.tenant) for r in trace] == [
        ("y", "1", 16, "t2"),
        ("x", "3", 8, "t1"),
    ]
    # x arrived at 1000.5 - (0.1 + 10 × 0.01) = 1000.3; y at 1000.0 - 0.05 = 999.95; the trace
    # starts at 0.
    assert [r.time for r in trace] == pytest.approx([0.0, 0.35])
    assert trace[1].prompt_tokens == 12 and trace[1].output_tokens == 11


@pytest.mark.parametrize(
    "line, reason",
    [
        ('{"time": 1.0, "adapter": "x"', "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"adapter": "x", "prompt_tokens": 8, "output_tokens": 4}', "'time'"),
        ('{"time": null, "adapter": "x", "prompt_tokens": 8, "output_tokens": 4}', "'time'"),
        ('{"time": "soon", "adapter": "x", "prompt_tokens": 8, "output_tokens": 4}', "'time'"),
        ('{"time": 1.0, "adapter": "x", "output_tokens": 4}', "'prompt_tokens'"),
        (
            '{"ts": 5.0, "request_id": "r", "status": 200, "completion_tokens": "many"}',
            "'completion_tokens'",
        ),
    ],
)
def test_a_bad_trace_line_is_named_by_file_and_line(tmp_path, line, reason):
    first = (
        '{"ts": 1.0, "request_id": "q", "status": 200}'
        if '"ts"' in line
        else '{"time": 0.0, "adapter": "x", "prompt_tokens": 8, "output_tokens": 4}'
    )
    path = tmp_path / "t.jsonl"
    path.write_text(first + "\n\n" + line + "\n")
    with pytest.raises(W.TraceError, match=rf"t\.jsonl line 3: .*{reason}"):
        W.read_trace(path)
