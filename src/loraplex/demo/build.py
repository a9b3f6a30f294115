"""Building the demo world's files: two single-threaded training processes, data-parallel.

Why two processes of one thread rather than one process of two threads: on an idle machine both are
about twice as fast as one thread, but when other jobs share the cores, two OpenMP threads slow to a
crawl (measured 3.5 s a step against 0.26 s), while single-threaded ranks just get their share. The
build is reproducible because the number of ranks and threads is fixed, whatever the machine's core
count.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

NUM_RANKS = 2

Report = Callable[[str, int], None]  # (stage name, steps just done)


@dataclass(frozen=True)
class AdapterRecipe:
    """How one adapter is trained; `name` is a key of TRANSFORMS."""

    name: str
    rank: int
    lora_alpha: int
    target_modules: tuple[str, ...]
    steps: int
    lr: float = 5e-3
    lr_b_ratio: float = 4.0
    """LoRA+: lora_B's learning rate is this many times lr; 4 cuts the steps needed by about a third
    here (16, the paper's value, diverged)."""
    use_rslora: bool = False


@dataclass(frozen=True)
class BuildPlan:
    seed: int
    base_steps: int
    base_lr: float
    batch_size: int
    adapters: tuple[AdapterRecipe, ...]
    eval_inputs: tuple[str, ...]
    """Held out of training; each model's exact match is measured on them."""
    base_model_name: str


@dataclass(frozen=True)
class StageResult:
    name: str
    accuracy: float
    seconds: float


def run_build(
    plan: BuildPlan,
    model_dir: Path,
    adapters_dir: Path,
    report: Report | None,
    on_result: Callable[[StageResult], None] | None = None,
) -> list[StageResult]:
    """Train and save the base and every adapter; the results come back in training order ("copy"
    first), each also to `on_result` as its stage ends."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    messages = context.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="loraplex-demo-") as tmp:
        store = os.path.join(tmp, "dist-store")
        procs = mp.start_processes(
            _rank_main,
            args=(plan, model_dir, adapters_dir, store, messages),
            nprocs=NUM_RANKS,
            join=False,
            start_method="spawn",
        )
        results: list[StageResult] = []
        while True:
            while not messages.empty():
                kind, *payload = messages.get()
                if kind == "steps" and report:
                    report(*payload)
                elif kind == "result":
                    results.append(StageResult(*payload))
                    if on_result:
                        on_result(results[-1])
            if procs.join(
                timeout=0.2
            ):  # raises, naming the rank and its traceback, if a rank failed
                break
    while not messages.empty():
        kind, *payload = messages.get()
        if kind == "result":
            results.append(StageResult(*payload))
            if on_result:
                on_result(results[-1])
    return results


def _rank_main(
    rank: int, plan: BuildPlan, model_dir: Path, adapters_dir: Path, store: str, messages
) -> None:
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist
    import transformers

    from loraplex.demo import training
    from loraplex.demo.transforms import TRANSFORMS

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=NUM_RANKS)
    exclude = set(plan.eval_inputs)
    eval_inputs = list(plan.eval_inputs)

    progress_for = functools.partial(_progress_for, rank, messages)
    start = time.monotonic()
    base_config = training.TrainConfig(
        steps=plan.base_steps, lr=plan.base_lr, batch_size=plan.batch_size
    )
    base = training.train_base(base_config, plan.seed, exclude, progress_for("copy"))
    accuracy = training.exact_match(base, TRANSFORMS["copy"], eval_inputs)
    if rank == 0:
        base.save_pretrained(model_dir, safe_serialization=True)
        messages.put(("result", "copy", accuracy, time.monotonic() - start))

    for recipe in plan.adapters:
        _train_one(rank, plan, recipe, base, eval_inputs, exclude, adapters_dir, messages)
    dist.destroy_process_group()


def _train_one(
    rank: int, plan: BuildPlan, recipe, base, eval_inputs, exclude, adapters_dir: Path, messages
) -> None:
    """Train one recipe's adapter on every rank; rank 0 saves it and reports its accuracy."""
    from peft import LoraConfig

    from loraplex.demo import training
    from loraplex.demo.transforms import TRANSFORMS

    progress_for = functools.partial(_progress_for, rank, messages)
    start = time.monotonic()
    lora = LoraConfig(
        r=recipe.rank,
        lora_alpha=recipe.lora_alpha,
        target_modules=list(recipe.target_modules),
        use_rslora=recipe.use_rslora,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    config = training.TrainConfig(
        steps=recipe.steps,
        lr=recipe.lr,
        lr_b_ratio=recipe.lr_b_ratio,
        batch_size=plan.batch_size,
    )
    seed = plan.seed + zlib.crc32(recipe.name.encode())
    transform = TRANSFORMS[recipe.name]
    model = training.train_adapter(
        base, transform, lora, config, seed, exclude, progress_for(recipe.name)
    )
    accuracy = training.exact_match(model, transform, eval_inputs)
    if rank == 0:
        # A stable name rather than the cache path, so adapter_config.json is the same wherever
        # it is built.
        model.peft_config["default"].base_model_name_or_path = plan.base_model_name
        model.save_pretrained(adapters_dir / recipe.name, safe_serialization=True)
        _normalize_adapter_dir(adapters_dir / recipe.name)
        messages.put(("result", recipe.name, accuracy, time.monotonic() - start))


def _progress_for(rank: int, messages, stage: str):
    """A training progress callback that reports every 10 steps from rank 0 (None elsewhere)."""
    if rank != 0:
        return None
    pending = [0]

    def progress(steps: int) -> None:
        pending[0] += steps
        if pending[0] >= 10:
            messages.put(("steps", stage, pending[0]))
            pending[0] = 0

    return progress


def _normalize_adapter_dir(adapter_dir: Path) -> None:
    """Keep only the two PEFT files, and list target_modules sorted (peft writes a set, in hash
    order)."""
    (adapter_dir / "README.md").unlink(missing_ok=True)
    config_path = adapter_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
