"""`plan` with the router's behaviour that `simulate` models (`--router`, `--fair-share`,
`--tenant-weights`, `--holdback-window-s`, `--kv-prefix-blocks`, `--system-prompt-tokens`): the
fleet is sized under it, and its figures move with it."""

from typer.testing import CliRunner

from loraplex.sim import plan as planner
from loraplex.sim.cli import app
from loraplex.sim.workload import Request, write_trace

PROMPTS = {"rate": 20, "duration_s": 60, "num_adapters": 6, "tenants": 3}
"""Six adapters of three tenants, 20 requests a second for a minute."""


def _burst(path) -> None:
    """Tenant b: 2 requests a second for 60 s; tenant a: 200 a second from 10 s to 40 s."""
    trace = [Request(0.25 + i * 0.5, "b", "b-0", 64, 32, rank=8) for i in range(120)]
    trace += [Request(10 + i / 200, "a", f"a-{i % 2}", 64, 128, rank=8) for i in range(6000)]
    write_trace(sorted(trace, key=lambda r: r.time), path)


def _folder(llama_adapters) -> str:
    return str(next(iter(llama_adapters.values())).parent)


def test_fair_share_and_held_back_places_change_the_steady_tenant_s_ttft(
    llama_dir, llama_adapters, tmp_path
):
    _burst(tmp_path / "burst.jsonl")

    def b_p99(options: dict) -> tuple[float, dict]:
        plan = planner.make_plan(
            llama_dir,
            adapters_dir=_folder(llama_adapters),
            workload=str(tmp_path / "burst.jsonl"),
            workers=2,
            options=options,
        )
        return plan.fleet["per_tenant"]["b"]["ttft_p99_s"], plan.fleet["per_tenant"]["a"]

    first_come, a_first_come = b_p99({})
    queued, _ = b_p99({"fair_share": True, "holdback_window_s": 0.0})
    held, a_held = b_p99({"fair_share": True, "holdback_window_s": 5.0})
    assert first_come > 10 * queued  # b waits behind a's burst in the workers' queues
    assert held < 0.8 * queued  # a place kept free: b's next request starts at once
    assert a_held["held_back"] > 0 and "held_back" not in a_first_come


def test_prefix_kv_lets_the_same_fleet_hold_its_ttft(llama_dir, llama_adapters):
    def fleet(options: dict) -> dict:
        plan = planner.make_plan(
            llama_dir,
            adapters_dir=_folder(llama_adapters),
            workload="uniform",
            shape=PROMPTS,
            workers=2,
            system_prompt_tokens=1000,
            options=options,
        )
        return plan.fleet

    without, with_prefixes = fleet({}), fleet({"kv_prefix_blocks": 400})
    assert "prefix_hit_rate" not in without and with_prefixes["prefix_hit_rate"] > 0.5
    # every prompt prefilled whole: the two workers fall behind; with its prefix in KV, they keep up
    assert with_prefixes["ttft_p99_s"] < 0.1 * without["ttft_p99_s"]


def test_plan_takes_the_router_s_options_on_the_command_line(llama_dir, llama_adapters, tmp_path):
    _burst(tmp_path / "burst.jsonl")
    args = ["plan", "--model", str(llama_dir), "--adapters", _folder(llama_adapters)]
    sized = [*args, "--workload", str(tmp_path / "burst.jsonl"), "--workers", "2"]
    sized += ["--fair-share", "--tenant-weights", "b=2", "--holdback-window-s", "3"]
    sized += ["--kv-prefix-blocks", "64", "--system-prompt-tokens", "100", "--router", "affinity"]
    result = CliRunner().invoke(app, sized, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for row in ("tenant b: TTFT p99", "tenant a: requests held back", "prefix-cache hit"):
        assert row in result.output
    caption = (
        "router: --fair-share --holdback-window-s 3 --tenant-weights b=2 --kv-prefix-blocks 64"
    )
    assert caption in " ".join(result.output.split())  # the caption wraps at the table's width
    no_workload = CliRunner().invoke(app, [*args, "--fair-share"])
    assert no_workload.exit_code == 2 and "give --workload" in no_workload.output
    vllm = CliRunner().invoke(app, [*sized, "--engine", "vllm"])
    assert vllm.exit_code == 2
    assert "--fair-share and --kv-prefix-blocks: --engine native only" in vllm.output
