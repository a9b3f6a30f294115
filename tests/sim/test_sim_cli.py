"""`simulate` and `plan` as typer commands: flags, table, JSON entries per policy plus optimal, the
plot."""

import json
import re

import pytest
from typer.testing import CliRunner

from loraplex.sim import cli, plot
from loraplex.sim import workload as workload_module
from loraplex.sim.cli import app
from loraplex.sim.workload import Capacity, Request, WorkloadSpec, generate, write_trace

runner = CliRunner()


def test_simulate_sweeps_into_one_table_json_and_plot(tmp_path):
    trace = tmp_path / "trace.jsonl"
    write_trace(generate(WorkloadSpec(name="t", duration_s=40.0, rate=3.0, num_adapters=20)), trace)
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    result = runner.invoke(
        app,
        [
            "simulate",
            "--workload",
            str(trace),
            "--policy",
            "lru,score",
            "--gpu-slots",
            "2,4",
            "--cpu-bytes",
            "1GiB",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        env={"COLUMNS": "250"},
    )
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
    result = runner.invoke(
        app, ["plan", "--adapters", str(folder), "--model", str(llama_dir)], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "attn-r8" in result.output and "what fits" in result.output
    result = runner.invoke(app, ["plan", "--model", str(llama_dir)])
    assert result.exit_code != 0


def test_plan_on_the_vllm_engine_sizes_its_host_cache_in_adapters(
    llama_dir, llama_adapters, tmp_path
):
    folder = next(iter(llama_adapters.values())).parent
    trace = small_trace(tmp_path / "trace.jsonl")
    args = ["plan", "--adapters", str(folder), "--model", str(llama_dir), "--engine", "vllm"]
    result = runner.invoke(app, [*args, "--workload", str(trace)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "engine vllm" in " ".join(result.output.split()) and " adapters " in result.output
    fleet = runner.invoke(
        app,
        [*args, "--workload", str(trace), "--workers", "2", "--max-cpu-loras", "6"],
        env={"COLUMNS": "200"},
    )
    assert fleet.exit_code == 0, fleet.output
    assert "engine vllm, cpu 6 adapters" in " ".join(fleet.output.split())  # the title, wrapped


def test_plan_says_why_a_sizing_was_not_reached(llama_dir, llama_adapters, tmp_path):
    # ten warm adapters and eight cold ones: their first requests are cold whatever the cache
    trace = [Request(0.5 * i, "t", f"warm{i % 10}", 16, 4, rank=8) for i in range(400)]
    trace += [Request(0.5 * i + 0.25, "t", f"cold{i}", 16, 4, rank=8) for i in range(0, 400, 50)]
    write_trace(sorted(trace, key=lambda r: r.time), tmp_path / "trace.jsonl")
    folder = next(iter(llama_adapters.values())).parent
    args = [
        "plan",
        "--adapters",
        folder,
        "--model",
        llama_dir,
        "--workload",
        tmp_path / "trace.jsonl",
    ]
    result = runner.invoke(app, list(map(str, args)), env={"COLUMNS": "60"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "│ cold starts ≤ 1% │ 8 │ - │ not reached │" in " ".join(
        CliRunner().invoke(app, list(map(str, args)), env={"COLUMNS": "200"}).output.split()
    )
    assert re.search(
        r"cold starts ≤ 1% not reached: 4\.41% at [\d.]+ KiB, the largest tried; the first "
        r"request of each of its 18 adapters is cold whatever the cache: 4\.41% at least",
        text,
    ), text


def small_trace(path, seed=0):
    write_trace(
        generate(WorkloadSpec(name="t", seed=seed, duration_s=20.0, rate=3.0, num_adapters=10)),
        path,
    )
    return path


def test_plot_of_a_slots_by_cpu_sweep_keeps_each_cpu_size_on_its_own_line(tmp_path):
    trace = small_trace(tmp_path / "trace.jsonl")
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    result = runner.invoke(
        app,
        [
            "simulate",
            "--workload",
            str(trace),
            "--policy",
            "lru",
            "--gpu-slots",
            "1,2",
            "--cpu-bytes",
            "0,1GiB",
            "--json",
            str(out),
            "--plot",
            str(png),
        ],
        env={"COLUMNS": "250"},
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [(r["gpu_slots"], r["cpu_bytes"]) for r in data["runs"]] == [
        (1, 0),
        (1, 2**30),
        (2, 0),
        (2, 2**30),
    ]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    xlabel, lines = plot.plot_lines(data["runs"])
    assert xlabel == "gpu slots"
    assert sorted(lines) == ["lru, cpu 0B", "lru, cpu 1GiB", "optimal, cpu 0B", "optimal, cpu 1GiB"]
    for label, points in lines.items():
        cpu = 0 if "0B" in label else 2**30
        runs = [r for r in data["runs"] if r["cpu_bytes"] == cpu]
        assert [x for x, _ in points] == [1, 2]
        assert [e for _, e in points] == [r["policies"][label.split(",")[0]] for r in runs]


def test_plot_lines_follow_cpu_when_only_cpu_is_swept():
    entry = {"lru": {"hit_rate": {"gpu": 0.5}}}
    runs = [{"gpu_slots": 4, "cpu_bytes": c, "policies": entry} for c in (2 * 2**30, 2**30)]
    xlabel, lines = plot.plot_lines(runs)
    assert xlabel == "cpu cache (GiB)" and list(lines) == ["lru"]
    assert [x for x, _ in lines["lru"]] == [1.0, 2.0]


def test_json_is_written_before_the_plot(tmp_path, monkeypatch):
    def broken(runs, path):
        raise RuntimeError("no plotting backend")

    monkeypatch.setattr(cli, "plot_capacity", broken)
    out = tmp_path / "out.json"
    result = runner.invoke(
        app,
        [
            "simulate",
            "--workload",
            str(small_trace(tmp_path / "t.jsonl")),
            "--policy",
            "lru",
            "--gpu-slots",
            "2",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "out.png"),
        ],
    )
    assert isinstance(result.exception, RuntimeError)
    assert [r["gpu_slots"] for r in json.loads(out.read_text())["runs"]] == [2]


def test_plot_sweeps_slots_around_each_workloads_own_capacity(tmp_path, monkeypatch):
    first, second = small_trace(tmp_path / "a.jsonl"), small_trace(tmp_path / "b.jsonl", seed=1)
    monkeypatch.setitem(
        workload_module.CAPACITIES, str(first), Capacity(gpu_slots=2, cpu_bytes=2**30)
    )
    monkeypatch.setitem(
        workload_module.CAPACITIES, str(second), Capacity(gpu_slots=6, cpu_bytes=2**30)
    )
    plotted = []
    monkeypatch.setattr(cli, "plot_capacity", lambda runs, path: plotted.extend(runs))
    result = runner.invoke(
        app,
        [
            "simulate",
            "--workload",
            f"{first},{second}",
            "--policy",
            "lru",
            "--plot",
            str(tmp_path / "out.png"),
        ],
        env={"COLUMNS": "250"},
    )
    assert result.exit_code == 0, result.output

    def slots(path):
        return [r["gpu_slots"] for r in plotted if r["workload"] == str(path)]

    assert slots(first) == [1, 2, 4, 8]  # ½×, 1×, 2×, 4× of each workload's own slots
    assert slots(second) == [3, 6, 12, 24]


BAD_TRACES = {
    "not JSON": '{"time": 1.0, "adapter": "x"',
    "a list": "[1, 2]",
    "no time": '{"adapter": "x", "prompt_tokens": 8, "output_tokens": 4}',
    "a null time": '{"time": null, "adapter": "x", "prompt_tokens": 8, "output_tokens": 4}',
}
GOOD_LINE = '{"time": 0.0, "tenant": "a", "adapter": "x", "prompt_tokens": 8, "output_tokens": 4}'


@pytest.mark.parametrize("bad", list(BAD_TRACES))
def test_simulate_refuses_a_bad_trace_line_naming_file_and_line(tmp_path, bad):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(GOOD_LINE + "\n" + BAD_TRACES[bad] + "\n")
    result = runner.invoke(app, ["simulate", "--workload", str(trace)], env={"COLUMNS": "250"})
    assert result.exit_code == 2, result.output
    assert f"{trace} line 2" in result.stderr


def test_simulate_refuses_an_empty_trace(tmp_path):
    trace = tmp_path / "empty.jsonl"
    trace.write_text("\n")
    result = runner.invoke(app, ["simulate", "--workload", str(trace)], env={"COLUMNS": "250"})
    assert result.exit_code == 2, result.output
    assert "no requests" in result.stderr


def plan_args(llama_dir, llama_adapters, *extra):
    folder = next(iter(llama_adapters.values())).parent
    return ["plan", "--adapters", str(folder), "--model", str(llama_dir), *map(str, extra)]


def test_plan_refuses_bad_inputs_with_one_line(llama_dir, llama_adapters, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(GOOD_LINE + "\n[1, 2]\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cases = {
        "no adapters folder": (
            ["plan", "--adapters", str(tmp_path / "none"), "--model", str(llama_dir)],
            "is not a directory",
        ),
        "a file as the folder": (
            ["plan", "--adapters", str(bad), "--model", str(llama_dir)],
            "is not a directory",
        ),
        "an unknown workload": (
            plan_args(llama_dir, llama_adapters, "--workload", "nope"),
            "unknown workload 'nope'",
        ),
        "a bad trace line": (
            plan_args(llama_dir, llama_adapters, "--workload", bad),
            f"{bad} line 2",
        ),
        "an empty trace": (
            plan_args(llama_dir, llama_adapters, "--workload", empty),
            "no requests",
        ),
        "a missing trace": (
            plan_args(llama_dir, llama_adapters, "--workload", tmp_path / "none.jsonl"),
            "none.jsonl",
        ),
    }
    for case, (args, message) in cases.items():
        result = runner.invoke(app, args, env={"COLUMNS": "250"})
        assert result.exit_code == 2, (case, result.output)
        assert result.stderr.startswith("error: ") and message in result.stderr, case
        assert len(result.stderr.strip().splitlines()) == 1, case


def test_simulate_default_table_fits_80_columns_and_wide_shows_the_rest(tmp_path):
    trace = small_trace(tmp_path / "trace.jsonl")
    args = ["simulate", "--workload", str(trace), "--policy", "lru,score", "--gpu-slots", "2"]
    compact = runner.invoke(app, args, env={"COLUMNS": "80"})
    assert compact.exit_code == 0, compact.output
    lines = compact.output.splitlines()
    assert max(map(len, lines)) <= 80
    header = next(line for line in lines if "policy" in line)
    for col in ("policy", "gpu hit", "cpu hit", "cold", "miss s", "gap", "hot p99"):
        assert col in header  # whole, not cut to "…"
    assert "…" not in compact.output and "thrash" not in compact.output
    assert "slots 2" in compact.output  # the fixed capacity in the title
    rows = {line.split("│")[1].strip(): line for line in lines if line.count("│") > 5}
    assert {"lru", "score", "optimal"} <= set(rows)
    swept = runner.invoke(
        app, ["simulate", "--workload", str(trace), "--gpu-slots", "1,2"], env={"COLUMNS": "80"}
    )
    assert swept.exit_code == 0 and "…" not in swept.output
    assert max(map(len, swept.output.splitlines())) <= 80
    wide = runner.invoke(app, [*args, "--wide"], env={"COLUMNS": "250"})
    assert wide.exit_code == 0, wide.output
    assert "thrash" in wide.output and "TPOT p99" in wide.output and "per tenant" in wide.output


@pytest.mark.parametrize(
    "option, path, message",
    [
        ("--plot", "out.txt", "--plot out.txt: use a .png, .svg or .pdf file"),
        ("--plot", "out", "--plot out: use a .png, .svg or .pdf file"),
        ("--plot", "a-file/out.png", "--plot a-file/out.png: a-file is not a directory"),
        ("--plot", "a-dir", "--plot a-dir: use a .png, .svg or .pdf file"),
        ("--plot", "a-dir.png", "--plot a-dir.png: a directory"),
        ("--json", "a-file/out.json", "--json a-file/out.json: a-file is not a directory"),
        ("--json", "a-dir", "--json a-dir: a directory"),
        # refused on writing, whatever the permissions say (root's included)
        ("--json", "/proc/out.json", "--json /proc/out.json: cannot write in /proc: "),
        ("--plot", "/proc/x/out.png", "--plot /proc/x/out.png: cannot write in /proc: "),
    ],
)
def test_simulate_checks_its_output_paths_before_it_runs(
    tmp_path, monkeypatch, option, path, message
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-dir.png").mkdir()
    ran = []
    monkeypatch.setattr(cli, "run_sweep", lambda *args, **kwargs: ran.append(args) or [])
    result = runner.invoke(app, ["simulate", "--workload", "zipf", option, path])
    assert result.exit_code == 2 and not ran, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {message}"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-dir", "a-dir.png", "a-file"]


def test_simulate_makes_the_folders_of_its_outputs(tmp_path, monkeypatch):
    made = []
    monkeypatch.setattr(cli, "plot_capacity", lambda runs, path: made.append(path.parent))
    trace = small_trace(tmp_path / "t.jsonl")
    out, png = tmp_path / "new" / "out.json", tmp_path / "new" / "plots" / "out.png"
    args = ["simulate", "--workload", str(trace), "--policy", "lru", "--gpu-slots", "2"]
    result = runner.invoke(app, [*args, "--json", str(out), "--plot", str(png), "--no-optimal"])
    assert result.exit_code == 0, result.output
    assert out.is_file() and made == [png.parent] and png.parent.is_dir()
