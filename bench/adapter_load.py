"""Time to ready per tier: adapter bytes from remote / disk / cpu into a device slot, ours vs the
limit and PEFT.

    python bench/adapter_load.py [--quick] [--repeats 5] [--threads 1] [--device cpu|cuda]
        [--json OUT]

Shapes: a small Llama (4 layers, hidden 512) and the adapter tensors of a 4096-hidden, 32-layer
model in bfloat16 (only the slot pool of that shape is allocated; no base weights are needed). Ours
goes through the real `Residency` on the native backend: digest check (by the piece list a
registration records, BLAKE3 pieces hashed on several threads; the `disk_one_sha256` column checks
the digest alone, one sha256, as for revisions registered without pieces), validation, packing, one
slot copy. The limit is `safetensors.torch.load_file` plus the copies into the slot (no digest
check, no validation, no host copy kept); "limit + sha256" adds the mandatory digest check to it as
its own pass over the
file. Each repeat runs the limit and every tier of ours once, in turn, so that a change in the
machine's load hits them alike. The baseline is `PeftModel.load_adapter` on the small model, with
its default and with `low_cpu_mem_usage=True` (which skips initialising weights that are then
overwritten). The remote tier is a real local HTTP server in its own process, with an added latency
and bandwidth cap. With `--device cuda` the slot pools live on the GPU, our host copies are pinned,
the limit copies from `load_file`'s host tensors into the GPU pool, PEFT's model is on the GPU, and
every timing ends with a `torch.cuda.synchronize()`, so a copy still in flight is counted."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from safetensors.torch import load_file, save_file
from shaped_store import ShapedHandler, shaped_store_process

from loraplex.artifacts import AllowList, ArtifactStore, Pieces, canonical_digest
from loraplex.engines.native.lora import LoRASlotPool, pack_adapter
from loraplex.engines.native.slots import native_residency
from loraplex.lora_format import WEIGHTS_FILE, adapter_from_files
from loraplex.model_config import LINEAR_MODULES, ModelConfig
from loraplex.residency.disk import DiskTier
from loraplex.residency.key import AdapterKey, AdapterRef

SHAPES = {
    "small-512x4": {
        "hidden_size": 512,
        "intermediate_size": 1376,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "dtype": "float32",
    },
    "4096x32-bf16": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "dtype": "bfloat16",
    },
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
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": rank,
                "lora_alpha": 2 * rank,
                "target_modules": list(LINEAR_MODULES),
                "bias": "none",
                "task_type": "CAUSAL_LM",
            }
        )
    )
    return out


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class Bench:
    """One shape's fixtures: the slot pools (ours, and one the limit writes into directly), the
    remote store's URL and where the work files go."""

    name: str
    cfg: ModelConfig
    device: torch.device
    dtype: torch.dtype
    pool: LoRASlotPool
    limit_pool: LoRASlotPool
    max_rank: int
    base_url: str
    work: Path

    def pack(self, files: dict[str, memoryview], hashed):
        return pack_adapter(
            adapter_from_files(files, self.cfg, self.max_rank),
            files[WEIGHTS_FILE],
            self.dtype,
            pin=self.device.type == "cuda",
            hashed=lambda end: hashed(WEIGHTS_FILE, end),
        )

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def limit(self, src: Path, rank: int) -> None:
        """`load_file` and the copies into slot 0: the least any loader must do."""
        tensors = load_file(str(src / WEIGHTS_FILE))
        for layer in range(self.cfg.num_layers):
            for index, module in enumerate(LINEAR_MODULES):
                prefix = f"base_model.model.{ModelConfig.module_path(layer, module)}"
                self.limit_pool.a[layer][index][0, :rank].copy_(tensors[f"{prefix}.lora_A.weight"])
                self.limit_pool.bt[layer][index][0, :rank].copy_(
                    tensors[f"{prefix}.lora_B.weight"].t()
                )
        self.sync()

    def ours(self, src: Path, rank: int, digest: str, tier: str, pieces: Pieces | None) -> float:
        """Seconds from acquire to a slot through a fresh `Residency` (native backend), the adapter
        starting in `tier`; its bytes checked by the registry's piece list, or by the digest alone
        (one sha256) without one."""
        disk = DiskTier(
            self.work / f"{self.name}-disk-{tier}-{time.perf_counter_ns()}",
            10 * 2**30,
            AllowList.parse([self.base_url]),
        )
        cache = native_residency(self.pool, self.pack, cpu_bytes=4 * 2**30, disk=disk)
        key = AdapterKey("bench", f"r{rank}", "1", digest)
        ref = (
            AdapterRef(key, path=src, pieces=pieces)
            if tier == "disk"
            else AdapterRef(
                key, storage_uri=f"{self.base_url}/{digest.removeprefix('sha256:')}", pieces=pieces
            )
        )
        if tier == "cpu":  # bring the host copy in first: only the slot copy remains to time
            assert cache.acquire(AdapterRef(key, path=src)) is None
            cache.backend.drain()
        start = time.perf_counter()
        slot = cache.acquire(ref)
        while slot is None:
            cache.backend.drain()
            slot = cache.acquire(ref)
        self.sync()
        elapsed = time.perf_counter() - start
        cache.release(key)
        # free the host copy now: a dropped cache is in a reference cycle and waits for the gc
        cache.evict(key)
        cache.close()
        return elapsed

    def row(self, rank: int, repeats: int, remote_store: ArtifactStore) -> dict:
        src = write_adapter(self.cfg, rank, self.dtype, self.work / f"{self.name}-r{rank}")
        digest, pieces = remote_store.put_with_pieces(src)  # as a registration records them
        runs = {
            "limit": lambda: seconds(lambda: self.limit(src, rank)),
            "limit_sha256": lambda: seconds(lambda: (canonical_digest(src), self.limit(src, rank))),
            **{
                tier: (lambda tier=tier: self.ours(src, rank, digest, tier, pieces))
                for tier in ("cpu", "disk", "remote")
            },
            "disk_one_sha256": lambda: self.ours(src, rank, digest, "disk", None),
        }
        times = {column: [] for column in runs}
        for _ in range(repeats):  # every column once per round, so drifting load hits them alike
            for column, run in runs.items():
                gc.collect()  # not inside a timed run
                times[column].append(run())
        row = {
            "shape": self.name,
            "rank": rank,
            "file_mb": round((src / WEIGHTS_FILE).stat().st_size / 2**20, 1),
        }
        for column, values in times.items():
            row[f"{column}_ms"] = round(statistics.median(values) * 1000, 2)
            # noise only adds: the fastest round, for reference
            row[f"{column}_min_ms"] = round(min(values) * 1000, 2)
        row["disk_vs_limit"] = round(row["disk_ms"] / row["limit_ms"], 2)
        row["disk_vs_limit_sha256"] = round(row["disk_ms"] / row["limit_sha256_ms"], 2)
        row["disk_one_sha256_vs_limit"] = round(row["disk_one_sha256_ms"] / row["limit_ms"], 2)
        return row


def bench_shape(
    name: str,
    shape: dict,
    ranks: list[int],
    repeats: int,
    work: Path,
    console: Console,
    device: torch.device,
) -> list[dict]:
    cfg = model_config(shape)
    dtype = getattr(torch, shape["dtype"])
    remote_store = ArtifactStore(work / f"{name}-remote")
    pools = [LoRASlotPool(cfg, 1, max(ranks), dtype, device) for _ in range(2)]
    rows = []
    with shaped_store_process(remote_store.root) as base_url:
        bench = Bench(name, cfg, device, dtype, *pools, max(ranks), base_url, work)
        for rank in ranks:
            rows.append(bench.row(rank, repeats, remote_store))
            console.log(rows[-1])
    return rows


def bench_peft(
    ranks: list[int], repeats: int, work: Path, device: torch.device
) -> dict[int, dict[str, float]]:
    """PeftModel.load_adapter into an already wrapped small model (the baseline users run today):
    its safetensors read, module injection and weight copy. Both with PEFT's default and with
    low_cpu_mem_usage=True."""
    import transformers
    from peft import LoraConfig, PeftModel, get_peft_model

    config = transformers.LlamaConfig(
        vocab_size=1024, **{k: v for k, v in SHAPES["small-512x4"].items() if k != "dtype"}
    )
    base = transformers.LlamaForCausalLM(config).to(device)
    out = {}
    for rank in ranks:
        path = work / f"peft-r{rank}"
        model = get_peft_model(
            base,
            LoraConfig(
                r=rank,
                lora_alpha=2 * rank,
                target_modules=list(LINEAR_MODULES),
                init_lora_weights=False,
            ),
        )
        model.save_pretrained(path)
        base = model.unload()
        peft_model = PeftModel.from_pretrained(base, path, adapter_name="first")
        times = {"default": [], "low_cpu_mem": []}
        for i in range(repeats):
            for option, low_cpu_mem_usage in (("default", False), ("low_cpu_mem", True)):
                name = f"{option}{i}"
                start = time.perf_counter()
                peft_model.load_adapter(
                    path, adapter_name=name, low_cpu_mem_usage=low_cpu_mem_usage
                )
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[option].append(time.perf_counter() - start)
                peft_model.delete_adapter(name)
        base = peft_model.unload()
        out[rank] = {option: statistics.median(values) * 1000 for option, values in times.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes and few repeats")
    parser.add_argument(
        "--repeats", type=int, default=5, help="rounds per row; the median is reported"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for every column (on a shared 2-core machine, 2 threads made "
        "each timing swing by several times)",
    )
    parser.add_argument("--device", default="cpu", help="where the slot pools live: cpu or cuda")
    parser.add_argument(
        "--json", help="default: bench/results/adapter_load[.cuda].json (.quick.json with --quick)"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    console = Console(width=200)
    ranks = [8, 16, 64]
    repeats = 2 if args.quick else args.repeats
    shapes = {"small-512x4": SHAPES["small-512x4"]} if args.quick else SHAPES
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for name, shape in shapes.items():
            rows += bench_shape(name, shape, ranks, repeats, Path(tmp), console, device)
        peft = bench_peft(ranks, repeats, Path(tmp), device)
    for row in rows:
        if row["shape"] == "small-512x4":
            timings = peft[row["rank"]]
            row["peft_ms"] = round(timings["default"], 2)
            row["peft_low_cpu_mem_ms"] = round(timings["low_cpu_mem"], 2)
            # PEFT's faster option
            row["peft_vs_disk"] = round(min(timings.values()) / row["disk_ms"], 1)
    table = Table(title=f"Adapter time to ready (median ms): into one slot of the pool on {device}")
    columns = [
        "shape",
        "rank",
        "file_mb",
        "limit_ms",
        "limit_sha256_ms",
        "cpu_ms",
        "disk_ms",
        "disk_vs_limit",
        "disk_vs_limit_sha256",
        "disk_one_sha256_ms",
        "remote_ms",
        "peft_ms",
        "peft_low_cpu_mem_ms",
        "peft_vs_disk",
    ]
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(str(row.get(c, "-")) for c in columns))
    console.print(table)
    remote = {"latency_s": ShapedHandler.latency_s, "bytes_per_s": ShapedHandler.bytes_per_s}
    result = {
        "machine": _machine(device),
        "device": str(device),
        "threads": args.threads,
        "repeats": repeats,
        "remote": remote,
        "rows": rows,
    }
    suffix = ("" if device.type == "cpu" else f".{device.type}") + (".quick" if args.quick else "")
    out = Path(args.json or f"bench/results/adapter_load{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {out}")
    return 0


def _machine(device: torch.device) -> dict:
    import os
    import platform

    gpu = {"gpu": torch.cuda.get_device_name(device)} if device.type == "cuda" else {}
    return {
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "load_avg": os.getloadavg(),
        **gpu,
    }


if __name__ == "__main__":
    sys.exit(main())
