"""`simulate --fair-share` and `--kv-prefix-blocks`: the router's fair queue (`router/fairness.py`)
and its prefix index (`router/prefixes.py`) at the simulated router, the workers' KV prefix
caches."""

import json

from typer.testing import CliRunner

from loraplex.sim import workload
from loraplex.sim.cli import app
from loraplex.sim.prefix_cache import with_system_prompts
from loraplex.sim.report import summarize
from loraplex.sim.simulator import SimConfig, policy_factory, simulate
from loraplex.sim.workload import Request, read_trace, write_trace


def _steady_and_burst(burst: bool, bursts: tuple[str, ...] = ("a",)) -> list[Request]:
    """Tenant b: 2 requests a second for 60 s; each tenant of `bursts`: 50 a second from 10 s to
    40 s (what two workers running 4 requests each cannot keep up with)."""
    out = [Request(0.25 + i * 0.5, "b", "b-0", 64, 32, rank=8) for i in range(120)]
    for tenant in bursts if burst else ():
        out += [Request(10 + i * 0.02, tenant, f"{tenant}-{i % 2}", 64, 32, 8) for i in range(1500)]
    return sorted(out, key=lambda r: r.time)


def _run(trace, **config):
    config = SimConfig(workers=2, gpu_slots=4, max_num_seqs=4, seed=1, **config)
    sim = simulate(trace, config, policy_factory("lru"))
    return sim, summarize(sim)


def test_fair_share_keeps_a_steady_tenant_through_another_s_burst():
    _, quiet = _run(_steady_and_burst(False), fair_share=True)
    _, fifo = _run(_steady_and_burst(True))
    sim, fair = _run(_steady_and_burst(True), fair_share=True)
    p99 = {
        name: run["tenants"]["b"]["ttft_s"]["p99"]
        for name, run in (("quiet", quiet), ("fifo", fifo), ("fair", fair))
    }
    # first come first served: b waits behind a's burst in the workers' queues
    assert p99["fifo"] > 10 * p99["quiet"]
    # fair share: b's p99 within 1.5x of its figure without the burst
    assert p99["fair"] <= 1.5 * p99["quiet"] < p99["fifo"]
    assert fair["tenants"]["b"]["requests"] == 120 and fifo["refused"] == 0
    # a's excess waits at the router up to the tenant's queue limit, the rest refused (429)
    assert fair["refused"] > 0 and fair["finished"] + fair["refused"] == len(sim.requests)
    assert fair["fair_share"]["waited"] > 0 and fair["fair_share"]["granted"]["a"] > 0
    assert "fair_share" not in fifo and "prefix_cache" not in fifo


def test_a_place_held_back_for_the_steady_tenant_lowers_its_ttft_through_the_burst():
    """The router's held-back places (`router/holdback.py`): while a, over its share, fills the
    places, one is kept free for b, whose next request starts at once instead of waiting for one
    of a's to finish."""
    trace = _steady_and_burst(True)
    _, off = _run(trace, fair_share=True, holdback_window_s=0)
    _, held = _run(trace, fair_share=True)  # the router's default window
    b_off, b_held = off["tenants"]["b"]["ttft_s"], held["tenants"]["b"]["ttft_s"]
    assert b_held["p99"] < 0.9 * b_off["p99"]
    assert b_held["p50"] < 0.5 * b_off["p50"]
    assert held["fair_share"]["held_back"]["a"] > 0 and "b" not in held["fair_share"]["held_back"]
    assert off["fair_share"]["held_back"] == {}
    assert held["tenants"]["b"]["requests"] == off["tenants"]["b"]["requests"] == 120


def test_a_heavier_tenant_is_granted_more_of_the_saturated_fleet():
    trace = _steady_and_burst(True, bursts=("a", "c"))
    _, even = _run(trace, fair_share=True, queue_per_tenant=2000)
    _, weighted = _run(trace, fair_share=True, queue_per_tenant=2000, tenant_weights=(("a", 3.0),))
    ttft = {
        name: {t: run["tenants"][t]["ttft_s"]["p50"] for t in ("a", "c")}
        for name, run in (("even", even), ("weighted", weighted))
    }
    assert even["refused"] == weighted["refused"] == 0
    assert abs(ttft["even"]["a"] - ttft["even"]["c"]) < 0.2 * ttft["even"]["c"]
    assert ttft["weighted"]["a"] < 0.6 * ttft["weighted"]["c"]


def _system_prompts() -> list[Request]:
    """Six adapters of three tenants, each adapter's requests led by its own 300-token system
    prompt; 12 requests a second for two minutes."""
    trace = workload.named("uniform", seed=3, num_adapters=6, rate=12, duration_s=120, tenants=3)
    return with_system_prompts(trace, 300)


def test_prefix_aware_routing_hits_the_prefix_cache_more_than_round_robin():
    trace = _system_prompts()
    runs = {}
    for router in ("round-robin", "affinity"):
        config = SimConfig(workers=3, gpu_slots=8, router=router, kv_prefix_blocks=96, seed=1)
        runs[router] = summarize(simulate(trace, config, policy_factory("lru")))
    rr, aware = runs["round-robin"], runs["affinity"]
    assert rr["prefix_cache"]["queries"] == aware["prefix_cache"]["queries"]
    assert rr["prefix_cache"]["queries"] == sum(r.prompt_tokens for r in trace)
    assert aware["prefix_cache"]["hit_rate"] >= 1.5 * rr["prefix_cache"]["hit_rate"] > 0
    # prefix hits are not prefilled again
    assert aware["latency"]["all"]["ttft_s"]["p50"] < rr["latency"]["all"]["ttft_s"]["p50"]


def test_a_run_is_the_same_for_the_same_seed_and_traces_keep_their_prompts(tmp_path):
    trace = _system_prompts()[:400]
    path = tmp_path / "trace.jsonl"
    write_trace(trace, path)
    assert read_trace(path) == trace
    config = SimConfig(workers=3, gpu_slots=2, max_num_seqs=2, fair_share=True, kv_prefix_blocks=48)
    first, second = (simulate(read_trace(path), config, policy_factory("lru")) for _ in range(2))
    assert [(s.worker, s.first_token_at, s.cached) for s in first.requests] == [
        (s.worker, s.first_token_at, s.cached) for s in second.requests
    ]
    assert summarize(first)["prefix_cache"] == summarize(second)["prefix_cache"]
    assert summarize(first)["fair_share"]["waited"] > 0


def test_simulate_reports_tenants_and_the_prefix_hit_rate(tmp_path):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "out.json"
    write_trace(workload.named("uniform", num_adapters=6, rate=6, duration_s=30, tenants=2), trace)
    assert "prefix" not in trace.read_text()  # no shared prompts: the trace's lines as they were
    args = ["simulate", "--workload", str(trace), "--no-optimal", "--policy", "lru"]
    args += ["--workers", "3", "--fair-share", "--kv-prefix-blocks", "64"]
    args += ["--system-prompt-tokens", "300", "--tenant-weights", "tenant-0=2", "--json", str(out)]
    args += ["--holdback-window-s", "2"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "per tenant" in result.output and "prefix cache" in result.output
    entry = json.loads(out.read_text())["runs"][0]
    assert entry["options"]["tenant_weights"] == [["tenant-0", 2.0]]
    assert entry["options"]["holdback_window_s"] == 2.0
    assert "held back" in result.output
    lru = entry["policies"]["lru"]
    assert 0 < lru["prefix_cache"]["hit_rate"] < 1
    assert set(lru["tenants"]) == {"tenant-0", "tenant-1"}
    assert set(lru["fair_share"]["held_back"]) <= {"tenant-0", "tenant-1"}
    assert lru["tenants"]["tenant-0"]["ttft_s"]["p99"] > 0
    bad = CliRunner().invoke(app, [*args[:6], "--engine", "vllm", "--fair-share"])
    assert bad.exit_code == 2
    assert "--fair-share and --kv-prefix-blocks: --engine native only" in bad.output
