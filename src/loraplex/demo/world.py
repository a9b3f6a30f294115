"""The demo world: a tiny Llama trained to copy strings, and LoRA adapters that each apply a string
transform.

Every adapter name maps to a known Python transform (TRANSFORMS), so any response can be checked for
the right answer. Prompt format: `make_prompt("hello") == "<s>hello<sep>"`; the base answers
`hello</s>`, the `upper` adapter `HELLO</s>`, `reverse` `olleh</s>`. Build with `python -m
loraplex.demo.world [--dir DIR]`.

Layout of a world directory:
    model/                  config.json, model.safetensors, generation_config.json, tokenizer files
    adapters/<name>/        adapter_config.json, adapter_model.safetensors (PEFT format)
    world.json              written last: its presence marks a complete build
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from loraplex.demo.build import NUM_RANKS, AdapterRecipe, BuildPlan, StageResult
from loraplex.demo.tokenizer import make_prompt
from loraplex.demo.transforms import TRANSFORMS, random_inputs

__all__ = [
    "ACCURACY_BAR",
    "ADAPTER_RECIPES",
    "BASE_MODEL_NAME",
    "TRANSFORMS",
    "WORLD_VERSION",
    "World",
    "WorldBuildError",
    "build_world",
    "default_world_dir",
    "load_world",
    "make_prompt",
    "random_inputs",
]

WORLD_VERSION = "2"
"""Bump whenever anything that changes the built files changes: recipes, tokenizer, model shape,
library pins."""
BASE_MODEL_NAME = "loraplex-demo-base"
"""The base model's name in every adapter_config.json (`base_model_name_or_path`)."""
ACCURACY_BAR = 0.95
SEED = 20240601
NUM_EVAL = 200
EVAL_SEED = -1
"""random_inputs(NUM_EVAL, EVAL_SEED) are held out of all training and measure the build."""
MARKER = "world.json"

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ADAPTER_RECIPES = (
    AdapterRecipe("rotate", rank=4, lora_alpha=8, target_modules=ATTENTION, steps=200),
    AdapterRecipe(
        "rot13",
        rank=8,
        lora_alpha=16,
        target_modules=("v_proj", "o_proj", "up_proj", "down_proj"),
        steps=250,
    ),
    # rsLoRA with alpha = sqrt(r): scaling 1, so it trains like the others; servers must apply alpha
    # / sqrt(r).
    AdapterRecipe(
        "reverse", rank=16, lora_alpha=4, use_rslora=True, target_modules=ATTENTION, steps=500
    ),
    AdapterRecipe(
        "double-letters", rank=32, lora_alpha=32, target_modules=ATTENTION + MLP, steps=550
    ),
)
BASE_STEPS, BASE_LR, BATCH_SIZE = 600, 5e-3, 64


class WorldBuildError(RuntimeError):
    """The build finished but a model missed the accuracy bar; the message holds the table."""


@dataclass(frozen=True)
class World:
    root: Path
    model_dir: Path
    """A Hugging Face model directory: config, safetensors weights, tokenizer, generation config."""
    adapters: dict[str, Path]
    """Adapter name -> PEFT adapter directory; each name is a key of TRANSFORMS."""
    ranks: dict[str, int]
    accuracy: dict[str, float]
    """Exact match at build time on held-out inputs, per adapter name, and "copy" for the base."""


def default_world_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "loraplex" / "demo" / WORLD_VERSION


def load_world(root: Path) -> World | None:
    """The world built in `root`, or None if it is missing, half built, or of another version."""
    root = Path(root).absolute()
    try:
        meta = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if meta.get("version") != WORLD_VERSION:
        return None
    model_dir = root / meta["model_dir"]
    adapters = {name: root / info["dir"] for name, info in meta["adapters"].items()}
    files = [model_dir / "model.safetensors", model_dir / "tokenizer.json"]
    files += [path / "adapter_model.safetensors" for path in adapters.values()]
    if not all(path.is_file() for path in files):
        return None
    return World(
        root=root,
        model_dir=model_dir,
        adapters=adapters,
        ranks={name: info["rank"] for name, info in meta["adapters"].items()},
        accuracy={
            "copy": meta["base"]["accuracy"],
            **{n: i["accuracy"] for n, i in meta["adapters"].items()},
        },
    )


def build_world(out_dir: Path | None = None, *, progress: bool = True) -> World:
    """The world in `out_dir` (default: default_world_dir()), built first if it is missing or half
    built.

    Raises WorldBuildError if a freshly built model misses the accuracy bar (nothing is marked
    complete then).
    """
    root = Path(out_dir or default_world_dir()).absolute()
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive(root / ".lock"):  # a second process waits here, then finds the world built
        world = load_world(root)
        if world is None:
            world = _build(root, progress)
    return world


def build_plan() -> BuildPlan:
    return BuildPlan(
        seed=SEED,
        base_steps=BASE_STEPS,
        base_lr=BASE_LR,
        batch_size=BATCH_SIZE,
        adapters=ADAPTER_RECIPES,
        eval_inputs=tuple(random_inputs(NUM_EVAL, EVAL_SEED)),
        base_model_name=BASE_MODEL_NAME,
    )


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(root: Path, progress: bool) -> World:
    from loraplex.demo.build import run_build
    from loraplex.demo.tokenizer import write_tokenizer_files

    plan = build_plan()
    # Remove what a half-finished build left; the marker first, so a crash below still means "not
    # built".
    (root / MARKER).unlink(missing_ok=True)
    for leftover in ("model", BASE_MODEL_NAME, "adapters"):
        shutil.rmtree(root / leftover, ignore_errors=True)
    # The model directory carries the base model's name, which every adapter_config.json names, so
    # that the registry's base-model check matches them.
    model_dir, adapters_dir = root / BASE_MODEL_NAME, root / "adapters"
    model_dir.mkdir()
    adapters_dir.mkdir()
    start, cpu_start = time.monotonic(), _children_cpu_seconds()
    with _progress_reporter(plan, progress) as (report, on_result):
        results = run_build(plan, model_dir, adapters_dir, report, on_result)
    seconds, cpu_seconds = time.monotonic() - start, _children_cpu_seconds() - cpu_start
    write_tokenizer_files(model_dir)
    table = _format_table(plan, results, seconds, cpu_seconds)
    if progress:
        print(table, flush=True)
    failed = [r.name for r in results if r.accuracy < ACCURACY_BAR]
    if failed or len(results) != 1 + len(plan.adapters):
        raise WorldBuildError(
            f"demo world in {root}: below the {ACCURACY_BAR:.0%} bar: {', '.join(failed)}\n{table}"
        )
    _write_marker(root, plan, results, seconds, cpu_seconds)
    world = load_world(root)
    assert world is not None
    return world


def _children_cpu_seconds() -> float:
    """CPU time of finished child processes: what the build costs, however busy the machine is."""
    times = os.times()
    return times.children_user + times.children_system


def _write_marker(
    root: Path, plan: BuildPlan, results: list[StageResult], seconds: float, cpu_seconds: float
) -> None:
    import peft
    import torch
    import transformers

    by_name = {r.name: r for r in results}
    meta = {
        "version": WORLD_VERSION,
        "seed": plan.seed,
        "prompt_format": make_prompt("{text}"),
        "completion_format": "{output}</s>",
        "model_dir": BASE_MODEL_NAME,
        "base_model_name": plan.base_model_name,
        "base": {
            "accuracy": by_name["copy"].accuracy,
            "steps": plan.base_steps,
            "seconds": by_name["copy"].seconds,
        },
        "adapters": {
            r.name: {
                "dir": f"adapters/{r.name}",
                "rank": r.rank,
                "lora_alpha": r.lora_alpha,
                "target_modules": list(r.target_modules),
                "use_rslora": r.use_rslora,
                "steps": r.steps,
                "accuracy": by_name[r.name].accuracy,
                "seconds": by_name[r.name].seconds,
            }
            for r in plan.adapters
        },
        "eval": {"inputs": len(plan.eval_inputs), "seed": EVAL_SEED},
        "build_seconds": seconds,
        "build_cpu_seconds": cpu_seconds,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        },
    }
    tmp = root / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, root / MARKER)


def _format_table(
    plan: BuildPlan, results: list[StageResult], seconds: float, cpu_seconds: float
) -> str:
    recipes = {r.name: r for r in plan.adapters}
    lines = [
        f"{'model':<16} {'rank':>4} {'alpha':>5} {'rslora':>6}  {'target modules':<28} "
        f"{'steps':>5} "
        f"{'exact match':>11} {'seconds':>7}"
    ]
    for result in results:
        recipe = recipes.get(result.name)
        if recipe is None:
            cols = (
                f"{'base':<16} {'-':>4} {'-':>5} {'-':>6}  {'(full model, copy)':<28} "
                f"{plan.base_steps:>5}"
            )
        else:
            targets = ",".join(m.removesuffix("_proj") for m in recipe.target_modules)
            cols = (
                f"{recipe.name:<16} {recipe.rank:>4} {recipe.lora_alpha:>5} "
                f"{str(recipe.use_rslora).lower():>6}  {targets:<28} {recipe.steps:>5}"
            )
        flag = "" if result.accuracy >= ACCURACY_BAR else "  BELOW BAR"
        lines.append(f"{cols} {result.accuracy:>10.1%} {result.seconds:>7.0f}{flag}")
    lines.append(
        f"exact match on {len(plan.eval_inputs)} held-out inputs; built in {seconds:.0f} s "
        f"({cpu_seconds:.0f} CPU-seconds over {NUM_RANKS} processes)"
    )
    return "\n".join(lines)


@contextlib.contextmanager
def _progress_reporter(plan: BuildPlan, enabled: bool, out: TextIO | None = None):
    """(steps report, stage-end report): a bar per stage on a terminal; elsewhere (piped, in a log),
    where a bar shows nothing until the end, one line per stage as it ends."""
    out = out or sys.stdout
    if not enabled:
        yield None, None
        return
    if not out.isatty():
        yield None, _stage_lines(plan, out)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description:<16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as bar:
        tasks = {"copy": bar.add_task("base (copy)", total=plan.base_steps)}
        tasks |= {r.name: bar.add_task(r.name, total=r.steps) for r in plan.adapters}
        yield (lambda stage, steps: bar.advance(tasks[stage], steps)), None


def _stage_lines(plan: BuildPlan, out: TextIO):
    steps = {"copy": plan.base_steps} | {r.name: r.steps for r in plan.adapters}
    done = []
    print(
        f"building the demo world: the base model and {len(plan.adapters)} adapters "
        f"({sum(steps.values())} training steps, a few minutes)",
        file=out,
        flush=True,
    )

    def on_result(result: StageResult) -> None:
        done.append(result.name)
        label = "base (copy)" if result.name == "copy" else result.name
        print(
            f"[{len(done)}/{len(steps)}] {label}: {steps[result.name]} steps, exact match "
            f"{result.accuracy:.1%}, {result.seconds:.0f} s",
            file=out,
            flush=True,
        )

    return on_result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loraplex.demo.world", description="Build the demo world."
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help=f"where to build (default {default_world_dir()})"
    )
    args = parser.parse_args(argv)
    try:
        world = build_world(args.dir)
    except WorldBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"demo world {WORLD_VERSION} at {world.root}")
    for name, acc in world.accuracy.items():
        print(f"  {name:<16} exact match {acc:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
