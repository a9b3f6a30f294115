"""`plan --max-num-seqs` and `simulate --max-num-seqs`: each simulated worker runs at most that
many requests at once, as `serve --max-num-seqs`; fewer running places make the queues longer, so
the same traffic needs more workers."""

import json

from typer.testing import CliRunner

from loraplex.settings.serve import DEFAULTS as SERVE
from loraplex.settings.sim import PlanSettings, SimulateSettings
from loraplex.sim import plan as planner
from loraplex.sim.cli import app
from loraplex.sim.pools import parse_sim_pool
from loraplex.sim.workload import Request, write_trace


def _steady(path) -> str:
    """One tenant, 40 requests a second over four adapters for 30 s."""
    write_trace(
        [Request(i / 40, "acme", f"acme-{i % 4}", 64, 64, rank=8) for i in range(1200)], path
    )
    return str(path)


def _folder(llama_adapters) -> str:
    return str(next(iter(llama_adapters.values())).parent)


def test_the_default_is_serve_s_and_both_commands_take_it():
    assert SERVE.max_num_seqs == 64
    assert PlanSettings(model="m", adapters="a").max_num_seqs == SERVE.max_num_seqs
    assert SimulateSettings(workload=("zipf",)).max_num_seqs == SERVE.max_num_seqs


def test_a_pool_with_fewer_running_places_needs_more_workers(llama_dir, llama_adapters, tmp_path):
    trace = _steady(tmp_path / "steady.jsonl")

    def shared(**capacities) -> tuple[dict, float]:
        plan = planner.make_plan(
            llama_dir,
            adapters_dir=_folder(llama_adapters),
            workload=trace,
            pools=(parse_sim_pool("name=shared,workers=2"),),
            **capacities,
        )
        return plan.fleet["pools"][0], plan.fleet["ttft_p99_s"]

    (default, default_p99), (narrow, narrow_p99) = shared(), shared(max_num_seqs=16)
    assert default == shared(max_num_seqs=64)[0]  # the flag's default is the figure it replaces
    assert default["needed"] == 1
    assert narrow["needed"] is not None and narrow["needed"] > default["needed"]
    assert narrow_p99 > 10 * default_p99  # 16 running of about 40 a second each for a second


def test_plan_and_simulate_take_max_num_seqs_on_the_command_line(
    llama_dir, llama_adapters, tmp_path
):
    trace = _steady(tmp_path / "steady.jsonl")
    args = ["plan", "--model", str(llama_dir), "--adapters", _folder(llama_adapters)]
    sized = [*args, "--workload", trace, "--workers", "2"]
    result = CliRunner().invoke(app, [*sized, "--max-num-seqs", "16"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "max-num-seqs 16" in result.output
    default = CliRunner().invoke(app, sized, env={"COLUMNS": "200"})
    assert default.exit_code == 0 and "max-num-seqs 64" in default.output
    bad = CliRunner().invoke(app, [*sized, "--max-num-seqs", "0"])
    assert bad.exit_code == 2 and "must be at least 1" in bad.output

    def simulated(*extra: str) -> dict:
        out = tmp_path / f"sim{len(extra)}.json"
        command = ["simulate", "--workload", trace, "--policy", "score", "--no-optimal"]
        ran = CliRunner().invoke(app, [*command, "--workers", "2", "--json", str(out), *extra])
        assert ran.exit_code == 0, ran.output
        return json.loads(out.read_text())["runs"][0]

    wide, narrow = simulated(), simulated("--max-num-seqs", "16")
    assert (wide["max_num_seqs"], narrow["max_num_seqs"]) == (64, 16)
    p99 = [r["policies"]["score"]["latency"]["all"]["ttft_s"]["p99"] for r in (wide, narrow)]
    assert p99[1] > 10 * p99[0]
