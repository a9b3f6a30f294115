"""`simulate` and `plan` as typer commands: flags, table, JSON entries per policy plus optimal, the plot."""

import json

from typer.testing import CliRunner

from loraplex.sim.cli import app
from loraplex.sim.workload import WorkloadSpec, generate, write_trace

runner = CliRunner()


def test_simulate_sweeps_into_one_table_json_and_plot(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(generate(WorkloadSpec(name="t", duration_s=40.0, rate=3.0, num_adapters=20)), trace)
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    result = runner.invoke(app, ["simulate", "--workload", str(trace), "--policy", "lru,score", "--gpu-slots", "2,4",
                                 "--cpu-bytes", "1GiB", "--json", str(out), "--plot", str(png)],
                           env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "optimal (bound)" in result.output and "gap" in result.output
    data = json.loads(out.read_text())
    assert [(r["gpu_slots"], r["cpu_bytes"]) for r in data["runs"]] == [(2, 2**30), (4, 2**30)]
    for run in data["runs"]:
        assert list(run["policies"]) == ["lru", "score", "optimal"]
        for entry in run["policies"].values():
            assert {"miss_cost", "hit_rate", "gap", "latency", "tenants"} <= set(entry)
            assert set(entry["latency"]["all"]["ttft_s"]) == {"p50", "p95", "p99"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_refuses_unknown_names():
    result = runner.invoke(app, ["simulate", "--workload", "nope"])
    assert result.exit_code != 0 and "neither a named workload" in result.output
    result = runner.invoke(app, ["simulate", "--workload", "zipf", "--policy", "fifo"])
    assert result.exit_code != 0 and "unknown policy" in result.output


def test_plan_prints_sizes_and_fits(llama_dir, llama_adapters):
    folder = next(iter(llama_adapters.values())).parent
    result = runner.invoke(app, ["plan", "--adapters", str(folder), "--model", str(llama_dir)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "attn-r8" in result.output and "what fits" in result.output
    result = runner.invoke(app, ["plan", "--model", str(llama_dir)])
    assert result.exit_code != 0
