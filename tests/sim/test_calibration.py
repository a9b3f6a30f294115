"""The simulator's calibration: the package's defaults, a `--calibration FILE` for `simulate` and
`plan`, and one line on stderr for a file that cannot be used."""

import json

import pytest
from typer.testing import CliRunner

from loraplex.sim import fleet_plan
from loraplex.sim import plan as planner
from loraplex.sim.calibration import Calibration, CalibrationError, read_calibration
from loraplex.sim.cli import app
from loraplex.sim.config import LLAMA7B_BYTES_PER_RANK
from loraplex.sim.workload import Request, write_trace

runner = CliRunner()
RANK = 8
TIMINGS = ("wall_s", "cpu_s", "requests_per_wall_s", "requests_per_cpu_s")


def cold_trace(path):
    """Five requests, each for an adapter of its own, 10 s apart: every one a cold start alone."""
    write_trace([Request(10.0 * i, "t", f"a{i}", 16, 4, rank=RANK) for i in range(5)], path)
    return path


def simulated(tmp_path, trace, *extra) -> dict:
    out = tmp_path / "out.json"
    args = ["simulate", "--workload", trace, "--policy", "lru", "--gpu-slots", "2"]
    result = runner.invoke(app, [*map(str, args), "--no-optimal", "--json", str(out), *extra])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def figures(data: dict) -> dict:
    """What a run simulates (no wall-clock timings)."""
    entry = data["runs"][0]["policies"]["lru"]
    return {k: v for k, v in entry.items() if k not in TIMINGS}


def doubled_load_costs() -> dict:
    data = Calibration().to_dict()
    for tier in data["costs"].values():
        tier["latency_s"] *= 2
        tier["bandwidth_bytes_per_s"] /= 2
    return {"costs": data["costs"]}


def test_doubled_load_costs_add_one_load_to_each_cold_start(tmp_path):
    trace = cold_trace(tmp_path / "trace.jsonl")
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(doubled_load_costs()))
    default = figures(simulated(tmp_path, trace))
    doubled = figures(simulated(tmp_path, trace, "--calibration", str(slow)))
    costs = Calibration().costs
    load_s = sum(
        t.seconds(RANK * LLAMA7B_BYTES_PER_RANK) for t in (costs.remote, costs.disk, costs.h2d)
    )
    ttft = {
        name: f["latency"]["cold"]["ttft_s"]["p50"]
        for name, f in (("1x", default), ("2x", doubled))
    }
    assert ttft["2x"] - ttft["1x"] == pytest.approx(load_s)
    assert doubled["miss_cost"] == pytest.approx(2 * default["miss_cost"])


def test_the_default_run_is_the_run_given_the_package_defaults_as_a_file(tmp_path):
    trace = cold_trace(tmp_path / "trace.jsonl")
    shipped = tmp_path / "defaults.json"
    shipped.write_text(json.dumps(Calibration().to_dict()))
    default = simulated(tmp_path, trace)
    given = simulated(tmp_path, trace, "--calibration", str(shipped))
    assert figures(given) == figures(default)
    assert default["meta"]["config"]["costs"]["source"] == "defaults"
    assert given["meta"]["config"]["costs"]["source"] == str(shipped)


def test_a_file_may_leave_figures_out_and_those_keep_their_defaults(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"service": {"step_s": 0.02}}))
    calibration = read_calibration(path)
    assert calibration.service.step_s == 0.02
    assert calibration.service.per_adapter_s == Calibration().service.per_adapter_s
    assert calibration.costs.disk == Calibration().costs.disk
    assert read_calibration(None) == Calibration()


def test_the_documented_defaults_are_the_package_defaults():
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "capacity-planning.md").read_text()
    block = text.split("<!-- calibration defaults -->\n```json\n", 1)[1].split("```", 1)[0]
    assert json.loads(block) == Calibration().to_dict()


BAD_FILES = {
    "missing": (None, "No such file"),
    "not JSON": ("{", "not JSON"),
    "a list": ("[]", "expected an object"),
    "an unknown section": ('{"cost": {}}', "unknown key 'cost'"),
    "an unknown figure": ('{"costs": {"disk": {"latency": 1}}}', "unknown key 'latency'"),
    "a string figure": ('{"service": {"step_s": "fast"}}', "service.step_s: 'fast' is not"),
    "a negative latency": ('{"costs": {"h2d": {"latency_s": -1}}}', "must be at least 0"),
    "no bandwidth": ('{"costs": {"remote": {"bandwidth_bytes_per_s": 0}}}', "must be above 0"),
    "NaN": ('{"service": {"per_decode_s": NaN}}', "is not a number"),
}


@pytest.mark.parametrize("bad", list(BAD_FILES))
def test_a_bad_file_is_one_line_and_exit_2_before_the_run(tmp_path, bad):
    text, message = BAD_FILES[bad]
    path = tmp_path / "calibration.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(CalibrationError, match=message):
        read_calibration(path)
    commands = {
        "simulate": ["simulate", "--workload", "zipf", "--calibration", str(path)],
        # a model directory that does not exist: the calibration is checked first
        "plan": ["plan", "--model", str(tmp_path / "none"), "--adapters", str(tmp_path)],
    }
    commands["plan"] += ["--calibration", str(path)]
    for name, args in commands.items():
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (name, result.output)
        assert result.stderr.startswith(f"error: --calibration {path}: "), name
        assert message in result.stderr and len(result.stderr.splitlines()) == 1, name
        assert result.stdout == "", name


def test_plan_sizes_with_the_given_calibration(llama_dir, llama_adapters, tmp_path, monkeypatch):
    trace = [Request(0.5 * i, "t", f"a{i % 4}", 16, 4, rank=8) for i in range(40)]
    write_trace(trace, tmp_path / "trace.jsonl")
    folder = next(iter(llama_adapters.values())).parent
    slow = read_calibration_of(tmp_path, doubled_load_costs())
    configs = []
    for module in (planner, fleet_plan):  # the one-worker sizing, and a fleet's run
        real = module.simulate
        monkeypatch.setattr(
            module, "simulate", lambda t, c, p, real=real: configs.append(c) or real(t, c, p)
        )
    workload = str(tmp_path / "trace.jsonl")
    for workers in (1, 2):
        planner.make_plan(
            llama_dir, adapters_dir=folder, workload=workload, workers=workers, calibration=slow
        )
    assert len(configs) > 2 and configs[-1].workers == 2
    assert all(c.costs == slow.costs and c.service == slow.service for c in configs)


def read_calibration_of(tmp_path, data: dict) -> Calibration:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    return read_calibration(path)
