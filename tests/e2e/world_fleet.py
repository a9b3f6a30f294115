"""A registry of demo-world adapters under many names, tenants and revisions, for the
proof-under-load tests."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.registry import Registry

TENANTS = ("acme", "globex", "initech")


@dataclass
class Catalog:
    registry_url: str
    keys: dict[str, str]
    transform_of: dict[str, str]  # name -> transform
    allowed: dict[str, list[str]] = field(default_factory=dict)  # tenant -> names it may use


def variant(src: Path, out: Path, tag: str) -> Path:
    """The same weights with a different adapter_config.json: a new digest, the same answers."""
    shutil.copytree(src, out)
    config = json.loads((out / "adapter_config.json").read_text())
    config["revision"] = tag
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def build_catalog(world, root: Path, copies: int = 10, storage_base: str | None = None) -> Catalog:
    root.mkdir(parents=True, exist_ok=True)
    registry = Registry(
        f"sqlite:///{root / 'registry.db'}",
        base_model_dir=world.model_dir,
        max_lora_rank=max(world.ranks.values()),
        storage_base=storage_base,
    )
    registry.init()
    keys = {}
    for tenant in TENANTS:
        registry.add_tenant(tenant, 0)
        keys[tenant] = registry.create_key(tenant)
    transform_of, allowed = {}, {t: [] for t in TENANTS}
    for i in range(copies):
        for transform, path in sorted(world.adapters.items()):
            name = f"{transform}-{i}"
            owner = None if i % 4 == 0 else TENANTS[i % 3]
            registry.add_revision(path, name, revision="r1", tenant=owner, status="stable")
            if i % 2 == 1:  # a second revision with the same answers, rolled out at 50%
                registry.add_revision(
                    variant(path, root / "variants" / name, "r2"), name, revision="r2", tenant=owner
                )
                registry.promote(name, "r2", 50, force=True)
            transform_of[name] = transform
            for tenant in TENANTS:
                if owner in (None, tenant):
                    allowed[tenant].append(name)
    registry.close()
    return Catalog(f"sqlite:///{root / 'registry.db'}", keys, transform_of, allowed)


def pick(catalog: Catalog, rng: random.Random) -> tuple[str, str]:
    tenant = rng.choice(TENANTS)
    return tenant, rng.choice(catalog.allowed[tenant])


def checked_inputs(world, n: int = 60, seed: int = 99) -> dict[str, list[str]]:
    """Per transform (and "copy" for the base), inputs its adapter answers right when run alone.

    The adapters are ~96-100% exact; under load any answer that differs from this isolated run is a
    serving error (wrong adapter, wrong version, corrupted batch), not a model error.
    """
    from loraplex.demo.world import TRANSFORMS, make_prompt, random_inputs
    from loraplex.engines.native.config import EngineConfig
    from loraplex.engines.native.llm_engine import LLMEngine
    from loraplex.engines.native.sequence import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model_dir=world.model_dir,
            dtype="float32",
            max_loras=len(world.adapters),
            max_lora_rank=max(world.ranks.values()),
            kv_cache_memory_bytes=64 * 2**20,
        )
    )
    texts = random_inputs(n, seed)
    good = {}
    try:
        for name in ["copy", *sorted(world.adapters)]:
            ref = engine.adapter_ref(name, world.adapters[name]) if name != "copy" else None
            prompts = [engine.tokenizer.encode(make_prompt(t)) for t in texts]
            outs = engine.generate(
                prompts, SamplingParams(max_tokens=40, temperature=0), [ref] * len(texts)
            )
            good[name] = [
                t
                for t, o in zip(texts, outs)
                if engine.tokenizer.decode(o).strip() == TRANSFORMS[name](t)
            ]
    finally:
        engine.close()
    return good
