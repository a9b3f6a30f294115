"""Prefix-aware routing against round-robin on a shared-system-prompt workload, side by side.

    python bench/prefix_routing.py [--quick] [--json bench/results/prefix_routing.json]

Six tenants, each with its own adapter and its own 300-character system prompt; every request is
one tenant's system prompt and a short question of its own (the demo tokenizer is byte-level: 300
characters are 300 tokens). Three `loraplex serve` workers (4-layer Llama, every adapter in a slot
on every worker after a warm-up, so adapter loads do not enter the figures) with 4 MiB of KV each:
1,024 tokens, about a third of the six prompts once the running requests have their blocks. One
`loraplex router` per set-up, the workers restarted for each so every set-up starts with empty
caches: `round-robin`, `affinity` with `prefix=0` (the picker without the prefix term) and
`affinity` (with it; `--prefix-index-blocks 16`, the worker's KV in 64-character blocks). The
same open-loop Poisson trace is replayed through each; TTFT is measured at the client to the first
streamed chunk. The hit rate is the fleet's: the change in the workers' own
`vllm:prefix_cache_hits` over `vllm:prefix_cache_queries` across the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from adapter_load import write_adapter
from cache_policy import build_model
from router import summarize

from loraplex.loadgen.procs import prefix_cache, start_router, start_worker
from loraplex.model_config import ModelConfig
from loraplex.registry import Registry

TENANTS = 6
KV_BYTES = 4 * 2**20  # 1,024 tokens of this model (4 layers x 2 x 4 heads x 32 x 4 bytes)
SETUPS = {
    "round-robin": ("--policy", "round-robin"),
    "affinity, prefix=0": ("--policy", "affinity", "--score-weights", "prefix=0"),
    "affinity": ("--policy", "affinity", "--prefix-index-blocks", "16"),
}
WORDS = "account billing invoice refund plan order ship track reply policy kindly answer".split()


def build(tmp: Path) -> tuple[Path, str, dict[str, str], dict[str, str]]:
    """The model, a registry of one adapter per tenant, each tenant's key and system prompt."""
    model_dir = build_model(tmp / "model")
    cfg = ModelConfig.from_dir(model_dir)
    registry = Registry(f"sqlite:///{tmp / 'registry.db'}", base_model_dir=model_dir)
    registry.init()
    keys, systems = {}, {}
    rng = random.Random(3)
    for i in range(TENANTS):
        tenant = f"t{i}"
        registry.add_tenant(tenant, 0)
        keys[tenant] = registry.create_key(tenant)
        path = write_adapter(cfg, 8, torch.float32, tmp / "adapters" / tenant)
        registry.add_revision(path, f"{tenant}-bot", tenant=tenant, status="stable")
        text = f"You are {tenant}'s assistant. " + " ".join(rng.choice(WORDS) for _ in range(60))
        systems[tenant] = text[:300]
    registry.close()
    return model_dir, registry.url, keys, systems


def trace(systems: dict[str, str], n: int, rate: float, seed: int) -> list[tuple[float, str, str]]:
    """(send at, tenant, prompt): tenants uniform, each question its own."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        tenant = rng.choice(sorted(systems))
        question = " ".join(rng.choice(WORDS) for _ in range(6))
        out.append((t, tenant, f"{systems[tenant]}\nQ: {question}?\nA:"))
    return out


async def replay(url: str, requests: list[tuple[float, str, str]], keys: dict[str, str]):
    records: list[dict] = []
    async with httpx.AsyncClient(timeout=300) as client:
        start = time.perf_counter()

        async def one(at: float, tenant: str, prompt: str):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - start)))
            body = {
                "model": f"{tenant}-bot",
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            headers = {"Authorization": f"Bearer {keys[tenant]}"}
            record: dict = {"tenant": tenant, "tier": None}
            sent = time.perf_counter()
            try:
                async with client.stream(
                    "POST", f"{url}/v1/completions", json=body, headers=headers
                ) as r:
                    record["status"] = r.status_code
                    record["worker"] = r.headers.get("x-loraplex-worker")
                    async for _ in r.aiter_raw():
                        record.setdefault("ttft", time.perf_counter() - sent)
            except httpx.HTTPError as exc:
                record["status"] = type(exc).__name__
            records.append(record)

        await asyncio.gather(*(one(*r) for r in requests))
    return records


def warm(urls: list[str], keys: dict[str, str]) -> None:
    """Every adapter into a slot on every worker (a prompt too short to leave a cached block)."""
    for url in urls:
        for tenant, key in keys.items():
            body = {"model": f"{tenant}-bot", "prompt": "hi", "max_tokens": 1}
            headers = {"Authorization": f"Bearer {key}"}
            httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)


def run_setup(tmp: Path, name: str, flags, model_dir, registry_url, keys, requests) -> dict:
    run = tmp / name.replace(" ", "").replace(",", "-").replace("=", "")
    extra = ("--registry", registry_url, "--max-loras", str(TENANTS))
    extra += ("--kv-cache-memory-bytes", str(KV_BYTES), "--max-model-len", "512")
    workers = [start_worker(model_dir, run / f"w{i}", {}, *extra) for i in range(3)]
    urls = [w.url for w in workers]
    router = start_router(urls, run / "router", flags[1], *flags[2:], "--registry", registry_url)
    try:
        warm(urls, keys)
        time.sleep(1.5)  # the router's polls see every adapter in every worker's slots
        before = [prefix_cache(u) for u in urls]
        records = asyncio.run(replay(router.url, requests, keys))
        after = [prefix_cache(u) for u in urls]
    finally:
        router.stop()
        for w in workers:
            w.stop()
    queries = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    summary = summarize(records)
    keep = ("requests", "ok", "errors", "ttft_p50_ms", "ttft_p99_ms", "per_worker")
    return {
        "setup": name,
        "prefix_hit_rate": round(hits / max(1.0, queries), 3),
        **{k: summary[k] for k in keep},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second")
    parser.add_argument("--json", default="bench/results/prefix_routing.json")
    args = parser.parse_args(argv)
    console = Console(width=200)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir, registry_url, keys, systems = build(tmp)
        requests = trace(systems, 120 if args.quick else 400, args.rate, seed=1)
        for name, flags in SETUPS.items():
            rows.append(run_setup(tmp, name, flags, model_dir, registry_url, keys, requests))
            console.log(rows[-1])
    table = Table(title="Shared system prompts, 3 workers, KV for about a third of the prompts")
    columns = ["setup", "ok", "prefix_hit_rate", "ttft_p50_ms", "ttft_p99_ms"]
    for c in columns:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns))
    console.print(table)
    rr, ours = rows[0], rows[-1]
    goals = {
        "hit_rate_over_round_robin": round(
            ours["prefix_hit_rate"] / max(rr["prefix_hit_rate"], 1e-9), 2
        ),
        "ttft_p50_over_round_robin": round(ours["ttft_p50_ms"] / rr["ttft_p50_ms"], 2),
    }
    console.print(goals)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps({"rows": rows, "goals": goals, "rate": args.rate}, indent=1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
