"""One LoRA linear layer, many adapters in one batch: our op against the base matmul, PEFT and
pad-to-max-rank.

    python bench/lora_ops.py [--quick] [--dtype float32|bfloat16] [--threads N] [--device cpu|cuda]
        [--json OUT]

Each case is one linear layer (d_in × d_out) and T tokens spread over N adapters whose ranks are
drawn from {8, 16, 32, 64}. Tokens are sorted by slot, as the engine's runner sorts them, so an
adapter's tokens sit together: T=16 (decode) on CUDA gives runs shorter than
MIN_SEGMENT_TOKENS["cuda"] (gathered path); on CPU every run is a segment, T=512 (prefill) gives
segments. With N > T only T adapters appear in the batch. Every method's output is checked against
ours before it is timed. On CUDA each timed call ends with a synchronize.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

from loraplex.engines.native.lora import MODULE_INDEX, add_lora, build_lora_groups
from loraplex.model_config import LINEAR_MODULES

RANKS = (8, 16, 32, 64)
MAX_RANK = 64
SHAPES = ((4096, 4096), (4096, 11008))
TOKENS = (16, 512)
ADAPTER_COUNTS = (1, 8, 32)
METHODS = ("base", "ours", "ours_prebuilt", "peft_mixed", "peft_loop", "pad_max_rank")
TITLES = {
    "base": "base matmul",
    "ours": "ours",
    "ours_prebuilt": "ours, groups prebuilt",
    "peft_mixed": "PEFT mixed batch",
    "peft_loop": "PEFT per adapter",
    "pad_max_rank": "pad to rank 64",
}
DEFAULT_JSON = Path(__file__).parent / "results" / "lora_ops.json"
MODULE = "q_proj"


@dataclass(frozen=True)
class Case:
    d_in: int
    d_out: int
    num_tokens: int
    num_adapters: int


@dataclass
class Layer:
    """One case's tensors: the slot-pool layout our op reads, and the token → slot map."""

    x: torch.Tensor  # [T, d_in]
    weight: torch.Tensor  # [d_out, d_in]
    # [N, MAX_RANK, d_in], rows past an adapter's rank are zero (as in LoRASlotPool)
    a: torch.Tensor
    bt: torch.Tensor  # [N, MAX_RANK, d_out], scaling folded in
    ranks: list[int]  # per slot
    token_slots: list[int]  # per token, sorted

    @property
    def module_ranks(self) -> list[tuple[int, ...]]:
        index = MODULE_INDEX[MODULE]
        return [
            tuple(r if i == index else 0 for i in range(len(LINEAR_MODULES))) for r in self.ranks
        ]


def adapter_ranks(num_adapters: int, rng: random.Random) -> list[int]:
    """Each rank of RANKS equally often (N=1: rank 8), in a shuffled order."""
    ranks = [RANKS[i % len(RANKS)] for i in range(num_adapters)]
    rng.shuffle(ranks)
    return ranks


def make_layer(case: Case, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Layer:
    gen = torch.Generator().manual_seed(seed)
    ranks = adapter_ranks(case.num_adapters, random.Random(seed))
    x = torch.randn(case.num_tokens, case.d_in, generator=gen)
    weight = torch.randn(case.d_out, case.d_in, generator=gen) / case.d_in**0.5
    a = torch.zeros(case.num_adapters, MAX_RANK, case.d_in)
    bt = torch.zeros(case.num_adapters, MAX_RANK, case.d_out)
    for slot, rank in enumerate(ranks):
        a[slot, :rank] = torch.randn(rank, case.d_in, generator=gen) / case.d_in**0.5
        bt[slot, :rank] = torch.randn(rank, case.d_out, generator=gen) / rank**0.5
    token_slots = sorted(t % case.num_adapters for t in range(case.num_tokens))
    x, weight, a, bt = (t.to(device, dtype) for t in (x, weight, a, bt))
    return Layer(x, weight, a, bt, ranks, token_slots)


class OneLinear(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.q_proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        self.q_proj.weight.data.copy_(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x)


def peft_model(layer: Layer):
    """PEFT's LoRA on one q_proj, adapter `a{slot}` holding the same A and B as the slot (alpha = r:
    scaling 1)."""
    from peft import LoraConfig, get_peft_model

    model = None
    for slot, rank in enumerate(layer.ranks):
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=[MODULE])
        if model is None:
            model = get_peft_model(OneLinear(layer.weight), config, adapter_name=f"a{slot}")
        else:
            model.add_adapter(f"a{slot}", config)
        lora = model.base_model.model.q_proj
        lora.lora_A[f"a{slot}"].weight.data.copy_(layer.a[slot, :rank])
        lora.lora_B[f"a{slot}"].weight.data.copy_(layer.bt[slot, :rank].t())
    return model.to(layer.x.device, layer.x.dtype).eval()


def methods(layer: Layer) -> dict[str, Callable[[], torch.Tensor]]:
    x, weight, a, bt, token_slots = layer.x, layer.weight, layer.a, layer.bt, layer.token_slots
    index = MODULE_INDEX[MODULE]
    prebuilt = build_lora_groups(token_slots, layer.module_ranks, x.device)[index]
    model = peft_model(layer)
    names = [f"a{s}" for s in token_slots]
    starts = [0] + [t for t in range(1, len(token_slots)) if token_slots[t] != token_slots[t - 1]]
    runs = [
        (start, end, token_slots[start])
        for start, end in zip(starts, starts[1:] + [len(token_slots)])
    ]
    slots = torch.tensor(token_slots, device=x.device)

    def ours():
        groups = build_lora_groups(token_slots, layer.module_ranks, x.device)
        y = F.linear(x, weight)
        add_lora(y, x, a, bt, groups[index])
        return y

    def ours_prebuilt():
        y = F.linear(x, weight)
        add_lora(y, x, a, bt, prebuilt)
        return y

    def peft_loop():
        parts = []
        for start, end, slot in runs:
            model.set_adapter(f"a{slot}")
            parts.append(model(x[start:end]))
        return torch.cat(parts)

    def pad_max_rank():
        xa = torch.bmm(x.unsqueeze(1), a[slots].transpose(1, 2))  # [T, 1, MAX_RANK]
        return F.linear(x, weight) + torch.bmm(xa, bt[slots]).squeeze(1)

    return {
        "base": lambda: F.linear(x, weight),
        "ours": ours,
        "ours_prebuilt": ours_prebuilt,
        "peft_mixed": lambda: model(x, adapter_names=names),
        "peft_loop": peft_loop,
        "pad_max_rank": pad_max_rank,
    }


def check(fns: dict[str, Callable[[], torch.Tensor]], dtype: torch.dtype) -> None:
    """Every LoRA method computes the same layer as ours (so the timings compare like with like)."""
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else dict(rtol=5e-2, atol=1e-1)
    expected = fns["ours"]().float()
    for name, fn in fns.items():
        if name != "base":
            torch.testing.assert_close(
                fn().float(),
                expected,
                **tol,
                msg=lambda m, name=name: f"{name} differs from ours: {m}",
            )


def time_methods(
    fns: dict[str, Callable[[], torch.Tensor]], repeats: int, warmup: int, device: torch.device
) -> dict[str, float]:
    """Median seconds per method; methods are interleaved in each round so load from other jobs hits
    all alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for round_ in range(warmup + repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if round_ >= warmup:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


@torch.inference_mode()
def run_case(
    case: Case, dtype: torch.dtype, repeats: int, warmup: int, device: torch.device
) -> dict:
    layer = make_layer(case, dtype, device)
    fns = methods(layer)
    check(fns, dtype)
    seconds = time_methods(fns, repeats, warmup, device)
    return {
        **asdict(case),
        "distinct_adapters_in_batch": len(set(layer.token_slots)),
        "ranks": layer.ranks,
        "seconds": seconds,
        "ratio_to_base": {name: s / seconds["base"] for name, s in seconds.items()},
    }


def cases(quick: bool) -> list[Case]:
    shapes, tokens = (SHAPES[:1], (16, 128)) if quick else (SHAPES, TOKENS)
    return [
        Case(d_in, d_out, t, n) for d_in, d_out in shapes for t in tokens for n in ADAPTER_COUNTS
    ]


def table(results: list[dict], dtype: str) -> Table:
    out = Table(title=f"One LoRA linear layer, {dtype}, median ms (× base matmul)")
    for column in ("shape", "T", "N"):
        out.add_column(column, justify="right")
    for name in METHODS:
        out.add_column(TITLES[name], justify="right")
    for r in results:
        cells = [
            f"{r['seconds'][m] * 1e3:.2f}"
            + ("" if m == "base" else f" ({r['ratio_to_base'][m]:.2f}×)")
            for m in METHODS
        ]
        out.add_row(
            f"{r['d_in']}×{r['d_out']}", str(r["num_tokens"]), str(r["num_adapters"]), *cells
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="one shape (4096×4096), T=16 and 128, 3 repeats"
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--repeats", type=int, help="timed rounds per case (default 7 for T ≤ 64, else 3; quick 3)"
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--json", type=Path, help=f"results file (default {DEFAULT_JSON}; quick: *.quick.json)"
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 160)
    results = []
    started = time.perf_counter()
    for case in cases(args.quick):
        repeats = args.repeats or (3 if args.quick or case.num_tokens > 64 else 7)
        results.append({**run_case(case, dtype, repeats, args.warmup, device), "repeats": repeats})
        console.log(f"{case} ours {results[-1]['ratio_to_base']['ours']:.2f}× base")
    console.print(table(results, args.dtype))
    report = {
        "benchmark": "lora_ops",
        "quick": args.quick,
        "dtype": args.dtype,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "warmup": args.warmup,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "load_average_1m_5m_15m": list(_load_average()),
        },
        "wall_seconds": round(time.perf_counter() - started, 1),
        "results": results,
    }
    default = (
        DEFAULT_JSON if device.type == "cpu" else DEFAULT_JSON.with_suffix(f".{device.type}.json")
    )
    out = args.json or (default.with_suffix(".quick.json") if args.quick else default)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    console.print(f"wrote {out}")


def _load_average() -> tuple[float, ...]:
    return tuple(round(v, 2) for v in os.getloadavg())


if __name__ == "__main__":
    main()
