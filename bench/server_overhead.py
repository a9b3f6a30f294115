"""What HTTP + auth + resolve add: a 1-token completion through `loraplex serve` vs the engine
called directly, with the engine's step loop on a thread of the server and in a process of its own.

    python bench/server_overhead.py [--requests N] [--rounds R] [--clients 1,64]
        [--engine-cores thread,process] [--json OUT]

The tests' tiny Llama (hidden 64) and one PEFT adapter, built locally. Every request is the same: an
8-token prompt (token ids), the adapter, max_tokens 1, greedy. Direct: `AsyncEngine.generate` in
this process, with C concurrent asyncio clients. HTTP: `loraplex serve` in a subprocess with an
API-keys file (so every request is authenticated and resolved through the registry), once with
`--engine-core thread` and once with `--engine-core process`, driven by C concurrent keep-alive
connections of a minimal asyncio HTTP/1.1 client (httpx would cost the client as much CPU as the
server). Overhead = HTTP p50 − direct p50; throughput ratio = HTTP req/s ÷ direct req/s. The HTTP
client shares the machine's cores with the server; the direct client does not, so on a small machine
the overhead includes some of the client's own cost, and the paths not being measured wait idle
(an idle engine process wakes every 10 ms).

Side by side: the direct engine and every server are up together, and each round runs every path
once, one after another, with N requests each; a row gives the medians over the rounds of its
figures, its ratio and its overhead (each taken against the direct run of the same round), so a
machine whose speed drifts moves both sides of a ratio alike.

CPU per request: the user + system CPU time (/proc/PID/stat) the API server and the engine process
used during each measured run, divided by its requests; far steadier than req/s on a shared
machine. In thread mode the engine runs inside the API server, whose figure then holds both; the
direct row's engine figure is this process's own (the engine and its asyncio clients). The JSON also
has the HTTP load generator's (`client_cpu_ms`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

from rich.console import Console
from rich.table import Table

from loraplex.engines.native.async_engine import AsyncEngine
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams
from loraplex.loadgen.procs import Proc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tinymodels import make_adapter, make_model  # noqa: E402  (the tests' fixture builders, reused)

DEFAULT_JSON = Path(__file__).parent / "results" / "server_overhead.json"
PROMPT = [5, 17, 42, 99, 123, 7, 250, 31]
KEY = "bench-key-0123456789abcdef"


def build_fixtures(root: Path) -> tuple[Path, Path]:
    model = make_model(root / "model", "llama")
    adapter = make_adapter(
        model, root / "adapter", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]
    )
    return model, adapter


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_process(server_pid: int) -> int | None:
    """The engine process `serve --engine-core process` spawned (multiprocessing's spawn runs
    `spawn_main`; its resource tracker, if any, does not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError):  # a process that ended meanwhile
            continue
        if ppid == server_pid and b"spawn_main" in cmdline:
            return int(stat.parent.name)
    return None


class CpuMeter:
    """CPU milliseconds per request of some processes over one run."""

    def __init__(self, pids: dict[str, int | None]):
        self.pids = pids

    def __enter__(self):
        self.start = {name: self._read(pid) for name, pid in self.pids.items()}
        return self

    def _read(self, pid: int | None) -> float | None:
        if pid is None:
            return None
        return time.process_time() if pid == os.getpid() else cpu_seconds(pid)

    def __exit__(self, *exc):
        self.used = {name: self._read(pid) for name, pid in self.pids.items()}

    def per_request(self, num_requests: int) -> dict:
        return {
            f"{name}_cpu_ms": None
            if self.start[name] is None
            else (self.used[name] - self.start[name]) * 1000 / num_requests
            for name in self.pids
        }


def summarize(latencies: list[float], wall_s: float) -> dict:
    ordered = sorted(latencies)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000  # noqa: E731
    return {
        "requests": len(ordered),
        "rps": len(ordered) / wall_s,
        "p50_ms": pick(0.5),
        "p99_ms": pick(0.99),
        "mean_ms": statistics.fmean(ordered) * 1000,
    }


async def drive(call, num_requests: int, clients: int, pids: dict | None = None) -> dict:
    """`clients` workers take requests from one counter until `num_requests` are done; with
    `pids` (name: pid), the CPU those processes used per request too."""
    latencies: list[float] = []
    remaining = iter(range(num_requests))

    async def worker():
        for _ in remaining:
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    with CpuMeter(pids or {}) as cpu:
        await asyncio.gather(*(worker() for _ in range(clients)))
    wall_s = time.perf_counter() - start
    return {**summarize(latencies, wall_s), **cpu.per_request(num_requests)}


def direct_engine(model: Path, adapter: Path) -> tuple[AsyncEngine, Callable]:
    engine = LLMEngine(
        EngineConfig(model_dir=model, dtype="float32", max_loras=4, max_lora_rank=16)
    )
    ref = engine.adapter_ref("bench", adapter)
    async_engine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=1, temperature=0)

    async def call():
        async for _ in async_engine.generate(PROMPT, params, ref):
            pass

    return async_engine, call


def run_rounds(paths: dict, num_requests: int, rounds: int, clients: list[int]) -> dict:
    """Per client count and path, one result per round; `paths`: name → (call, pids, close),
    `close` (or None) run at the end on the event loop."""

    async def all_runs():
        results = {c: {name: [] for name in paths} for c in clients}
        try:
            for c in clients:
                for call, _, _ in paths.values():  # warm-up: connections, the adapter's slot
                    await drive(call, max(20, c), c)
                for _ in range(rounds):
                    for name, (call, pids, _) in paths.items():
                        results[c][name].append(await drive(call, num_requests, c, pids))
        finally:
            for _, _, close in paths.values():
                if close is not None:
                    close()
        return results

    return asyncio.run(all_runs())


def start_server(model: Path, adapter: Path, work: Path, engine_core: str) -> Proc:
    (work / "keys").write_text(f"bench {KEY}\n")
    return Proc(
        [
            "serve",
            "--engine-core",
            engine_core,
            "--model",
            str(model),
            "--served-model-name",
            "base",
            "--port",
            "0",
            "--data-dir",
            str(work / f"data-{engine_core}"),
            "--lora-modules",
            f"bench={adapter}",
            "--api-keys",
            str(work / "keys"),
            "--dtype",
            "float32",
            "--max-lora-rank",
            "16",
        ],
        work / f"serve-{engine_core}.log",
    )


class RawClient:
    """A minimal keep-alive HTTP/1.1 client on asyncio streams: the load generator must cost far
    less than the server (httpx's AsyncClient costs about as much CPU per request as the server
    itself on a small machine)."""

    def __init__(self, url: str, body: dict):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        payload = json.dumps(body).encode()
        self.request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        ).encode() + payload
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self) -> None:
        if self.idle:
            reader, writer = self.idle.pop()
            writer.write(self.request)
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):  # closed while idle
                writer.close()
                reader, writer, head = await self._on_new_connection()
        else:
            reader, writer, head = await self._on_new_connection()
        status = int(head.split(b" ", 2)[1])
        lines = head.lower().split(b"\r\n")
        length = next(
            int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length")
        )
        body = await reader.readexactly(length)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body[:200]!r}")
        self.idle.append((reader, writer))

    async def _on_new_connection(self):
        """The request sent on a connection of its own (the server closes one idle for longer than
        its keep-alive timeout, as while the other paths run)."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(self.request)
        return reader, writer, await reader.readuntil(b"\r\n\r\n")

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


BODY = {"model": "bench", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}


def combine(runs: list[dict], direct_runs: list[dict]) -> dict:
    """One row from a path's rounds: the median of each figure, of its ratio to the direct run of
    the same round and of its p50 overhead over it."""
    row = {
        key: None if runs[0][key] is None else statistics.median(r[key] for r in runs)
        for key in runs[0]
    }
    row["ratio"] = statistics.median(r["rps"] / d["rps"] for r, d in zip(runs, direct_runs))
    row["overhead"] = statistics.median(
        r["p50_ms"] - d["p50_ms"] for r, d in zip(runs, direct_runs)
    )
    row["rounds"] = runs
    return row


CORES = ("thread", "process")


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="measured requests per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every path, alternating")
    parser.add_argument("--clients", default="1,64", help="comma-separated concurrency levels")
    parser.add_argument(
        "--engine-cores", default=",".join(CORES), help="the serve --engine-core modes to run"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args()
    cores = [c for c in args.engine_cores.split(",") if c]
    if not set(cores) <= set(CORES):
        parser.error(f"--engine-cores: choose from {', '.join(CORES)}")
    clients = [int(c) for c in args.clients.split(",")]
    console = Console()
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        with console.status("building the tiny model and adapter"):
            model, adapter = build_fixtures(work)
        async_engine, direct_call = direct_engine(model, adapter)
        stack.callback(async_engine.stop)
        direct_pids = {"server": None, "engine": os.getpid(), "client": None}
        paths = {"direct": (direct_call, direct_pids, None)}
        for core in cores:
            with console.status(f"starting loraplex serve --engine-core {core}"):
                server = start_server(model, adapter, work, core)
            stack.callback(server.stop)
            client = RawClient(server.url, BODY)
            pids = {
                "server": server.p.pid,
                "engine": engine_process(server.p.pid),
                "client": os.getpid(),
            }
            paths[f"http, {core}"] = (client.post, pids, client.close)
        with console.status(f"{args.rounds} rounds of every path"):
            results = run_rounds(paths, args.requests, args.rounds, clients)

    rows = []
    table = Table(
        title=f"1-token completion, {args.requests} requests per run, medians of {args.rounds}"
    )
    columns = (
        "clients",
        "path",
        "req/s",
        "× direct",
        "p50 ms",
        "p99 ms",
        "p50 overhead ms",
        "server CPU ms/req",
        "engine CPU ms/req",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for c in clients:
        for path, runs in results[c].items():
            result = combine(runs, results[c]["direct"])
            ratio, overhead = result["ratio"], result["overhead"]
            rows.append({"clients": c, "path": path, **result})
            table.add_row(
                str(c),
                path,
                f"{result['rps']:.0f}",
                f"{ratio:.2f}",
                f"{result['p50_ms']:.2f}",
                f"{result['p99_ms']:.2f}",
                f"{overhead:+.2f}" if path != "direct" else "",
                _ms(result["server_cpu_ms"]),
                _ms(result["engine_cpu_ms"]),
            )
    console.print(table)
    report = {
        "benchmark": "server_overhead",
        "requests": args.requests,
        "rounds": args.rounds,
        "clients": clients,
        "results": rows,
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
        },
        "goal": "HTTP adds <= 1 ms p50 with 1 client; >= 0.8x direct req/s with 64 clients",
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    console.print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
