"""`loraplex demo`: many adapters of the demo world answering in one continuous batch, checked."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.engine.sequence import SamplingParams


def run_engine_demo(world, console: Console, max_loras: int, per_adapter: int = 3, seed: int = 1234) -> tuple[int, int]:
    """One mixed batch over every adapter and the base; prints a table and returns (correct, checked)."""
    from loraplex.demo.world import TRANSFORMS, make_prompt, random_inputs

    engine = LLMEngine(EngineConfig(model_dir=world.model_dir, dtype="float32", max_loras=max_loras,
                                    max_lora_rank=max(world.ranks.values()), kv_cache_bytes=64 * 2**20))
    try:
        jobs = []
        inputs = random_inputs(per_adapter * (len(world.adapters) + 1), seed)
        names = [None, *sorted(world.adapters)]
        for i, text in enumerate(inputs):
            name = names[i % len(names)]
            ref = engine.adapter_ref(name, world.adapters[name]) if name else None
            jobs.append((name, text, ref))
        params = SamplingParams(max_tokens=64, temperature=0)
        start = time.perf_counter()
        prompts = [engine.tokenizer.encode(make_prompt(text)) for _, text, _ in jobs]
        ids = [engine.add_request(p, params, ref) for p, (_, _, ref) in zip(prompts, jobs)]
        texts, tiers = {i: "" for i in ids}, {}
        while engine.has_work():
            for out in engine.step():
                if out.error is not None:
                    raise out.error
                texts[out.request_id] += out.text
                tiers.setdefault(out.request_id, out.cache_tier)
        elapsed = time.perf_counter() - start
    finally:
        engine.close()
    table = Table(title=f"One continuous batch: {len(jobs)} requests, {len(world.adapters)} adapters "
                        f"+ base, {max_loras} slots ({elapsed:.2f} s)")
    for column in ("adapter", "rank", "tier", "input", "output", "correct"):
        table.add_column(column)
    correct = 0
    for rid, (name, text, _) in zip(ids, jobs):
        expected = TRANSFORMS[name or "copy"](text)
        ok = texts[rid].strip() == expected
        correct += ok
        table.add_row(name or "(base)", str(world.ranks.get(name, "-")), tiers[rid], text, texts[rid],
                      "[green]yes[/]" if ok else f"[red]no[/] (want {expected})")
    console.print(table)
    return correct, len(jobs)


def run_demo(out_dir: Path | None, max_loras: int = 4) -> int:
    from loraplex.demo.world import build_world

    console = Console()
    world = build_world(out_dir)
    correct, checked = run_engine_demo(world, console, max_loras)
    console.print(f"{correct}/{checked} correct")
    return 0 if correct == checked else 1
