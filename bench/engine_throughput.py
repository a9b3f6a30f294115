"""Generated tokens/s of our engine against HF transformers + PEFT, for workloads of 0 to 64
distinct adapters; with --contexts, decode step time against context length.

    python bench/engine_throughput.py [--quick] [--threads N] [--device cpu|cuda] [--json OUT]
        [--cache-dir DIR] [--sampling greedy|mixed] [--skip-hf] [--contexts 64,256,1024]

A small random Llama (default 4 layers, hidden 512) and adapters on all seven linear modules with
ranks 8/16/32/64 (adapter j has rank RANKS[j % 4]) are built once with transformers + peft and
cached. Every workload is the same batch of requests (default 64, prompt 32 tokens, 32 greedy output
tokens, ignore_eos); request i uses adapter i % N. Ours: every request through one
`LLMEngine.generate` (continuous batching, max_loras and max_num_seqs 64), after a warm-up run that
makes the adapters resident. HF + PEFT: requests grouped by adapter, one `model.generate` per group
after `set_adapter` (`disable_adapter` for base-only). TPOT of a request: time between its first
and last token (step end times) / (tokens - 1), averaged by the rank of its adapter. One more row
runs the 64-adapter workload with `max_lora_bytes_per_step` set.
Tokens per CPU-second (the process's CPU time) is the figure to compare on a shared machine, where
wall time carries the other processes' load. `--sampling mixed` gives request i the parameter mix
i % 4 of `sampling_mixes` (temperature, top-p, top-k, penalties, seeds, logit bias: the sampler's
and the host path's work); HF + PEFT runs greedy regardless, or not at all with `--skip-hf`.

`--contexts`: 64 base-model sequences decode with their contexts ending at each given length; the
median wall and CPU time of their decode steps, beside the CPU time of the attention alone (one
SDPA call per layer over contiguous keys and values) and its FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tinymodels import make_adapter, make_model  # noqa: E402  (the tests' fixture builders, reused)

RANKS = (8, 16, 32, 64)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_JSON = Path(__file__).parent / "results" / "engine_throughput.json"


@dataclass(frozen=True)
class ModelShape:
    num_layers: int = 4
    hidden: int = 512
    intermediate: int = 1408
    vocab: int = 4096

    @property
    def name(self) -> str:
        return f"llama-l{self.num_layers}-h{self.hidden}-i{self.intermediate}-v{self.vocab}"


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_len: int
    output_len: int
    num_adapters: int
    lora_bytes_per_step: int | None = None

    @property
    def label(self) -> str:
        capped = (
            f", ≤{self.lora_bytes_per_step / 2**20:.0f} MiB LoRA/step"
            if self.lora_bytes_per_step
            else ""
        )
        return f"{self.num_adapters} adapters{capped}"


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    rank: int


def sampling_mixes(output_len: int) -> list[SamplingParams]:
    """Parameter mixes for `--sampling mixed`: every row of a batch sampled another way."""
    common = dict(max_tokens=output_len, ignore_eos=True)
    return [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, **common),
        SamplingParams(temperature=1.0, top_k=40, repetition_penalty=1.1, **common),
        SamplingParams(
            temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, seed=2, **common
        ),
        SamplingParams(temperature=0.0, logit_bias=((5, 2.0), (9, -3.0)), **common),
    ]


# -- fixtures (built once, cached) ---------------------------------------------------------------
def build_model(cache_dir: Path, shape: ModelShape) -> Path:
    out = cache_dir / shape.name
    if not (out / "config.json").is_file():
        staging = cache_dir / f"{shape.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        make_model(
            staging,
            "llama",
            hidden_size=shape.hidden,
            num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.hidden // 64,
            num_key_value_heads=shape.hidden // 64,
            intermediate_size=shape.intermediate,
            vocab_size=shape.vocab,
            max_position_embeddings=1024,
        )
        staging.rename(out)  # a half-built model is never mistaken for a cached one
    return out


def build_adapters(model_dir: Path, count: int) -> list[Adapter]:
    import transformers

    root = model_dir.parent / f"{model_dir.name}-adapters"
    adapters = [
        Adapter(f"a{j:02d}-r{RANKS[j % 4]}", root / f"a{j:02d}-r{RANKS[j % 4]}", RANKS[j % 4])
        for j in range(count)
    ]
    base = None
    for j, adapter in enumerate(adapters):
        if (adapter.path / "adapter_model.safetensors").is_file():
            continue
        if base is None:
            base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        staging = adapter.path.with_name(adapter.path.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        make_adapter(
            model_dir,
            staging,
            seed=j,
            base=base,
            r=adapter.rank,
            lora_alpha=2 * adapter.rank,
            target_modules=list(TARGETS),
        )
        staging.rename(adapter.path)
    return adapters


def make_requests(workload: Workload, vocab: int, adapters: list[Adapter], seed: int = 0):
    """Prompts (random token ids) and each request's adapter (None: base only)."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(2, vocab) for _ in range(workload.prompt_len)]
        for _ in range(workload.num_requests)
    ]
    used = adapters[: workload.num_adapters]
    chosen = [used[i % len(used)] if used else None for i in range(workload.num_requests)]
    return prompts, chosen


# -- ours ----------------------------------------------------------------------------------------
class TimedEngine(LLMEngine):
    """LLMEngine that notes, for each request, the time of the step that produced each of its
    tokens."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.request_ids: list[str] = []
        self.token_times: dict[str, list[float]] = defaultdict(list)

    def add_request(self, *args, **kwargs) -> str:
        request_id = super().add_request(*args, **kwargs)
        self.request_ids.append(request_id)
        return request_id

    def step(self):
        outputs = super().step()
        now = time.perf_counter()
        for out in outputs:
            self.token_times[out.request_id] += [now] * len(out.token_ids)
        return outputs

    def reset_timing(self) -> None:
        self.request_ids.clear()
        self.token_times.clear()


def tpot_by_rank(token_times: list[list[float]], chosen: list[Adapter | None]) -> dict[str, float]:
    """Mean time per output token (first to last token) of the requests of each adapter rank."""
    by_rank = defaultdict(list)
    for times, adapter in zip(token_times, chosen):
        if len(times) > 1:
            by_rank[str(adapter.rank) if adapter else "base"].append(
                (times[-1] - times[0]) / (len(times) - 1)
            )
    return {
        rank: statistics.mean(values)
        for rank, values in sorted(by_rank.items(), key=lambda kv: _rank_order(kv[0]))
    }


def _rank_order(rank: str) -> int:
    return 0 if rank == "base" else int(rank)


def run_ours(
    engine: TimedEngine,
    workload: Workload,
    prompts,
    chosen,
    refs: dict[str, object],
    sampling: str = "greedy",
) -> dict:
    params = SamplingParams(max_tokens=workload.output_len, temperature=0.0, ignore_eos=True)
    if sampling == "mixed":
        mixes = sampling_mixes(workload.output_len)
        params = [mixes[i % len(mixes)] for i in range(len(prompts))]
    adapter_refs = [refs[a.name] if a else None for a in chosen]
    engine.reset_timing()
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = engine.generate(prompts, params, adapter_refs)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(o) for o in outputs)
    assert tokens == workload.num_requests * workload.output_len, "every request runs to max_tokens"
    times = [engine.token_times[rid] for rid in engine.request_ids]
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "tokens_per_cpu_s": tokens / cpu_seconds,
        "tpot_by_rank_s": tpot_by_rank(times, chosen),
    }


def ours_engine(
    model_dir: Path,
    adapters: list[Adapter],
    max_lora_bytes_per_step: int | None,
    device: str = "cpu",
) -> tuple:
    # The runs repeat the same prompts: with the prefix cache on, later runs would skip part of
    # their prefill.
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float32",
        device=device,
        max_loras=64,
        max_lora_rank=64,
        max_num_seqs=64,
        max_lora_bytes_per_step=max_lora_bytes_per_step,
        enable_prefix_caching=False,
    )
    engine = TimedEngine(config)
    refs = {a.name: engine.adapter_ref(a.name, a.path) for a in adapters}
    return engine, refs


def median_run(runs: list[dict]) -> dict:
    """The run of median throughput, with every run's tokens/s kept."""
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {**ordered[len(ordered) // 2], "all_tokens_per_s": [r["tokens_per_s"] for r in runs]}


# -- step time against context length -------------------------------------------------------------
SWEEP_SEQS, SWEEP_STEPS = 64, 16
DEFAULT_SWEEP_JSON = Path(__file__).parent / "results" / "engine_step_time.json"


def sdpa_floor(cfg, num_seqs: int, context: int, repeats: int = 3) -> float:
    """CPU seconds of the decode attention alone: one SDPA call per layer over contiguous
    [num_seqs, context] keys and values, the least any layout of the cache can cost."""
    group = cfg.num_heads // cfg.num_kv_heads
    q = torch.randn(num_seqs, cfg.num_kv_heads, group, cfg.head_dim)
    k, v = (torch.randn(num_seqs, cfg.num_kv_heads, context, cfg.head_dim) for _ in range(2))
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(cfg.num_layers):
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
        best = min(best, time.process_time() - start)
    return best


def decode_step_times(engine: LLMEngine, context: int, vocab: int) -> dict:
    """Median wall and CPU milliseconds of SWEEP_STEPS decode steps of SWEEP_SEQS sequences whose
    contexts end at `context` tokens (the median: a step the machine's other jobs delay does not
    move it)."""
    rng = random.Random(context)
    prompt_len = context - SWEEP_STEPS - 1
    params = SamplingParams(max_tokens=SWEEP_STEPS + 1, temperature=0.0, ignore_eos=True)
    for _ in range(SWEEP_SEQS):
        engine.add_request([rng.randrange(2, vocab) for _ in range(prompt_len)], params)
    started: set[str] = set()
    while len(started) < SWEEP_SEQS:  # prefills (their first tokens)
        started.update(out.request_id for out in engine.step())
    walls, cpus = [], []
    for _ in range(SWEEP_STEPS):
        wall, cpu = time.perf_counter(), time.process_time()
        engine.step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    while engine.has_work():
        engine.step()
    return {
        "step_ms": 1e3 * statistics.median(walls),
        "step_cpu_ms": 1e3 * statistics.median(cpus),
    }


def context_sweep(args, console: Console) -> None:
    """Decode step time at SWEEP_SEQS running sequences for each context length, with the SDPA floor
    beside it."""
    contexts = [int(c) for c in args.contexts.split(",")]
    shape = ModelShape(args.layers, args.hidden, intermediate=args.hidden * 11 // 4 // 64 * 64)
    model_dir = build_model(args.cache_dir, shape)
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float32",
        device=args.device,
        max_num_seqs=SWEEP_SEQS,
        max_model_len=max(contexts),
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    cfg = engine.model_config
    decode_step_times(engine, contexts[0], shape.vocab)  # warms torch
    rows = []
    for context in contexts:
        row = {"context": context, **decode_step_times(engine, context, shape.vocab)}
        row["sdpa_floor_cpu_ms"] = 1e3 * sdpa_floor(cfg, SWEEP_SEQS, context)
        # q·k and p·v: 2 FLOPs per multiply-add, per head, key and layer
        row["attention_gflop"] = (
            4 * SWEEP_SEQS * context * cfg.num_heads * cfg.head_dim * cfg.num_layers / 1e9
        )
        console.log(row)
        rows.append(row)
    engine.close()
    out = Table(title=f"Decode step time at {SWEEP_SEQS} sequences against context length")
    for column in ("context", "step ms", "step CPU ms", "SDPA floor CPU ms", "attention GFLOP"):
        out.add_column(column, justify="right")
    for row in rows:
        out.add_row(
            str(row["context"]),
            f"{row['step_ms']:.1f}",
            f"{row['step_cpu_ms']:.1f}",
            f"{row['sdpa_floor_cpu_ms']:.1f}",
            f"{row['attention_gflop']:.3f}",
        )
    console.print(out)
    report = {
        "benchmark": "engine_step_time",
        "model": asdict(shape),
        "num_seqs": SWEEP_SEQS,
        "steps": SWEEP_STEPS,
        "dtype": "float32",
        "device": args.device,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "load_average_1m_5m_15m": [round(v, 2) for v in os.getloadavg()],
        },
        "rows": rows,
    }
    path = args.json or DEFAULT_SWEEP_JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    console.print(f"wrote {path}")


# -- HF transformers + PEFT ----------------------------------------------------------------------
def hf_peft_model(model_dir: Path, adapters: list[Adapter], device: str = "cpu"):
    import transformers
    from peft import PeftModel

    transformers.logging.set_verbosity_error()
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapters[0].path, adapter_name=adapters[0].name)
    for adapter in adapters[1:]:
        model.load_adapter(adapter.path, adapter_name=adapter.name)
    return model.to(device).eval()


@torch.inference_mode()
def run_hf(model, workload: Workload, prompts, chosen) -> dict:
    groups: dict[str | None, list[int]] = defaultdict(list)
    for i, adapter in enumerate(chosen):
        groups[adapter.name if adapter else None].append(i)
    kwargs = dict(
        max_new_tokens=workload.output_len,
        min_new_tokens=workload.output_len,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    tokens = 0
    start = time.perf_counter()
    for name, indices in groups.items():
        ids = torch.tensor([prompts[i] for i in indices], device=model.device)
        mask = torch.ones_like(ids)
        if name is None:
            with model.disable_adapter():
                out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        else:
            model.set_adapter(name)
            out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        tokens += out[:, ids.shape[1] :].numel()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


# -- report --------------------------------------------------------------------------------------
def table(rows: list[dict], ranks: list[str]) -> Table:
    out = Table(title="Engine throughput (generated tokens/s) and TPOT per adapter rank (ms)")
    for column in (
        "workload",
        "ours tok/s",
        "ours tok/CPU-s",
        "× ours base-only",
        "HF+PEFT tok/s",
        "ours × HF+PEFT",
    ):
        out.add_column(column, justify="right")
    for rank in ranks:
        out.add_column(f"TPOT r{rank}" if rank != "base" else "TPOT base", justify="right")
    for row in rows:
        ours, hf = row["ours"], row["hf_peft"]
        tpot = ours["tpot_by_rank_s"]
        out.add_row(
            row["label"],
            f"{ours['tokens_per_s']:.0f}",
            f"{ours['tokens_per_cpu_s']:.0f}",
            f"{row['ratio_to_ours_base_only']:.2f}",
            f"{hf['tokens_per_s']:.0f}",
            f"{row['ratio_to_hf_peft']:.1f}",
            *[f"{tpot[r] * 1e3:.1f}" if r in tpot else "–" for r in ranks],
        )
    return out


def workloads(args) -> list[Workload]:
    counts = (0, 1, 8) if args.quick else (0, 1, 8, 32, 64)
    return [Workload(args.requests, args.prompt_len, args.output_len, n) for n in counts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="16 requests × 8 tokens, 0/1/8 adapters, one run each"
    )
    parser.add_argument("--requests", type=int)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int)
    parser.add_argument(
        "--repeats", type=int, help="measured runs of ours per workload (default 3; quick 1)"
    )
    parser.add_argument(
        "--lora-budget-fraction",
        type=float,
        default=0.25,
        help="the capped row's max_lora_bytes_per_step, as a fraction of its adapters' total bytes",
    )
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "loraplex-bench"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both engines)")
    parser.add_argument(
        "--json", type=Path, help=f"results file (default {DEFAULT_JSON}; quick: *.quick.json)"
    )
    parser.add_argument(
        "--sampling",
        choices=("greedy", "mixed"),
        default="greedy",
        help="mixed: each request samples with one of four mixes (ours only)",
    )
    parser.add_argument("--skip-hf", action="store_true", help="ours only (no HF + PEFT runs)")
    parser.add_argument(
        "--contexts",
        help="decode step time at 64 sequences for these context lengths (e.g. 64,256,1024) "
        "instead of the throughput workloads",
    )
    args = parser.parse_args()
    args.requests = args.requests or (16 if args.quick else 64)
    args.output_len = args.output_len or (8 if args.quick else 32)
    repeats = args.repeats or (1 if args.quick else 3)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 160)
    if args.contexts:
        context_sweep(args, console)
        return
    started = time.perf_counter()

    shape = ModelShape(args.layers, args.hidden, intermediate=args.hidden * 11 // 4 // 64 * 64)
    plan = workloads(args)
    capped_base = plan[-1]
    model_dir = build_model(args.cache_dir, shape)
    adapters = build_adapters(model_dir, max(w.num_adapters for w in plan))
    console.log(f"model {model_dir}, {len(adapters)} adapters")

    engine, refs = ours_engine(model_dir, adapters, None, args.device)
    warm_prompts, warm_chosen = make_requests(capped_base, shape.vocab, adapters)
    run_ours(
        engine, capped_base, warm_prompts, warm_chosen, refs
    )  # loads every adapter, warms torch
    adapter_bytes = sum(
        engine.adapters.nbytes_of(refs[a.name].key) for a in adapters[: capped_base.num_adapters]
    )
    results = []
    for workload in plan:
        prompts, chosen = make_requests(workload, shape.vocab, adapters)
        ours = median_run(
            [
                run_ours(engine, workload, prompts, chosen, refs, args.sampling)
                for _ in range(repeats)
            ]
        )
        results.append({"workload": workload, "ours": ours})
        console.log(f"ours {workload.label}: {ours['tokens_per_s']:.0f} tok/s")
    engine.close()

    cap = int(adapter_bytes * args.lora_budget_fraction)
    capped = Workload(**{**asdict(capped_base), "lora_bytes_per_step": cap})
    engine, refs = ours_engine(model_dir, adapters, cap, args.device)
    prompts, chosen = make_requests(capped, shape.vocab, adapters)
    run_ours(engine, capped, prompts, chosen, refs)
    ours = median_run(
        [run_ours(engine, capped, prompts, chosen, refs, args.sampling) for _ in range(repeats)]
    )
    results.append({"workload": capped, "ours": ours})
    console.log(f"ours {capped.label}: {ours['tokens_per_s']:.0f} tok/s")
    engine.close()

    hf_model = None if args.skip_hf else hf_peft_model(model_dir, adapters, args.device)
    hf_by_adapters = {w.num_adapters: {"tokens_per_s": float("nan")} for w in plan}
    for workload in plan if hf_model is not None else ():
        prompts, chosen = make_requests(workload, shape.vocab, adapters)
        hf_by_adapters[workload.num_adapters] = run_hf(hf_model, workload, prompts, chosen)
        tokens_per_s = hf_by_adapters[workload.num_adapters]["tokens_per_s"]
        console.log(f"HF+PEFT {workload.label}: {tokens_per_s:.0f} tok/s")

    base_only = results[0]["ours"]["tokens_per_s"]
    rows = []
    for result in results:
        workload, ours = result["workload"], result["ours"]
        hf = hf_by_adapters[workload.num_adapters]
        rows.append(
            {
                "label": workload.label,
                "workload": asdict(workload),
                "ours": ours,
                "hf_peft": hf,
                "ratio_to_ours_base_only": ours["tokens_per_s"] / base_only,
                "ratio_to_hf_peft": ours["tokens_per_s"] / hf["tokens_per_s"],
            }
        )
    ranks = sorted({r for row in rows for r in row["ours"]["tpot_by_rank_s"]}, key=_rank_order)
    console.print(table(rows, ranks))
    report = {
        "benchmark": "engine_throughput",
        "quick": args.quick,
        "model": asdict(shape),
        "dtype": "float32",
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "repeats": repeats,
        "sampling": args.sampling,
        "adapter_bytes_of_largest_workload": adapter_bytes,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "load_average_1m_5m_15m": [round(v, 2) for v in os.getloadavg()],
        },
        "wall_seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    default = (
        DEFAULT_JSON
        if args.device == "cpu"
        else DEFAULT_JSON.with_suffix(f".{args.device.split(':')[0]}.json")
    )
    out = args.json or (default.with_suffix(".quick.json") if args.quick else default)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
