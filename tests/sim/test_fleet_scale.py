"""The simulator's fleet options at small sizes: reshaped workloads with tenants, the registry's
load under the push model (queries on a cold miss or after a change, a notification per change and
worker), runs without the optimum, and `plan --workers`."""

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from loraplex.sim import workload as W
from loraplex.sim.cli import app
from loraplex.sim.registry_load import RegistryLoad, registry_changes
from loraplex.sim.report import summarize
from loraplex.sim.simulator import SimConfig, policy_factory, simulate

runner = CliRunner()


def test_a_generated_workload_takes_its_catalog_rate_duration_and_tenants():
    trace = W.named("zipf", num_adapters=40, rate=20.0, duration_s=30.0, tenants=3)
    assert {r.tenant for r in trace} == {"tenant-0", "tenant-1", "tenant-2"}
    assert len({r.adapter for r in trace}) <= 40 and trace[-1].time < 30.0
    assert 450 < len(trace) < 750  # Poisson around 600
    owners = {}
    for r in trace:  # each adapter belongs to one tenant
        assert owners.setdefault(r.adapter, r.tenant) == r.tenant
    day = W.named("diurnal", num_adapters=100, rate=10.0, duration_s=60.0, tenants=4)
    assert {r.tenant for r in day} <= {"day-0", "day-1", "night-0", "night-1"}
    assert len({r.tenant for r in day}) == 4
    # unshaped, a named workload is as it always was
    assert [dataclasses.astuple(r) for r in W.named("diurnal")] == [
        dataclasses.astuple(r) for r in W.diurnal()
    ]


def test_a_shape_is_refused_where_it_does_not_apply(tmp_path):
    with pytest.raises(ValueError, match="takes no --num-adapters"):
        W.named("hot-burst", num_adapters=10)
    path = tmp_path / "t.jsonl"
    W.write_trace(W.named("zipf", duration_s=5.0), path)
    with pytest.raises(ValueError, match="trace file takes no"):
        W.load(str(path), rate=3.0)


def test_registry_load_counts_cold_misses_changes_and_notifications():
    # two workers; a change to `a` at t=2 reaches both; only worker 0 had resolved it
    load = RegistryLoad(2, [(2.0, "a@1")], half_at=5.0)
    for t, worker, model in [
        (0.0, 0, "a@1"),  # cold: resolve
        (1.0, 0, "a@1"),  # held: no query
        (1.5, 1, "b@1"),  # cold
        (3.0, 0, "a@1"),  # after the change: resolve again
        (3.5, 1, "a@1"),  # cold on worker 1 (it never held a)
        (6.0, 0, "a@1"),  # held
        (6.5, 1, None),  # the base model: no query
    ]:
        load.request(worker, model, t)
    figures = load.figures(requests=7, span_s=10.0)
    assert (figures["cold_queries"], figures["change_queries"]) == (3, 1)
    assert (figures["changes"], figures["notifications"]) == (1, 2)
    assert figures["queries_per_s"] == pytest.approx(0.4)
    assert figures["queries_per_request_second_half"] == 0.0  # 2 requests after t=5, no query


def test_a_fleet_run_queries_once_per_adapter_and_worker_without_changes():
    trace = W.named("zipf", num_adapters=60, rate=12.0, duration_s=40.0, tenants=2)
    config = SimConfig(gpu_slots=2, cpu_bytes=2**30, workers=3)
    sim = simulate(trace, config, policy_factory("score"))
    registry = summarize(sim)["registry"]
    pairs = {(s.worker, s.req.model) for s in sim.requests if s.req.adapter is not None}
    assert registry["queries"] == registry["cold_queries"] == len(pairs)
    assert registry["notifications"] == registry["changes"] == 0
    assert sim.finished == len(trace)

    changed = simulate(
        trace,
        SimConfig(gpu_slots=2, cpu_bytes=2**30, workers=3, registry_changes_per_s=0.5),
        policy_factory("score"),
    )
    after = summarize(changed)["registry"]
    changes = registry_changes(trace, 0.5)
    assert after["changes"] == len(changes) > 0
    assert after["notifications"] == 3 * len(changes)
    assert 0 < after["change_queries"] <= 3 * len(changes)
    assert after["queries"] == after["cold_queries"] + after["change_queries"]


def test_simulate_a_fleet_without_the_optimum_reports_the_registry_load(tmp_path):
    out = tmp_path / "out.json"
    args = ["simulate", "--workload", "zipf", "--policy", "score", "--workers", "3"]
    args += ["--num-adapters", "50", "--rate", "8", "--duration-s", "30", "--tenants", "2"]
    args += ["--registry-changes-per-s", "0.2", "--no-optimal", "--json", str(out)]
    result = runner.invoke(app, args, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "fleet: 3 workers" in result.output and "notif/s" in result.output
    (run,) = json.loads(out.read_text())["runs"]
    assert list(run["policies"]) == ["score"] and run["workers"] == 3
    entry = run["policies"]["score"]
    assert entry["gap"] is None and entry["requests_per_wall_s"] > 0
    assert entry["registry"]["notifications"] == 3 * entry["registry"]["changes"]
    assert set(entry["tenants"]) == {"tenant-0", "tenant-1"}


def test_simulate_refuses_a_shape_for_hot_burst_and_a_bad_number():
    result = runner.invoke(app, ["simulate", "--workload", "hot-burst", "--num-adapters", "5"])
    assert result.exit_code == 2 and "takes no --num-adapters" in result.output
    result = runner.invoke(app, ["simulate", "--workload", "zipf", "--rate", "-1"])
    assert result.exit_code == 2 and "rate" in result.output


def test_plan_runs_the_workload_on_a_fleet(llama_dir, llama_adapters):
    folder = next(iter(llama_adapters.values())).parent
    args = ["plan", "--model", str(llama_dir), "--adapters", str(folder), "--workload", "zipf"]
    args += ["--workers", "2", "--num-adapters", "30", "--rate", "4", "--duration-s", "20"]
    result = runner.invoke(app, args, env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "on 2 workers" in result.output and "registry queries per second" in result.output
    assert "smallest capacity" not in result.output  # the fleet in place of the one-worker sizing
    bad = runner.invoke(
        app, ["plan", "--model", str(llama_dir), "--adapters", str(folder)] + ["--workers", "2"]
    )
    assert bad.exit_code == 2 and "give --workload" in bad.output
