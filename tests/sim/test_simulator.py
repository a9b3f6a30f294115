"""The simulator around the real cache: capacities, in-flight protection, the seed scenario, the
bound."""

import json

import pytest

from loraplex.sim import workload as W
from loraplex.sim.calibration import ServiceModel
from loraplex.sim.report import bound, compare, hot_adapters, summarize
from loraplex.sim.simulator import SimConfig, Simulation, policy_factory, simulate

GiB = 2**30


def small_zipf(seed=0, duration=60.0, rate=4.0, n=40):
    return W.generate(
        W.WorkloadSpec(name="z", seed=seed, duration_s=duration, rate=rate, num_adapters=n)
    )


def watched(trace, config, policy):
    """A simulation whose caches check, at every eviction, that the victim has no request in
    flight."""
    sim = Simulation(trace, config, policy_factory(policy))
    for worker in sim.workers:
        cache, clear = worker.cache, worker.cache.backend._clear

        def checked(slot, now, cache=cache, clear=clear):
            assert cache.entries[cache.backend.slots[slot]].refcount == 0, (
                "evicted an adapter in flight"
            )
            clear(slot, now)

        cache.backend._clear = checked
    return sim.run()


@pytest.mark.parametrize("policy", ["lru", "lfu", "gdsf", "score", "optimal"])
def test_capacities_are_never_exceeded_and_every_request_finishes(policy):
    trace = small_zipf()
    config = SimConfig(gpu_slots=3, cpu_bytes=1 * GiB, disk_bytes=3 * GiB)
    sim = watched(trace, config, policy)
    s = summarize(sim)
    assert s["finished"] == len(trace)
    assert s["peak"]["slots"] <= 3
    assert 0 < s["peak"]["cpu_bytes"] <= 1 * GiB
    assert 0 < s["peak"]["disk_bytes"] <= 3 * GiB
    assert sum(s["hit_rate"].values()) == pytest.approx(1.0)
    for seq in sim.requests:
        assert seq.req.time <= seq.admitted_at <= seq.first_token_at <= seq.finish_at
    for worker in sim.workers:
        assert all(e.refcount == 0 for e in worker.cache.entries.values())


@pytest.mark.parametrize("policy", ["lru", "score"])
def test_skipping_blocked_acquires_changes_nothing(policy):
    trace = small_zipf(seed=3, rate=6.0, duration=40.0)
    results = []
    for skip in (True, False):
        config = SimConfig(gpu_slots=2, cpu_bytes=1 * GiB, disk_bytes=2 * GiB, skip_blocked=skip)
        sim = simulate(trace, config, policy_factory(policy))
        results.append([(s.tier, s.first_token_at, s.finish_at) for s in sim.requests])
    assert results[0] == results[1]


@pytest.mark.parametrize(
    "policy,workers", [("lru", 1), ("score", 1), ("score", 2), ("lru", 4), ("optimal", 3)]
)
def test_skipping_quiet_steps_changes_nothing(policy, workers):
    """Also across workers, where a worker skips past the others' events and an arrival cuts its
    skip short."""
    trace = small_zipf(seed=5, rate=8.0, duration=40.0)
    results = []
    for skip in (True, False):
        config = SimConfig(
            gpu_slots=3,
            cpu_bytes=1 * GiB,
            disk_bytes=2 * GiB,
            workers=workers,
            skip_quiet_steps=skip,
        )
        sim = simulate(trace, config, policy_factory(policy))
        results.append(
            [(s.tier, s.worker, s.admitted_at, s.first_token_at, s.finish_at) for s in sim.requests]
        )
        results.append(summarize(sim)["miss_cost"])
    assert results[0] == results[2] and results[1] == results[3]


def test_score_beats_lru_on_hot_burst():
    trace = W.named("hot-burst")
    config = SimConfig(gpu_slots=8, cpu_bytes=2 * GiB, disk_bytes=4 * GiB)
    hot = hot_adapters(trace, 4)
    assert hot == {f"hot-{i}@1" for i in range(4)}
    out = {p: summarize(simulate(trace, config, policy_factory(p)), hot) for p in ("lru", "score")}
    lru, score = out["lru"], out["score"]
    assert score["hit_rate"]["gpu"] > lru["hit_rate"]["gpu"]
    assert score["miss_cost"] <= lru["miss_cost"]
    assert score["latency"]["hot"]["ttft_s"]["p99"] * 3 <= lru["latency"]["hot"]["ttft_s"]["p99"]
    assert score["reloads_after_eviction"] < lru["reloads_after_eviction"]


def test_bound_is_below_every_policy_and_the_table_has_the_gap():
    trace = small_zipf(seed=1)
    config = SimConfig(gpu_slots=4, cpu_bytes=2 * GiB, disk_bytes=4 * GiB)
    entries = compare(trace, config, ["lru", "score"])
    optimum = entries["optimal"]["miss_cost"]
    assert set(entries) == {"lru", "score", "optimal"}
    for name, e in entries.items():
        assert e["miss_cost"] >= optimum * (1 - 1e-9), name
        assert e["gap"] == pytest.approx(e["miss_cost"] / optimum - 1)
        assert set(e["hit_rate"]) == {"gpu", "cpu", "disk", "remote"}
        assert {"p50", "p95", "p99"} <= set(e["latency"]["all"]["ttft_s"])
    assert entries["optimal"]["miss_cost_oracle"] >= optimum
    assert (
        entries["optimal"]["lower_bound"]["gpu_hit_rate_max"] >= entries["lru"]["hit_rate"]["gpu"]
    )
    json.dumps(entries)  # what --json writes


def test_many_workers_behind_the_affinity_picker():
    trace = small_zipf(seed=2, rate=8.0, duration=30.0)
    one = summarize(
        simulate(trace, SimConfig(gpu_slots=2, cpu_bytes=GiB, workers=1), policy_factory("lru"))
    )
    sim = simulate(trace, SimConfig(gpu_slots=2, cpu_bytes=GiB, workers=3), policy_factory("lru"))
    three = summarize(sim)
    assert three["finished"] == len(trace)
    served = {seq.worker for seq in sim.requests}
    assert served == {0, 1, 2}
    assert three["hit_rate"]["gpu"] > one["hit_rate"]["gpu"]
    assert bound(sim)["miss_cost"] <= three["miss_cost"]


def test_local_adapters_have_no_remote_tier():
    trace = small_zipf(seed=4, duration=30.0)
    s = summarize(
        simulate(
            trace, SimConfig(gpu_slots=2, cpu_bytes=GiB, local_adapters=True), policy_factory("lru")
        )
    )
    assert s["hit_rate"]["remote"] == 0 and s["loads"].get("remote", 0) == 0


def test_service_model_calibrates_from_engine_throughput_json(tmp_path):
    data = {
        "rows": [
            {
                "workload": {
                    "num_requests": 16,
                    "prompt_len": 32,
                    "output_len": 8,
                    "num_adapters": 0,
                    "lora_bytes_per_step": None,
                },
                "ours": {"seconds": 1.0, "tpot_by_rank_s": {"base": 0.08}},
            },
            {
                "workload": {
                    "num_requests": 16,
                    "prompt_len": 32,
                    "output_len": 8,
                    "num_adapters": 8,
                    "lora_bytes_per_step": None,
                },
                "ours": {"seconds": 2.0, "tpot_by_rank_s": {"8": 0.16, "16": 0.16}},
            },
        ]
    }
    path = tmp_path / "engine_throughput.json"
    path.write_text(json.dumps(data))
    model = ServiceModel.from_engine_throughput(path)
    assert model.step_s == pytest.approx(0.08)
    assert model.per_adapter_s == pytest.approx(0.01)
    assert model.per_prefill_token_s == pytest.approx((1.0 - 0.08 * 7) / (16 * 32))
    assert model.source == str(path)


def test_tenant_hit_rates_count_adapter_requests_only():
    # One tenant, every other request for the base model: its rates must be the run's (adapter
    # requests only), while its request count and latency cover all 40.
    trace = [W.Request(0.5 * i, "t", None if i % 2 else f"a{i % 8}", 100, 20) for i in range(40)]
    summary = summarize(simulate(trace, SimConfig(gpu_slots=2, cpu_bytes=0), policy_factory("lru")))
    tenant = summary["tenants"]["t"]
    assert summary["hit_rate"]["gpu"] < 0.5 and summary["cold_start_rate"] > 0.4
    assert tenant["gpu_hit_rate"] == summary["hit_rate"]["gpu"]
    assert tenant["cold_start_rate"] == summary["cold_start_rate"]
    assert tenant["requests"] == tenant["count"] == 40 and tenant["adapter_requests"] == 20
