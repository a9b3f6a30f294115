"""Router policies over real worker processes: Zipf(0.9) over 100 adapters, and one adapter taking
half the traffic.

    python bench/router.py [--quick] [--json bench/results/router.json]

Three `loraplex serve` workers (tiny model, `max_loras` 4, `--eviction-policy score`) and one
`loraplex router` per policy, restarted for each run so every policy starts cold. The adapters live
in a registry whose artifact store is a real local HTTP server with 50 ms latency per request and
200 MB/s (as a remote object store); each worker keeps 4 adapters in gpu slots, `--max-cpu-loras` in
host memory (together the fleet can hold every adapter once, one worker cannot) and a small disk
budget, so a miss on every local tier goes to the store. Each run starts with a warm-up sweep that
sends every adapter once through the router under test (the fleet has served all of them before, as
in production); then the measured trace is streamed open-loop at Poisson arrival times. Time to
first token is measured at the client from send to the first streamed chunk; the tier header of each
response says where the worker found the adapter (gpu, cpu, or a cold start from disk/remote).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from adapter_load import write_adapter
from cache_policy import build_model
from shaped_store import ShapedHandler, serve_shaped

from loraplex.artifacts import ArtifactStore
from loraplex.loadgen.procs import start_router, start_worker
from loraplex.model_config import ModelConfig
from loraplex.registry import Registry

POLICIES = ("round-robin", "least-loaded", "pure-affinity", "affinity")


def workload(
    kind: str, num_adapters: int, n: int, rate: float, seed: int
) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    names = [f"ad{i:03d}" for i in range(num_adapters)]
    if kind == "zipf":
        weights = [1 / (i + 1) ** 0.9 for i in range(num_adapters)]
    else:  # one adapter takes half of the traffic, the rest is uniform
        weights = [num_adapters - 1] + [1] * (num_adapters - 1)
    t, trace = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        trace.append((t, rng.choices(names, weights)[0]))
    return trace


async def replay(url: str, trace: list[tuple[float, str]], key: str) -> list[dict]:
    results = []
    async with httpx.AsyncClient(timeout=300, headers={"Authorization": f"Bearer {key}"}) as client:
        start = time.perf_counter()

        async def one(at: float, model: str):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            sent = time.perf_counter()
            body = {
                "model": model,
                "prompt": "<s>hello world<sep>",
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            record = {"model": model}
            try:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    record["status"] = r.status_code
                    record["tier"] = r.headers.get("x-loraplex-cache-tier")
                    record["worker"] = r.headers.get("x-loraplex-worker")
                    record["route"] = r.headers.get("x-loraplex-route")
                    async for _ in r.aiter_raw():
                        record.setdefault("ttft", time.perf_counter() - sent)
                record["e2e"] = time.perf_counter() - sent
            except httpx.HTTPError as exc:
                record["status"] = type(exc).__name__
            results.append(record)

        await asyncio.gather(*(one(at, model) for at, model in trace))
    return results


def summarize(records: list[dict]) -> dict:
    ok = [r for r in records if r.get("status") == 200 and "ttft" in r]
    ttft = sorted(r["ttft"] for r in ok)

    def pct(q):
        return round(ttft[min(len(ttft) - 1, int(q * len(ttft)))] * 1000, 1) if ttft else None

    per_worker = Counter(r["worker"] for r in ok)
    tiers = Counter(r["tier"] for r in ok)
    spread = (
        statistics.pstdev(per_worker.values()) / statistics.mean(per_worker.values())
        if per_worker
        else 0
    )
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": dict(Counter(str(r.get("status")) for r in records if r not in ok)),
        "gpu_hit": round(tiers["gpu"] / max(1, len(ok)), 3),
        "hit_cpu": round(tiers["cpu"] / max(1, len(ok)), 3),
        "cold_starts": tiers["disk"] + tiers["remote"],
        "remote_loads": tiers["remote"],
        "ttft_p50_ms": pct(0.5),
        "ttft_p99_ms": pct(0.99),
        "load_cv": round(spread, 3),
        "per_worker": dict(per_worker),
    }


def build_fleet_registry(tmp: Path, num_adapters: int) -> tuple[Path, str, str, str, object, int]:
    """The model, a registry of `num_adapters` shared adapters whose bytes live only behind a shaped
    HTTP store."""
    model_dir = build_model(tmp / "model")
    cfg = ModelConfig.from_dir(model_dir)
    remote = ArtifactStore(tmp / "remote")
    base_url, server = serve_shaped(remote.root)
    registry = Registry(
        f"sqlite:///{tmp / 'registry.db'}",
        base_model_dir=model_dir,
        max_lora_rank=16,
        storage_base=base_url,
    )
    registry.init()
    registry.add_tenant("bench", 0)
    key = registry.create_key("bench")
    for i in range(num_adapters):
        path = write_adapter(cfg, (8, 16)[i % 2], torch.float32, tmp / "adapters" / f"ad{i:03d}")
        registry.add_revision(path, f"ad{i:03d}", shared=True, status="stable")
    shutil.copytree(registry.store.root / "sha256", remote.root / "sha256", dirs_exist_ok=True)
    shutil.rmtree(registry.store.root)  # the bytes now live only in the remote store
    registry.close()
    biggest = max(remote.size(d) for d in remote.digests())
    return model_dir, registry.url, base_url, key, server, biggest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--workloads", default="zipf,one-hot")
    parser.add_argument("--json", default="bench/results/router.json")
    parser.add_argument("--keep-logs", help="copy each run's worker and router logs here")
    args = parser.parse_args(argv)
    console = Console(width=200)
    num_adapters = 30 if args.quick else 100
    n = 90 if args.quick else 300
    # the fleet of 3 holds every adapter 1.2 times; one worker holds 40%
    cpu_loras = num_adapters * 2 // 5
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir, registry_url, base_url, key, server, biggest = build_fleet_registry(
            tmp, num_adapters
        )
        names = [f"ad{i:03d}" for i in range(num_adapters)]
        sweep = [
            (0.1 * i, name) for i, name in enumerate(random.Random(7).sample(names, len(names)))
        ]
        try:
            for kind in args.workloads.split(","):
                trace = workload(kind, num_adapters, n, rate=6.0, seed=1)
                for policy in args.policies.split(","):
                    run = tmp / f"{kind}-{policy}"
                    workers = [
                        start_worker(
                            model_dir,
                            run / f"w{i}",
                            {},
                            "--registry",
                            registry_url,
                            "--allowed-roots",
                            base_url,
                            "--max-loras",
                            "4",
                            "--max-cpu-loras",
                            str(cpu_loras),
                            "--disk-cache-bytes",
                            str(4 * biggest),
                            "--eviction-policy",
                            "score",
                            max_lora_rank=16,
                        )
                        for i in range(3)
                    ]
                    router = start_router([w.url for w in workers], run / "router", policy=policy)
                    try:
                        time.sleep(1.0)
                        warm = asyncio.run(replay(router.url, sweep, key))
                        records = asyncio.run(replay(router.url, trace, key))
                    finally:
                        if args.keep_logs:
                            shutil.copytree(
                                run,
                                Path(args.keep_logs) / run.name,
                                dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("cache", "*.db*"),
                            )
                        router.stop()
                        for w in workers:
                            w.stop()
                    row = {
                        "workload": kind,
                        "policy": policy,
                        **summarize(records),
                        "warmup_errors": sum(r.get("status") != 200 for r in warm),
                    }
                    rows.append(row)
                    console.log(row)
        finally:
            server.shutdown()
    table = Table(title="Router policies, 3 workers x 4 slots (TTFT at the client, ms)")
    columns = [
        "workload",
        "policy",
        "ok",
        "gpu_hit",
        "hit_cpu",
        "cold_starts",
        "remote_loads",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "load_cv",
    ]
    for c in columns:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns))
    console.print(table)
    by = {(r["workload"], r["policy"]): r for r in rows}
    goals = {}
    if ("zipf", "affinity") in by and ("zipf", "round-robin") in by:
        goals["zipf_p99_ours_over_round_robin"] = round(
            by["zipf", "affinity"]["ttft_p99_ms"] / by["zipf", "round-robin"]["ttft_p99_ms"], 2
        )
    if ("one-hot", "affinity") in by and ("one-hot", "least-loaded") in by:
        goals["one_hot_p99_ours_over_least_loaded"] = round(
            by["one-hot", "affinity"]["ttft_p99_ms"] / by["one-hot", "least-loaded"]["ttft_p99_ms"],
            2,
        )
    console.print(goals)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "rows": rows,
                "goals": goals,
                "setup": {
                    "workers": 3,
                    "max_loras": 4,
                    "max_cpu_loras": cpu_loras,
                    "disk_cache_bytes": 4 * biggest,
                    "adapters": num_adapters,
                    "requests": n,
                    "rate": 6.0,
                    "remote_latency_s": ShapedHandler.latency_s,
                    "remote_bytes_per_s": ShapedHandler.bytes_per_s,
                },
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
