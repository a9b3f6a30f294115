"""Router policies over real worker processes: Zipf(0.9) over 100 adapters, and one adapter taking half the traffic.

    python bench/router.py [--quick] [--json bench/results/router.json]

Three `loraplex serve` workers (tiny model, `max_loras` 4, `--eviction-policy score`) and one `loraplex router`
per policy, restarted for each run so every policy starts cold. Requests are streamed open-loop at Poisson
arrival times; time to first token is measured at the client from send to the first streamed chunk. The tier
header of each response says whether the adapter was already on the worker (gpu, cpu) or a cold start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
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
from adapter_load import write_adapter  # noqa: E402
from cache_policy import build_model  # noqa: E402

from loraplex.bench.procs import start_router, start_worker  # noqa: E402
from loraplex.model_config import ModelConfig  # noqa: E402

POLICIES = ("round-robin", "least-loaded", "pure-affinity", "affinity")


def workload(kind: str, num_adapters: int, n: int, rate: float, seed: int) -> list[tuple[float, str]]:
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


async def replay(url: str, trace: list[tuple[float, str]]) -> list[dict]:
    results = []
    async with httpx.AsyncClient(timeout=300) as client:
        start = time.perf_counter()

        async def one(at: float, model: str):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            sent = time.perf_counter()
            body = {"model": model, "prompt": "<s>hello world<sep>", "max_tokens": 8, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            record = {"model": model}
            try:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    record["status"] = r.status_code
                    record["tier"] = r.headers.get("x-loraplex-cache-tier")
                    record["worker"] = r.headers.get("x-loraplex-worker")
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
    spread = statistics.pstdev(per_worker.values()) / statistics.mean(per_worker.values()) if per_worker else 0
    return {
        "requests": len(records), "ok": len(ok),
        "gpu_hit": round(tiers["gpu"] / max(1, len(ok)), 3),
        "cold_starts": tiers["disk"] + tiers["remote"],
        "ttft_p50_ms": pct(0.5), "ttft_p99_ms": pct(0.99),
        "load_cv": round(spread, 3), "per_worker": dict(per_worker),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="bench/results/router.json")
    args = parser.parse_args(argv)
    console = Console(width=200)
    num_adapters = 30 if args.quick else 100
    n = 60 if args.quick else 300
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_model(tmp / "model")
        cfg = ModelConfig.from_dir(model_dir)
        adapters = {f"ad{i:03d}": write_adapter(cfg, (8, 16)[i % 2], torch.float32, tmp / "adapters" / f"ad{i:03d}")
                    for i in range(num_adapters)}
        for kind in ("zipf", "one-hot"):
            trace = workload(kind, num_adapters, n, rate=6.0, seed=1)
            for policy in POLICIES:
                run = tmp / f"{kind}-{policy}"
                workers = [start_worker(model_dir, run / f"w{i}", adapters, "--max-loras", "4",
                                        "--eviction-policy", "score", max_lora_rank=16) for i in range(3)]
                router = start_router([w.url for w in workers], run / "router", policy=policy)
                try:
                    time.sleep(1.0)
                    records = asyncio.run(replay(router.url, trace))
                finally:
                    router.stop()
                    for w in workers:
                        w.stop()
                row = {"workload": kind, "policy": policy, **summarize(records)}
                rows.append(row)
                console.log(row)
    table = Table(title="Router policies, 3 workers x 4 slots (TTFT at the client, ms)")
    columns = ["workload", "policy", "ok", "gpu_hit", "cold_starts", "ttft_p50_ms", "ttft_p99_ms", "load_cv"]
    for c in columns:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns))
    console.print(table)
    by = {(r["workload"], r["policy"]): r for r in rows}
    goals = {
        "zipf_p99_ours_over_round_robin": round(by["zipf", "affinity"]["ttft_p99_ms"]
                                                / by["zipf", "round-robin"]["ttft_p99_ms"], 2),
        "one_hot_p99_ours_over_least_loaded": round(by["one-hot", "affinity"]["ttft_p99_ms"]
                                                    / by["one-hot", "least-loaded"]["ttft_p99_ms"], 2),
    }
    console.print(goals)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows, "goals": goals}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
