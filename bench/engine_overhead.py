"""The native engine's own cost: each engine step beside a bare batched forward of the same batch.

    python bench/engine_overhead.py [--quick] [--rounds 3] [--steps 16] [--layers 4] [--hidden 512]
        [--device cpu|cuda] [--threads N] [--cache-dir DIR] [--json OUT]

The model and its 64 adapters (ranks 8/16/32/64 on all seven linear modules) are those of
`bench/engine_throughput.py`, built once and cached. For each batch composition:

- decode: 64 sequences, with no adapter, with 8 adapters and with 64 adapters;
- prefill: 8 new 32-token prompts, 8 adapters;
- mixed: 56 decodes and 8 new prompts, 8 adapters;

a round times `--steps` engine steps (`LLMEngine.step`: scheduling, the input tensors, the LoRA
groups, the forward, sampling, detokenising, the outputs), then as many bare forwards: the model's
forward and logits on the very tensors the round's last step built, captured from it. Rounds
alternate the two; each figure is the median over every step of every round. `step / forward` is
what the engine adds to the model; the goal is at most 1.15 for decode with 8 and 64 adapters.

Then one stream (a 32-token prompt, 64 tokens, one adapter already resident) runs alone, and the
steps it took are counted: the goal is no more than its tokens plus its prefill chunks.
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
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_throughput import ModelShape, build_adapters, build_model, ours_engine  # noqa: E402

DEFAULT_JSON = Path(__file__).parent / "results" / "engine_overhead.json"
PROMPT_LEN = 32
# (label, decoding sequences, new prompts per step, adapters)
CASES = [
    ("decode, base only", 64, 0, 0),
    ("decode, 8 adapters", 64, 0, 8),
    ("decode, 64 adapters", 64, 0, 64),
    ("prefill, 8 adapters", 0, 8, 8),
    ("mixed, 8 adapters", 56, 8, 8),
]
GOAL_CASES = ("decode, 8 adapters", "decode, 64 adapters")


class Capture:
    """Wraps the model's forward and logits: times each call and keeps the last call's inputs."""

    def __init__(self, model):
        self.model = model
        self.forward, self.logits = model.forward, model.logits
        self.last_forward: tuple = ()
        self.last_logits: tuple = ()
        model.forward, model.logits = self._forward, self._logits

    def _forward(self, *args):
        self.last_forward = args
        return self.forward(*args)

    def _logits(self, *args):
        self.last_logits = args
        return self.logits(*args)

    @torch.inference_mode()
    def bare(self) -> float:
        """Seconds of one bare forward and logits on the last step's inputs."""
        sync()
        started = time.perf_counter()
        self.forward(*self.last_forward)
        self.logits(*self.last_logits)
        sync()
        return time.perf_counter() - started


def sync() -> None:
    """On CUDA, wait for the device's queued work, so that a time covers it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts(rng: random.Random, count: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(2, vocab) for _ in range(PROMPT_LEN)] for _ in range(count)]


def run_case(engine: LLMEngine, capture: Capture, refs: list, case, args, vocab: int) -> dict:
    label, decodes, new, num_adapters = case
    rng = random.Random(label)
    used = refs[:num_adapters]

    def adapter(i: int):
        return used[i % len(used)] if used else None

    long = SamplingParams(max_tokens=args.rounds * args.steps + 8, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    running = [
        engine.add_request(p, long, adapter(i)) for i, p in enumerate(prompts(rng, decodes, vocab))
    ]
    started: set[str] = set()
    while len(started) < len(running):  # their prefills: from here on each step decodes them all
        started.update(out.request_id for out in engine.step())
    steps, bares = [], []
    for _ in range(args.rounds):
        for _ in range(args.steps):
            for i, p in enumerate(prompts(rng, new, vocab)):
                engine.add_request(p, one, adapter(decodes + i))
            sync()
            began = time.perf_counter()
            engine.step()
            sync()
            steps.append(time.perf_counter() - began)
        bares += [capture.bare() for _ in range(args.steps)]
    for request_id in running:
        engine.abort(request_id)
    while engine.has_work():
        engine.step()
    step_ms, bare_ms = 1e3 * statistics.median(steps), 1e3 * statistics.median(bares)
    return {"case": label, "step_ms": step_ms, "forward_ms": bare_ms, "ratio": step_ms / bare_ms}


def single_stream(engine: LLMEngine, ref, vocab: int) -> dict:
    """One stream alone, its adapter resident: the steps it takes against tokens + chunks."""
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    prompt = prompts(random.Random(1), 1, vocab)[0]
    ran, empty_before = 0, engine.empty_steps
    tokens = 0
    engine.add_request(prompt, params, ref)
    while engine.has_work():
        tokens += sum(len(out.token_ids) for out in engine.step())
        ran += 1
    chunk = engine.config.max_num_batched_tokens or PROMPT_LEN
    chunks = -(-PROMPT_LEN // chunk)
    return {
        "tokens": tokens,
        "prefill_chunks": chunks,
        "steps": ran,
        "empty_steps": engine.empty_steps - empty_before,
        "within_goal": ran <= tokens + chunks,
    }


def table(rows: list[dict]) -> Table:
    out = Table(title="engine step against the bare forward of the same batch (medians)")
    for column in ("batch", "engine step ms", "bare forward ms", "step / forward"):
        out.add_column(column, justify="left" if column == "batch" else "right")
    for row in rows:
        goal = " (goal ≤ 1.15)" if row["case"] in GOAL_CASES else ""
        out.add_row(
            row["case"],
            f"{row['step_ms']:.2f}",
            f"{row['forward_ms']:.2f}",
            f"{row['ratio']:.3f}{goal}",
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 4 steps per case")
    parser.add_argument("--rounds", type=int, help="alternating rounds per case (default 3)")
    parser.add_argument("--steps", type=int, help="steps per round (default 16)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "loraplex-bench"
    )
    parser.add_argument("--json", type=Path, help=f"results file (default {DEFAULT_JSON})")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.steps = args.steps or (4 if args.quick else 16)
    out_path = args.json or (
        DEFAULT_JSON.with_suffix(".quick.json") if args.quick else DEFAULT_JSON
    )
    if out_path.suffix != ".json":
        parser.error(f"--json {out_path}: the results file must end in .json")
    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(width=None if sys.stdout.isatty() else 160)

    shape = ModelShape(args.layers, args.hidden, intermediate=args.hidden * 11 // 4 // 64 * 64)
    model_dir = build_model(args.cache_dir, shape)
    adapters = build_adapters(model_dir, 64)
    engine, by_name = ours_engine(model_dir, adapters, None, args.device)
    refs = [by_name[a.name] for a in adapters]
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.generate(prompts(random.Random(0), 64, shape.vocab), warm, refs)  # all 64 resident
    capture = Capture(engine.model)
    rows = [run_case(engine, capture, refs, case, args, shape.vocab) for case in CASES]
    stream = single_stream(engine, refs[0], shape.vocab)

    console.print(table(rows))
    console.print(
        f"one stream: {stream['steps']} steps for {stream['tokens']} tokens and "
        f"{stream['prefill_chunks']} prefill chunk(s), {stream['empty_steps']} empty "
        f"(goal: steps ≤ tokens + chunks: {'met' if stream['within_goal'] else 'missed'})"
    )
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads "
        f"{torch.get_num_threads()}",
        "model": shape.name,
        "rounds": args.rounds,
        "steps": args.steps,
        "rows": rows,
        "single_stream": stream,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {out_path}")
    engine.close()


if __name__ == "__main__":
    main()
