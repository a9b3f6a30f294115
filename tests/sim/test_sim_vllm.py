"""`simulate --engine vllm`: each worker runs the real `Residency` on the vLLM backend over a
modelled vLLM on an event loop with a simulated clock. Capacities hold, every request ends, runs
repeat exactly, the tier sequence follows vLLM's host cache, and the CLI runs it."""

import asyncio
import json

import pytest
from typer.testing import CliRunner

from loraplex.sim import workload as W
from loraplex.sim.calibration import LoadCosts, ServiceModel, TierCost
from loraplex.sim.cli import app
from loraplex.sim.report import summarize
from loraplex.sim.simulator import SimConfig, Simulation, policy_factory, simulate
from loraplex.sim.virtual_loop import VirtualLoop
from loraplex.sim.workload import Request


def _zipf(seed=0, duration=60.0, rate=6.0, n=30):
    return W.generate(
        W.WorkloadSpec(name="z", seed=seed, duration_s=duration, rate=rate, num_adapters=n)
    )


def test_the_virtual_loop_jumps_to_each_timer_in_order():
    loop = VirtualLoop()
    seen = []

    async def main():
        event = asyncio.Event()
        loop.call_later(100.0, event.set)
        loop.call_later(30.0, lambda: seen.append(("timer", loop.time())))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(event.wait(), 50.0)
        seen.append(("timeout", loop.time()))
        await event.wait()
        seen.append(("set", loop.time()))

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert seen == [("timer", 30.0), ("timeout", 50.0), ("set", 100.0)]


@pytest.mark.parametrize("policy", ["lru", "score", "optimal"])
def test_capacities_hold_and_every_request_finishes(policy):
    trace = _zipf()
    config = SimConfig(engine="vllm", gpu_slots=3, max_cpu_loras=6, workers=2)
    sim = Simulation(trace, config, policy_factory(policy))
    most_held = []
    for worker in sim.workers:
        add = worker.core.add_lora

        async def counted(lora, worker=worker, add=add):
            done = await add(lora)
            most_held.append(len(worker.core.host))
            return done

        worker.core.add_lora = counted
    sim.run()
    s = summarize(sim)
    assert s["finished"] == len(trace)
    assert max(most_held) <= 6
    assert 0 < s["peak"]["slots"] <= 3
    assert sum(s["hit_rate"].values()) == pytest.approx(1.0)
    assert s["evictions"] > 0
    for seq in sim.requests:
        assert seq.req.time <= seq.admitted_at <= seq.first_token_at <= seq.finish_at
    for worker in sim.workers:
        assert all(e.refcount == 0 and e.active == 0 for e in worker.cache.entries.values())


def test_a_run_repeats_exactly():
    trace = _zipf(seed=4)
    config = SimConfig(engine="vllm", gpu_slots=2, max_cpu_loras=5)
    runs = [simulate(trace, config, policy_factory("score")) for _ in range(2)]
    first, second = ([(s.tier, s.first_token_at, s.finish_at) for s in r.requests] for r in runs)
    assert first == second


def test_the_tiers_follow_vllms_host_cache_of_max_cpu_loras_adapters():
    """One request at a time, three adapters in turn over a host cache of two under lru: each
    comes back after the other two pushed it out (disk), until the cache holds three."""
    instant = TierCost(1e-6, 1e15)
    sequence = ["a", "b", "c"] * 3
    trace = [Request(float(i), "t", n, 3, 2) for i, n in enumerate(sequence)]

    def tiers(max_cpu_loras):
        config = SimConfig(
            engine="vllm",
            gpu_slots=1,
            max_cpu_loras=max_cpu_loras,
            local_adapters=True,
            service=ServiceModel(step_s=0.01, per_decode_s=0, per_prefill_token_s=0),
            costs=LoadCosts(remote=instant, disk=instant, h2d=instant),
        )
        return [s.tier for s in simulate(trace, config, policy_factory("lru")).requests]

    assert tiers(2) == ["disk"] * 9
    assert tiers(3) == ["disk"] * 3 + ["cpu"] * 6


def test_simulate_engine_vllm_on_the_command_line(tmp_path):
    trace = tmp_path / "trace.jsonl"
    W.write_trace(_zipf(duration=30.0), trace)
    out = tmp_path / "out.json"
    args = ["simulate", "--workload", str(trace), "--engine", "vllm", "--gpu-slots", "2"]
    result = CliRunner().invoke(
        app, [*args, "--max-cpu-loras", "4", "--no-optimal", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "engine vllm" in result.output and "4 adapters" in result.output
    run = json.loads(out.read_text())["runs"][0]
    assert (run["engine"], run["max_cpu_loras"], run["gpu_slots"]) == ("vllm", 4, 2)
    assert set(run["policies"]) == {"lru", "score"}
    bad = CliRunner().invoke(app, [*args, "--engine", "tgi"])
    assert bad.exit_code == 2 and "tgi" in bad.output
