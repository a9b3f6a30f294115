"""Time to ready per tier: adapter bytes from remote / disk / cpu into a device slot, ours vs the limit and PEFT.

    python bench/adapter_load.py [--quick] [--json bench/results/adapter_load.json]

Shapes: a small Llama (4 layers, hidden 512) and the adapter tensors of a 4096-hidden, 32-layer model in
bfloat16 (only the slot pool of that shape is allocated; no base weights are needed). Ours goes through the real
AdapterCache: digest check, validation, packing, one slot copy. The limit is `safetensors.torch.load_file` plus
the copies into the slot (no digest check, no validation). The baseline is `PeftModel.load_adapter` on the small
model. The remote tier is a real local HTTP server with an added latency and bandwidth cap.
"""

from __future__ import annotations

import argparse
import http.server
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file, save_file

from loraplex.cache.cache import AdapterCache
from loraplex.cache.disk import DiskTier
from loraplex.cache.key import AdapterKey, AdapterRef
from loraplex.engine.lora import LoRASlotPool, pack_adapter
from loraplex.lora_format import read_adapter
from loraplex.model_config import LINEAR_MODULES, ModelConfig
from loraplex.registry.store import AllowList, ArtifactStore

SHAPES = {
    "small-512x4": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=8, dtype="float32"),
    "4096x32-bf16": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, dtype="bfloat16"),
}


def model_config(shape: dict) -> ModelConfig:
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1024, "hidden_act": "silu", **shape}
    return ModelConfig.from_dict(raw)


def write_adapter(cfg: ModelConfig, rank: int, dtype: torch.dtype, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in LINEAR_MODULES:
            d_in, d_out = cfg.linear_shape(module)
            prefix = f"base_model.model.{ModelConfig.module_path(layer, module)}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, d_in) * 0.01).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(d_out, rank) * 0.01).to(dtype)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LINEAR_MODULES),
        "bias": "none", "task_type": "CAUSAL_LM",
    }))
    return out


class ShapedHandler(http.server.SimpleHTTPRequestHandler):
    """A static file server with a fixed latency per request and a bandwidth cap."""

    latency_s = 0.05
    bytes_per_s = 200e6

    def log_message(self, *args):
        pass

    def copyfile(self, source, outputfile):
        time.sleep(self.latency_s)
        while chunk := source.read(1 << 20):
            start = time.perf_counter()
            outputfile.write(chunk)
            time.sleep(max(0.0, len(chunk) / self.bytes_per_s - (time.perf_counter() - start)))


def serve_shaped(root: Path) -> tuple[str, http.server.ThreadingHTTPServer]:
    handler = lambda *a, **k: ShapedHandler(*a, directory=str(root / "sha256"), **k)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def bench_shape(name: str, shape: dict, ranks: list[int], repeats: int, work: Path, console: Console) -> list[dict]:
    cfg = model_config(shape)
    dtype = getattr(torch, shape["dtype"])
    pool = LoRASlotPool(cfg, 1, max(ranks), dtype, "cpu")
    remote_store = ArtifactStore(work / f"{name}-remote")
    base_url, http_server = serve_shaped(remote_store.root)
    rows = []
    try:
        for rank in ranks:
            src = write_adapter(cfg, rank, dtype, work / f"{name}-r{rank}")
            digest = remote_store.put(src)
            file_mb = (src / "adapter_model.safetensors").stat().st_size / 2**20

            def pack(path):
                return pack_adapter(read_adapter(path, cfg, max(ranks)), cfg, dtype)

            def limit():
                tensors = load_file(str(src / "adapter_model.safetensors"))
                for layer in range(cfg.num_layers):
                    for index, module in enumerate(LINEAR_MODULES):
                        prefix = f"base_model.model.{ModelConfig.module_path(layer, module)}"
                        pool.a[layer][index][0, :rank].copy_(tensors[f"{prefix}.lora_A.weight"])
                        pool.bt[layer][index][0, :rank].copy_(tensors[f"{prefix}.lora_B.weight"].t())

            def ours(tier: str):
                disk_root = work / f"{name}-disk-{tier}-{time.perf_counter_ns()}"
                disk = DiskTier(disk_root, 10 * 2**30, AllowList.parse([base_url]))
                cache = AdapterCache(pool, pack, cpu_bytes=4 * 2**30, disk=disk)
                key = AdapterKey("bench", f"r{rank}", "1", digest)
                ref = (AdapterRef(key, path=src) if tier == "disk"
                       else AdapterRef(key, storage_uri=f"{base_url}/{digest.removeprefix('sha256:')}"))
                if tier == "cpu":  # bring the host copy in first: only the slot copy remains to time
                    assert cache.acquire(AdapterRef(key, path=src)) is None
                    cache.drain()
                start = time.perf_counter()
                slot = cache.acquire(ref)
                while slot is None:
                    cache.drain()
                    slot = cache.acquire(ref)
                elapsed = time.perf_counter() - start
                cache.release(key)
                cache.close()
                return elapsed

            def timed(tier):
                return statistics.median(ours(tier) for _ in range(repeats)) * 1000

            limit_ms = median_ms(limit, repeats)
            row = {"shape": name, "rank": rank, "file_mb": round(file_mb, 1), "limit_ms": round(limit_ms, 2)}
            for tier in ("cpu", "disk", "remote"):
                row[f"{tier}_ms"] = round(timed(tier), 2)
            row["disk_vs_limit"] = round(row["disk_ms"] / limit_ms, 2)
            rows.append(row)
            console.log(row)
    finally:
        http_server.shutdown()
    return rows


def bench_peft(ranks: list[int], repeats: int, work: Path) -> dict[int, float]:
    """PeftModel.load_adapter on the small model (the baseline users run today)."""
    import transformers
    from peft import LoraConfig, PeftModel, get_peft_model

    config = transformers.LlamaConfig(vocab_size=1024, **{k: v for k, v in SHAPES["small-512x4"].items()
                                                           if k != "dtype"})
    base = transformers.LlamaForCausalLM(config)
    out = {}
    for rank in ranks:
        path = work / f"peft-r{rank}"
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LINEAR_MODULES),
                                                init_lora_weights=False))
        model.save_pretrained(path)
        base = model.unload()
        peft_model = PeftModel.from_pretrained(base, path, adapter_name="first")
        times = []
        for i in range(repeats):
            start = time.perf_counter()
            peft_model.load_adapter(path, adapter_name=f"a{i}")
            times.append(time.perf_counter() - start)
            peft_model.delete_adapter(f"a{i}")
        base = peft_model.unload()
        out[rank] = statistics.median(times) * 1000
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats")
    parser.add_argument("--json", default="bench/results/adapter_load.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    console = Console(width=200)
    ranks = [8, 16, 64]
    repeats = 2 if args.quick else 5
    shapes = {"small-512x4": SHAPES["small-512x4"]} if args.quick else SHAPES
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for name, shape in shapes.items():
            rows += bench_shape(name, shape, ranks, repeats, Path(tmp), console)
        peft = bench_peft(ranks, repeats, Path(tmp))
    for row in rows:
        if row["shape"] == "small-512x4":
            row["peft_ms"] = round(peft[row["rank"]], 2)
            row["peft_vs_disk"] = round(peft[row["rank"]] / row["disk_ms"], 1)
    table = Table(title="Adapter time to ready (median ms): into one slot of the pool")
    columns = ["shape", "rank", "file_mb", "limit_ms", "cpu_ms", "disk_ms", "disk_vs_limit", "remote_ms",
               "peft_ms", "peft_vs_disk"]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(str(row.get(c, "-")) for c in columns))
    console.print(table)
    result = {"machine": _machine(), "remote": {"latency_s": ShapedHandler.latency_s,
                                                "bytes_per_s": ShapedHandler.bytes_per_s}, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    console.print(f"wrote {args.json}")
    return 0


def _machine() -> dict:
    import os
    import platform

    return {"cpu_count": os.cpu_count(), "machine": platform.machine(), "torch": torch.__version__,
            "python": sys.version.split()[0], "load_avg": os.getloadavg()}


if __name__ == "__main__":
    sys.exit(main())
