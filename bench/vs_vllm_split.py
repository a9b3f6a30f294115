"""Where the time goes: loraplex on vLLM against vLLM in the same environment, with and without
loraplex's vLLM plugin, and a profile of each server on one workload (64 adapters by default).

    python bench/vs_vllm_split.py [--servers vllm,vllm+plugin,loraplex-vllm,loraplex] [--quick]
        [--rounds N] [--clients 8] [--workloads "0 adapters,8 adapters,64 adapters"]
        [--profile SERVERS] [--profile-rate HZ] [--profile-workload "64 adapters"]
        [--json bench/results/vs_vllm_split.json]

The servers, all run by this interpreter (one environment, where loraplex is installed and so its
`vllm.general_plugins` entry point is there for vLLM to load), on `vs_vllm.py --case llama90m`'s
model, adapters, limits and closed-loop workloads:
- `vllm`: "vLLM without plugin": vLLM's OpenAI server with `VLLM_PLUGINS=""` (no plugin loads);
- `vllm+plugin`: "vLLM + loraplex plugin": the same server with every plugin the environment has,
  loraplex's two fixes among them (`loraplex.engines.vllm.patches`), as a user who installs
  loraplex beside vLLM gets it;
- `loraplex-vllm`: `loraplex serve --engine vllm` at its defaults (the plugin active);
- `loraplex`: `loraplex serve` on its native engine (its engine core in a process of its own).
Each server's log is checked for the plugin's line, and the JSON says whether it was seen. The
servers take turns `--rounds` times; figures are medians. Ratios: each loraplex server's tokens/s
over `vllm+plugin`'s (the same vLLM, the same fixes: the cost of loraplex's layer) and over
`vllm`'s (vLLM as released).

`--profile`: after the rounds, each named server starts again, warms the adapters of
`--profile-workload` (64 adapters by default) and serves that workload while py-spy (`--subprocesses
--nonblocking --format raw`) samples the API process and its children (vLLM's engine core, the
native engine's process). Loraplex servers run under `split_probe.py`, which times the request
path's waits, and every server on vLLM under its probe of vLLM's engine steps (each step that
produced tokens, with its rows). The report per server:
- wall clock per request (ms): loraplex's `acquire` (everything before the engine gets the
  request), of it the wait for a slot (admission) and for a load (staging + vLLM's add_lora), the
  staging and add_lora calls themselves, and each as a share of the clients' time; the native
  engine's queue wait (arrival to the running batch) and vLLM's (its scheduler's queue, plain vLLM
  only) from their /metrics;
- CPU (py-spy samples, `cpu_split.py`): the API process split into staging, acquire (residency),
  loraplex's serving layer, vLLM's front end, the HTTP server and the rest; the engine process into
  the model forward and the step loop; CPU seconds per request of each process (psutil).
Throughput under profiling is given but is not the comparison's: the sampler takes CPU too.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
from cpu_split import attribute, root_pid, top_frames
from rich.console import Console
from rich.table import Table
from vs_vllm import (
    LLAMA90M,
    LLAMA90M_LIMITS,
    LLAMA90M_OUTPUT,
    LLAMA90M_PROMPT,
    LLAMA90M_WORKLOADS,
    Server,
    combine,
    cpu_spent,
    free_port,
    llama90m_measure,
    llama90m_trace,
    llama90m_world,
    process_tree_cpu,
)

from loraplex.loadgen.traffic import LoadConfig, run

BENCH = Path(__file__).resolve().parent
LABELS = {
    "vllm": "vLLM without plugin",
    "vllm+plugin": "vLLM + loraplex plugin",
    "loraplex-vllm": "loraplex --engine vllm (plugin active)",
    "loraplex": "loraplex native engine",
}
REFERENCES = ("vllm+plugin", "vllm")  # the ratios' denominators, in this order
PLUGIN_LINES = (  # what loraplex's plugin logs in each vLLM process where it applies a fix
    "loraplex: the scheduler counts pinned LoRA slots",
    "loraplex: CPU LoRA ops patched",
)
PY_SPY = Path(sys.executable).with_name("py-spy")
WAIT_METRICS = re.compile(
    r"^(loraplex_request_queue_wait_seconds|loraplex_adapter_\w+_seconds"
    r"|vllm:request_queue_time_seconds)_(sum|count)(\{[^}]*\})? ([0-9.eE+-]+)$"
)


LIMITS = dict(LLAMA90M_LIMITS)  # --max-cpu-loras may change its host cache's size


def start(name: str, model_dir: Path, adapters: dict, tmp: Path, run_id: str, probe=None) -> Server:
    """One of LABELS' servers, with a data directory and log of its own; `probe`: a file for
    `split_probe.py`'s records."""
    limits = [f"--{flag.replace('_', '-')}={value}" for flag, value in LIMITS.items()]
    common = ["--model", str(model_dir), "--dtype", "float32", *limits]
    modules = ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    max_len = str(LLAMA90M["max_position_embeddings"])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_PLUGINS", None)  # every plugin of this environment: loraplex's among them
    if name in ("vllm", "vllm+plugin"):
        if probe:  # the probe of engine steps, then vLLM's server
            args = [sys.executable, str(BENCH / "split_probe.py"), str(probe), "vllm", *common]
        else:
            args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *common]
        args += ["--max-model-len", max_len, "--enable-lora"]
        if name == "vllm":
            env["VLLM_PLUGINS"] = ""  # no plugin loads: vLLM as released
    else:
        runner = [str(BENCH / "split_probe.py"), str(probe)] if probe else ["-m", "loraplex.cli"]
        args = [
            sys.executable,
            *runner,
            "serve",
            *common,
            "--data-dir",
            str(tmp / f"data-{run_id}"),
        ]
        if name == "loraplex-vllm":
            args += ["--engine", "vllm", f"--vllm-arg=--max-model-len={max_len}"]
        else:
            args += ["--engine-core", "process"]
            env["OMP_NUM_THREADS"] = "1"
    port = free_port()
    return Server(name, [*args, *modules, "--port", str(port)], env, tmp / f"{run_id}.log", port)


def plugin_seen(server: Server) -> bool:
    server.log.flush()
    text = Path(server.log.name).read_text(errors="replace")
    return any(line in text for line in PLUGIN_LINES)


def compare(args, model_dir: Path, adapters: dict, tmp: Path, console: Console) -> dict:
    """Every server of --servers in turn, --rounds times: medians per workload, and whether each
    server's log showed loraplex's plugin."""
    num_requests = 24 if args.quick else 48
    workloads = [w for w in args.workloads.split(",") if w]
    rounds: dict[str, list[dict]] = {name: [] for name in args.servers}
    plugin: dict[str, bool] = {}
    for i in range(args.rounds):
        for name in args.servers:
            console.log(f"starting {name} ({LABELS[name]}), round {i + 1}")
            server = start(name, model_dir, adapters, tmp, f"{name}-{i}")
            try:
                done = llama90m_measure(server, args.clients, num_requests, console, workloads)
                rounds[name].append(done)
                plugin[name] = plugin.get(name, True) and plugin_seen(server)
            finally:
                server.stop()
    results = {n: {w: combine([r[w] for r in rs]) for w in workloads} for n, rs in rounds.items()}
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    pairs = [(n, ref) for n in args.servers if n not in REFERENCES for ref in REFERENCES]
    pairs.append(("vllm+plugin", "vllm"))  # what the plugin alone gives vLLM
    for name, ref in pairs:
        if name in results and ref in results:
            ratios.setdefault(name, {})[ref] = {
                w: round(tok_s(results[name][w]) / tok_s(results[ref][w]), 2)
                for w in workloads
                if tok_s(results[ref][w])
            }
    return {"results": results, "ratios": ratios, "plugin_seen": plugin}


def tok_s(row: dict) -> float:
    return row["throughput_tok_s"]


def metric_sums(url: str) -> dict[str, float]:
    """The wait and load-stage histograms' _sum and _count from /metrics, summed over labels."""
    try:
        r = httpx.get(f"{url}/metrics", timeout=30)
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    if r.status_code != 200:
        return out
    for line in r.text.splitlines():
        match = WAIT_METRICS.match(line)
        if match:
            key = f"{match[1]}_{match[2]}"
            out[key] = out.get(key, 0.0) + float(match[4])
    return out


def probe_waits(path: Path, since: float, until: float, requests: int, client_s: float) -> dict:
    """The probe's calls that ended in [since, until]: count, ms per request and share of the
    clients' time, per probe; and vLLM's steps that produced tokens, with their rows."""
    totals: dict[str, list[float]] = {}
    rows: list[int] = []
    missing: list[str] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "missing" in record:
                missing = record["missing"]
            elif since <= record["end"] <= until:
                totals.setdefault(record["name"], []).append(record["s"])
                if "rows" in record:
                    rows.append(record["rows"])
    waits = {
        name: {
            "calls": len(values),
            "ms_per_request": round(sum(values) * 1000 / max(1, requests), 2),
            "p50_ms": round(statistics.median(values) * 1000, 2),
            "max_ms": round(max(values) * 1000, 1),
            "share_of_client_time": round(sum(values) / client_s, 3) if client_s else None,
        }
        for name, values in totals.items()
        if name != "step"
    }
    steps = None
    if rows:
        steps = {
            "steps_with_tokens": len(rows),
            "rows_per_step_mean": round(statistics.mean(rows), 2),
            "rows_per_step_p50": statistics.median(rows),
            "tokens": sum(rows),
        }
    return {"waits": waits, "steps": steps, "missing": missing}


def metric_waits(before: dict, after: dict, requests: int) -> dict:
    """Per request (ms) and mean per observation (ms) of each histogram's growth."""
    out = {}
    for key in after:
        if not key.endswith("_sum"):
            continue
        name = key[: -len("_sum")]
        total = after[key] - before.get(key, 0.0)
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if count:
            out[name] = {
                "observations": int(count),
                "mean_ms": round(total * 1000 / count, 2),
                "ms_per_request": round(total * 1000 / max(1, requests), 2),
            }
    return out


def sampled(server: Server, out: Path, rate: int, trace: list, clients: int) -> tuple[dict, str]:
    """The closed-loop run of `trace` under py-spy; (the load's summary, the collapsed stacks)."""
    spy = subprocess.Popen(
        [str(PY_SPY), "record", "--subprocesses", "--nonblocking", "--full-filenames"]
        + ["--format", "raw", "--rate", str(rate), "--output", str(out)]
        + ["--pid", str(server.p.pid)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    time.sleep(2)  # py-spy attaches before the load starts
    try:
        summary = run(LoadConfig(url=server.url, clients=clients), trace)
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled as it stops
        try:
            _, err = spy.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
    if not out.is_file():
        raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-2000:]}")
    text = out.read_text(errors="replace")
    with gzip.open(out.with_name(out.name + ".gz"), "wt") as kept:  # collapsed stacks are large
        kept.write(text)
    out.unlink()
    return summary, text


def profile_one(name: str, args, model_dir: Path, adapters: dict, tmp: Path, console) -> dict:
    """One server on --profile-workload under py-spy and the probe."""
    count, base_share = LLAMA90M_WORKLOADS[args.profile_workload]
    probe = tmp / f"probe-{name}.jsonl"
    server = start(name, model_dir, adapters, tmp, f"{name}-profile", probe)
    try:
        warm = [replace(r, output_tokens=2) for r in llama90m_trace(count, count)]
        run(LoadConfig(url=server.url, clients=args.clients), warm)
        trace = llama90m_trace(count, 24 if args.quick else 48, base_share)
        metrics_before, cpu_before = metric_sums(server.url), process_tree_cpu(server.p.pid)
        since = time.time()
        stacks_path = Path(args.json).with_name(f"{Path(args.json).stem}_{name}.collapsed.txt")
        summary, stacks = sampled(server, stacks_path, args.profile_rate, trace, args.clients)
        until = time.time()
        api_cpu, engine_cpu = cpu_spent(cpu_before, process_tree_cpu(server.p.pid), server.p.pid)
        metrics_after = metric_sums(server.url)
        pid = server.p.pid
    finally:
        server.stop()
    served = max(1, summary["requests"] - summary["failed"])
    client_s = args.clients * summary["duration_s"]
    report = {
        "label": LABELS[name],
        "workload": args.profile_workload,
        "requests": summary["requests"],
        "errors": summary["failed"],
        "throughput_tok_s_under_profiling": summary["throughput"]["output_tokens_per_s"],
        "ttft_p50_ms": summary["latency"]["all"]["ttft_ms"]["p50"],
        "e2e_p50_ms": summary["latency"]["all"]["e2e_ms"]["p50"],
        "client_time_s": round(client_s, 2),
        "cpu_ms_per_request": {
            "api_process": round(api_cpu * 1000 / served, 1),
            "engine_processes": round(engine_cpu * 1000 / served, 1),
        },
        "metrics_waits": metric_waits(metrics_before, metrics_after, served),
        "probe": probe_waits(probe, since, until, served, client_s),
        "cpu_split": attribute(stacks, pid, {"api": api_cpu, "engine": engine_cpu}),
        "api_top_leaf_frames": top_frames(stacks, pid),
        "collapsed_stacks": f"{stacks_path}.gz",
    }
    console.log(name, "profiled:", report["cpu_ms_per_request"], report["probe"])
    return report


def resplit(path: Path) -> dict:
    """A written report's profiles split again from their kept stacks by the current rules."""
    report = json.loads(path.read_text())
    for prof in report.get("profile", {}).values():
        with gzip.open(prof["collapsed_stacks"], "rt") as f:
            stacks = f.read()
        pid = root_pid(stacks)
        served = max(1, prof["requests"] - prof["errors"])
        cpu = prof["cpu_ms_per_request"]
        cpu_s = {
            "api": cpu["api_process"] * served / 1000,
            "engine": cpu["engine_processes"] * served / 1000,
        }
        prof["cpu_split"] = attribute(stacks, pid, cpu_s)
        prof["api_top_leaf_frames"] = top_frames(stacks, pid)
    path.write_text(json.dumps(report, indent=2))
    return report


def print_comparison(console: Console, compared: dict, args) -> None:
    results, ratios = compared["results"], compared["ratios"]
    table = Table(
        title=f"90M Llama on CPU, one environment, {args.clients} closed-loop clients, "
        f"medians of {args.rounds} alternating rounds"
    )
    for c in ("workload", "server", "tok/s", "TTFT p50 ms", "TPOT p50 ms", "errors"):
        table.add_column(c, justify="right")
    workloads = next(iter(results.values()))
    for w in workloads:
        for name, by_workload in results.items():
            row = by_workload[w]
            table.add_row(
                w,
                LABELS[name],
                *(
                    str(row[c])
                    for c in ("throughput_tok_s", "ttft_p50_ms", "tpot_p50_ms", "errors")
                ),
            )
        for name, by_ref in ratios.items():
            for ref, by_w in by_ref.items():
                if w in by_w:
                    table.add_row(w, f"{LABELS[name]} / {LABELS[ref]}", str(by_w[w]), "", "", "")
        table.rows[-1].end_section = True
    console.print(table)
    console.print({"loraplex plugin line in the log": compared["plugin_seen"]})


def print_profile(console: Console, profiles: dict) -> None:
    table = Table(
        title=f"{_workload(profiles)} under py-spy: CPU ms per request of each part (its share "
        "of its process's busy samples)"
    )
    table.add_column("part")
    for name in profiles:
        table.add_column(LABELS[name], justify="right")
    parts = sorted(
        {
            (p["role"], n)
            for prof in profiles.values()
            for n, p in prof["cpu_split"]["parts"].items()
        }
    )
    for _, part in parts:
        cells = []
        for prof in profiles.values():
            got = prof["cpu_split"]["parts"].get(part)
            served = max(1, prof["requests"] - prof["errors"])
            ms = f"{got['cpu_s'] * 1000 / served:.1f}" if got and "cpu_s" in got else "?"
            cells.append(f"{ms} ({got['share_of_role']:.0%})" if got else "")
        table.add_row(part, *cells)
    console.print(table)
    print_waits(console, profiles)


def _workload(profiles: dict) -> str:
    return next(iter(profiles.values()), {}).get("workload", "64 adapters")


def print_waits(console: Console, profiles: dict) -> None:
    waits = Table(
        title=f"{_workload(profiles)}: wall-clock waits, ms per request (share of client time)"
    )
    for c in ("server", "wait", "calls", "ms/request", "p50 ms", "max ms", "share"):
        waits.add_column(c, justify="right")
    for name, prof in profiles.items():
        for wait, w in ((prof["probe"] or {}).get("waits") or {}).items():
            share = w["share_of_client_time"]
            waits.add_row(
                LABELS[name],
                wait,
                str(w["calls"]),
                str(w["ms_per_request"]),
                str(w["p50_ms"]),
                str(w["max_ms"]),
                f"{share:.1%}" if share is not None else "",
            )
        for metric, m in prof["metrics_waits"].items():
            waits.add_row(
                LABELS[name], metric, str(m["observations"]), str(m["ms_per_request"]), "", "", ""
            )
        waits.add_row(
            LABELS[name],
            "CPU ms/request: API, engine",
            "",
            f"{prof['cpu_ms_per_request']['api_process']}, "
            f"{prof['cpu_ms_per_request']['engine_processes']}",
            "",
            "",
            "",
        )
        steps = (prof["probe"] or {}).get("steps")
        if steps:
            waits.add_row(
                LABELS[name],
                "vLLM steps with tokens: rows/step mean, p50",
                str(steps["steps_with_tokens"]),
                f"{steps['rows_per_step_mean']}, {steps['rows_per_step_p50']}",
                "",
                "",
                "",
            )
        waits.rows[-1].end_section = True
    console.print(waits)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default=",".join(LABELS), help=f"of {', '.join(LABELS)}")
    parser.add_argument("--quick", action="store_true", help="24 requests per workload, not 48")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--workloads", default="0 adapters,8 adapters,64 adapters")
    parser.add_argument(
        "--profile",
        default="",
        help="servers to profile on --profile-workload after the rounds (comma-separated; none: "
        "no profile)",
    )
    parser.add_argument("--profile-workload", default="64 adapters", help="the workload profiled")
    parser.add_argument("--profile-rate", type=int, default=50, help="py-spy samples per second")
    parser.add_argument(
        "--max-cpu-loras",
        type=int,
        default=LLAMA90M_LIMITS["max_cpu_loras"],
        help="every server's host cache (below 64: the 64-adapter workload loads adapters again)",
    )
    parser.add_argument("--json", default="bench/results/vs_vllm_split.json")
    parser.add_argument(
        "--resplit",
        action="store_true",
        help="run nothing: split --json's profiles again from their kept stacks, print, rewrite",
    )
    args = parser.parse_args(argv)
    args.servers = [s for s in args.servers.split(",") if s]
    args.profile = [s for s in args.profile.split(",") if s]
    unknown = [s for s in [*args.servers, *args.profile] if s not in LABELS]
    workloads = [w for w in args.workloads.split(",") if w]
    workloads.append(args.profile_workload)
    if unknown or args.rounds < 1 or any(w not in LLAMA90M_WORKLOADS for w in workloads):
        parser.error(
            f"--servers/--profile: any of {', '.join(LABELS)}; --rounds >= 1; --workloads: any "
            f"of {', '.join(LLAMA90M_WORKLOADS)}"
        )
    if args.profile and not PY_SPY.is_file():
        parser.error(
            f"--profile needs py-spy beside this interpreter ({PY_SPY}): pip install py-spy"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    LIMITS["max_cpu_loras"] = args.max_cpu_loras
    console = Console(width=200)
    if args.resplit:
        print_profile(console, resplit(Path(args.json))["profile"])
        return 0
    cache_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "loraplex-bench"
    model_dir, adapters = llama90m_world(cache_dir)
    report: dict = {
        "case": "llama90m",
        "labels": LABELS,
        "model": LLAMA90M,
        "limits": LIMITS,
        "prompt_tokens": LLAMA90M_PROMPT,
        "output_tokens": LLAMA90M_OUTPUT,
        "clients": args.clients,
        "rounds": args.rounds,
        "quick": args.quick,
        "python": sys.executable,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.servers:
            report["comparison"] = compare(args, model_dir, adapters, Path(tmp), console)
            print_comparison(console, report["comparison"], args)
        if args.profile:
            report["profile_rate_hz"] = args.profile_rate
            report["profile"] = {
                name: profile_one(name, args, model_dir, adapters, Path(tmp), console)
                for name in args.profile
            }
            print_profile(console, report["profile"])
    report["load_average_1m_5m_15m"] = [round(v, 2) for v in os.getloadavg()]
    Path(args.json).write_text(json.dumps(report, indent=2))
    console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
