"""`simulate --routing`: the placement controller on a simulated fleet (its placements pinned in
the workers' real caches, the router honouring them, its moves bounded), and the llm-d EPP's
default scorer profile as emulated."""

import json

import pytest
from typer.testing import CliRunner

from loraplex.sim.cli import app
from loraplex.sim.epp import EppPicker, EppView, lora
from loraplex.sim.placement import ControllerConfig
from loraplex.sim.simulator import SimConfig, policy_factory, simulate
from loraplex.sim.workload import Request, write_trace


def _trace(seconds: int = 60) -> list[Request]:
    """hot-0 at 10 requests/s, hot-1 at 2/s, and one request a second for a new tail adapter."""
    out = []
    for tick in range(seconds * 10):
        t = tick / 10
        out.append(Request(t, "acme", "hot-0", 32, 4, rank=8))
        if tick % 5 == 0:
            out.append(Request(t + 0.01, "acme", "hot-1", 32, 4, rank=8))
        if tick % 10 == 0:
            out.append(Request(t + 0.02, "beta", f"tail-{tick}", 32, 4, rank=8))
    return out


def _controller(**kw) -> ControllerConfig:
    defaults = dict(interval_s=5.0, window_s=10.0, per_replica_rps=4.0, min_rps=0.5)
    return ControllerConfig(**{**defaults, "min_dwell_s": 0.0, **kw})


def _config(routing: str, workers: int = 4) -> SimConfig:
    return SimConfig(gpu_slots=4, cpu_bytes=2**30, workers=workers, routing=routing)


def test_the_controller_places_hot_adapters_and_the_router_honours_them():
    sim = simulate(_trace(), _config("controller"), policy_factory("lru"), _controller())
    c = sim.controller
    assert len(c.placed["hot-0@1"]) == 3  # 10 requests/s over 4 per replica
    assert len(c.placed["hot-1@1"]) == 1
    assert not any(m.startswith("tail") and ws for m, ws in c.placed.items())
    assert c.moves == {"place": 4} and c.refused == 0
    for model, workers in c.placed.items():
        for i in workers:
            assert sim.workers[i].cache.pinned(sim.refs[model].key) == "cpu"
    # once placed (the first plan, at 5 s), a hot request goes to one of its placed workers
    late = [s for s in sim.requests if s.req.model == "hot-0@1" and s.req.time > 5.0]
    assert {s.worker for s in late} == c.placed["hot-0@1"]
    assert sim.finished == len(sim.requests)


def test_the_controller_moves_no_more_than_its_bucket_allows():
    config = _controller(per_replica_rps=0.1, min_rps=0.05, max_moves_per_hour=360, burst=2)
    sim = simulate(_trace(), _config("controller", workers=8), policy_factory("lru"), config)
    moves = sum(sim.controller.moves.values())
    # 2 at once, then one every 10 s: plans at 5, 10, ..., 60 s
    assert moves == 2 + int((60 - 5) * 360 / 3600)


def test_a_released_placement_is_unpinned():
    trace = [r for r in _trace(40) if r.adapter != "hot-1" or r.time < 10]
    sim = simulate(trace, _config("controller"), policy_factory("lru"), _controller())
    c = sim.controller
    assert [m for _, m in c.log if m.adapter == "hot-1@1"][-1].kind == "release"
    assert not c.placed["hot-1@1"]
    assert all(w.cache.pinned(sim.refs["hot-1@1"].key) is None for w in sim.workers)


def test_epp_scores_as_its_default_profile():
    picker = EppPicker(_config("epp"))
    views = [
        EppView(0, 0.5, frozenset({"a@1"}), frozenset(), 2),
        EppView(2, 0.0, frozenset(), frozenset(), 2),
        EppView(4, 0.25, frozenset({"b@1", "c@1"}), frozenset({"a@1"}), 2),
    ]
    # queue 2 × (1, 0.5, 0) + kv 2 × (0.5, 1, 0.75) + lora 1 × (1, 0.8, 0.6)
    assert picker.scores(views, "a@1") == pytest.approx([4.0, 3.8, 2.1])
    assert [lora(v, None) for v in views] == [0.8, 0.8, 0.0]


def test_epp_breaks_ties_at_random_and_serves_every_request():
    sim = simulate(_trace(20), _config("epp"), policy_factory("lru"))
    assert sim.finished == len(sim.requests)
    assert len({s.worker for s in sim.requests if s.req.adapter.startswith("tail")}) == 4


def test_other_routings_are_refused():
    with pytest.raises(ValueError, match="routing 'nearest'"):
        SimConfig(routing="nearest")
    with pytest.raises(ValueError, match="native-engine"):
        SimConfig(routing="epp", engine="vllm")


def test_simulate_routing_on_the_command_line(tmp_path):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "out.json"
    write_trace(_trace(20), trace)
    args = ["simulate", "--workload", str(trace), "--no-optimal", "--workers", "4"]
    result = CliRunner().invoke(app, [*args, "--routing", "controller", "--json", str(out)])
    assert result.exit_code == 0, result.output
    run = json.loads(out.read_text())["runs"][0]
    assert run["routing"] == "controller" and run["workers"] == 4
    bad = CliRunner().invoke(app, [*args, "--routing", "epp", "--engine", "vllm"])
    assert bad.exit_code == 2
    assert "--routing epp: one pool of native-engine workers only" in bad.output
