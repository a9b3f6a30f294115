"""The simulator against the real engine: the same trace, policy and capacities give the same tier
sequence."""

import random
import time

import pytest

from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams
from loraplex.lora_format import read_adapter
from loraplex.model_config import ModelConfig
from loraplex.residency.policy import LRUPolicy, ScorePolicy
from loraplex.sim.calibration import LoadCosts, ServiceModel, TierCost
from loraplex.sim.simulator import SimConfig, simulate
from loraplex.sim.workload import Request

GREEDY = SamplingParams(max_tokens=2, temperature=0)


def tiny_trace(names: list[str], length: int = 40, seed: int = 0) -> list[str]:
    """A skewed sequence: a few names come back often, the rest now and then."""
    rng = random.Random(seed)
    weights = [8, 6, 4, 2, 1, 1, 1, 1][: len(names)]
    return rng.choices(names, weights=weights, k=length)


def engine_tiers(llama_dir, refs, sequence, policy, max_loras, cpu_bytes):
    engine = LLMEngine(
        EngineConfig(
            model_dir=llama_dir,
            dtype="float32",
            max_loras=max_loras,
            max_lora_rank=16,
            kv_cache_memory_bytes=2**20,
            cpu_cache_bytes=cpu_bytes,
        ),
        policy=policy,
    )
    tiers, arrivals = [], []
    try:
        for name in sequence:  # one request at a time, each to completion
            arrivals.append(time.monotonic())
            engine.add_request([3, 4, 5], GREEDY, refs(engine)[name])
            while engine.has_work():
                for out in engine.step():
                    assert out.error is None
                    if out.finished:
                        tiers.append(out.cache_tier)
    finally:
        engine.close()
    return tiers, [t - arrivals[0] for t in arrivals]


def sim_tiers(sequence, arrivals, sizes, policy, max_loras, cpu_bytes):
    """The same requests at the engine's arrival times (the demand ranking depends on when requests
    came)."""
    trace = [Request(t, "default", name, 3, 2) for t, name in zip(arrivals, sequence)]
    instant = TierCost(1e-6, 1e15)
    config = SimConfig(
        gpu_slots=max_loras,
        cpu_bytes=cpu_bytes,
        local_adapters=True,
        adapter_bytes=sizes,
        service=ServiceModel(step_s=1e-5, per_decode_s=0, per_prefill_token_s=0, per_adapter_s=0),
        costs=LoadCosts(remote=instant, disk=instant, h2d=instant),
    )
    sim = simulate(trace, config, lambda sim: policy)
    # one at a time
    assert all(a.finish_at < b.req.time for a, b in zip(sim.requests, sim.requests[1:]))
    return [s.tier for s in sim.requests]


# Score without its two wall-clock inputs: the engine's reload cost is each load's measured time
# (noise of a few ms on tiny adapters, enough to flip a tie), and its minimum residency compares
# real against simulated seconds.
@pytest.mark.parametrize(
    "make_policy",
    [LRUPolicy, lambda: ScorePolicy(min_residency_s=0.0, w_cost=0.0)],
    ids=["lru", "score"],
)
def test_simulator_reports_the_engines_tier_sequence(llama_dir, llama_adapters, make_policy):
    paths = list(llama_adapters.values())
    names = [f"a{i}" for i in range(8)]
    model = ModelConfig.from_dir(llama_dir)
    path_of = {name: paths[i % len(paths)] for i, name in enumerate(names)}
    # float32: packed size
    sizes = {f"{n}@1": read_adapter(p, model, 16).actual_bytes for n, p in path_of.items()}
    cpu_bytes = max(sizes.values()) * 3  # about three host copies: cpu evictions happen too
    sequence = tiny_trace(names)

    def refs(engine):
        return {n: engine.adapter_ref(n, p, revision="1") for n, p in path_of.items()}

    real, arrivals = engine_tiers(llama_dir, refs, sequence, make_policy(), 2, cpu_bytes)
    simulated = sim_tiers(sequence, arrivals, sizes, make_policy(), 2, cpu_bytes)
    assert set(real) >= {"gpu", "cpu", "disk"}  # the trace exercises every local tier
    assert simulated == real
