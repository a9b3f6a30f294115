"""The adapter zoo: adapters as trainers make them (PEFT's variants, MLX-LM, torchtune, NeMo,
Unsloth, Axolotl, fused and split projections, lm_head and embedding LoRA, trainable tokens,
modules_to_save, DoRA, LoRA on mixture-of-experts experts) on six architectures, each registered as
a user would. Every case is
either served on the native engine with HF transformers + PEFT's greedy tokens and logprobs, or
refused at registration in one line naming what is not supported. Nothing is served wrong."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from adapter_layouts import GROUPS, fused, shared_a, to_mlx, to_nemo, to_torchtune, without_prefix
from tinymodels import make_adapter, make_model, make_split_twin

from loraplex.artifacts import ArtifactStore
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams
from loraplex.lora_format import CONFIG_FILE, AdapterRejected
from loraplex.model_config import ModelConfig
from loraplex.registry import Registry

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3 = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 5]]
NEW_TOKENS = 6


class Made(NamedTuple):
    """An adapter as its trainer leaves it, and the PEFT adapter that is its reference (on the
    split twin of a fused base when `on_twin`)."""

    src: Path
    peft: Path
    on_twin: bool = False


class Case(NamedTuple):
    arch: str
    name: str
    make: Callable[[World, Path], Made]
    refused: str | None = None  # the refusal's line holds this


def peft(**args):
    """A PEFT adapter made with these LoraConfig arguments, served as PEFT saved it."""

    def make(world, out):
        path = make_adapter(world.model_dir, out, seed=world.seed(), base=world.base, **args)
        return Made(path, path)

    return make


def converted(convert, on_twin=False, share_a=False, **args):
    """A PEFT adapter re-saved by `convert(peft_dir, out, world)` in another trainer's layout;
    with `share_a`, its q, k, v and gate, up first given one A each (what a fused LoRA holds)."""

    def make(world, out):
        model_dir, base = (world.twin_dir, None) if on_twin else (world.model_dir, world.base)
        src = make_adapter(model_dir, out / "peft", seed=world.seed(), base=base, **args)
        if share_a:
            src = shared_a(src, out / "shared", GROUPS)
        return Made(convert(src, out / "converted", world), src, on_twin)

    return make


def mlx(src, out, world):
    return to_mlx(src, out)


def torchtune(src, out, world):
    heads, kv = world.config.num_heads, world.config.num_kv_heads
    return to_torchtune(src, out, heads, kv, meta_rope=world.config.model_type == "llama")


def nemo(src, out, world):
    return to_nemo(src, out, world.config.num_heads, world.config.num_kv_heads, fused=True)


def nemo_canonical(src, out, world):
    return to_nemo(src, out, world.config.num_heads, world.config.num_kv_heads, fused=False)


def fused_names(src, out, world):
    return fused(src, out, GROUPS)


def unsloth(src, out, world):
    out = shutil.copytree(src, out)
    config = json.loads((out / CONFIG_FILE).read_text())
    config["base_model_name_or_path"] = "unsloth/llama-3-8b-bnb-4bit"
    (out / CONFIG_FILE).write_text(json.dumps(config))
    (out / "README.md").write_text("# lora_model\n")
    return out


def axolotl(src, out, world):
    out = shutil.copytree(src, out)
    torch.save({"learning_rate": 2e-4}, out / "training_args.bin")
    (out / "checkpoint-10").mkdir()
    return out


def peft_on_twin(**args):
    """A PEFT adapter on the split twin of a fused base (q/k/v and gate/up names)."""
    return converted(lambda src, out, world: src, on_twin=True, **args)


CASES = [
    Case("llama", "peft-attn", peft(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
    Case("llama", "rslora-all", peft(r=16, lora_alpha=8, use_rslora=True, target_modules=ALL)),
    Case(
        "llama",
        "patterns-layer-1",
        peft(
            r=8,
            lora_alpha=32,
            target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"v_proj": 4},
            alpha_pattern={"down_proj": 3},
            layers_to_transform=[1],
        ),
    ),
    Case("llama", "mlx-lm", converted(mlx, r=4, lora_alpha=8, target_modules=ALL)),
    Case("llama", "torchtune", converted(torchtune, r=8, lora_alpha=16, target_modules=ALL)),
    Case("llama", "nemo", converted(nemo, share_a=True, r=4, lora_alpha=12, target_modules=ALL)),
    Case("llama", "lm-head", peft(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"])),
    Case("llama", "embed", peft(r=4, lora_alpha=12, target_modules=["embed_tokens", "v_proj"])),
    Case(
        "llama",
        "unsloth-qlora",
        converted(
            unsloth, r=16, lora_alpha=16, use_rslora=True, loftq_config={}, target_modules=ALL
        ),
    ),
    Case(
        "llama",
        "torchtune-dora",
        converted(torchtune, r=4, lora_alpha=8, use_dora=True, target_modules=ALL),
    ),
    Case(
        "llama",
        "lora-bias",
        peft(r=4, lora_alpha=8, target_modules=["q_proj"], lora_bias=True),
        refused="lora_bias: LoRA with a bias on B (lora_bias) is not supported",
    ),
    Case(
        "qwen2",
        "no-prefix",
        converted(lambda s, o, w: without_prefix(s, o), r=8, target_modules=ALL),
    ),
    Case(
        "qwen2",
        "torchtune",
        converted(torchtune, r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"]),
    ),
    Case(
        "qwen2",
        "dora-rslora",
        peft(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            use_dora=True,
            target_modules=["k_proj", "down_proj"],
        ),
    ),
    Case(
        "qwen2",
        "axolotl-saved-heads",
        converted(
            axolotl,
            r=8,
            lora_alpha=16,
            lora_dropout=0.05,
            target_modules=ALL[::-1],
            modules_to_save=["embed_tokens", "lm_head"],
        ),
    ),
    Case("qwen3", "regex", peft(r=4, lora_alpha=6, target_modules=r".*\.(k_proj|up_proj)")),
    Case(
        "qwen3",
        "trainable-tokens",
        peft(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[5, 20]),
    ),
    Case("qwen3", "dora", peft(r=8, lora_alpha=16, use_dora=True, target_modules=ALL)),
    Case("qwen3", "mlx-lm", converted(mlx, r=8, lora_alpha=8, target_modules=["v_proj", "o_proj"])),
    Case(
        "mistral",
        "peft-mlp",
        peft(r=4, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
    ),
    Case(
        "mistral",
        "fused-names",
        converted(fused_names, share_a=True, r=4, lora_alpha=8, target_modules=ALL),
    ),
    Case(
        "mistral",
        "nemo-canonical",
        converted(nemo_canonical, r=8, lora_alpha=8, target_modules=ALL),
    ),
    Case("phi3", "fused", peft(r=8, lora_alpha=16, target_modules=PHI3)),
    Case(
        "phi3",
        "fused-dora",
        peft(r=4, lora_alpha=8, use_dora=True, target_modules=["qkv_proj", "gate_up_proj"]),
    ),
    Case(
        "phi3",
        "split-names",
        peft_on_twin(r=4, lora_alpha=8, target_modules=ALL, rank_pattern={"k_proj": 2}),
    ),
    # torchtune saves a Phi-3 adapter under its own split names only (no PEFT export for Phi-3)
    Case(
        "phi3",
        "torchtune",
        converted(torchtune, on_twin=True, r=4, lora_alpha=8, target_modules=ALL),
    ),
    Case("phi3", "lm-head", peft(r=4, lora_alpha=8, target_modules=["gate_up_proj", "lm_head"])),
    Case(
        "llama",
        "target-parameters-dense",
        peft(
            r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["mlp.up_proj.weight"]
        ),
        refused="target_parameters: LoRA on parameters is supported on the experts of a "
        "mixture-of-experts base only; LlamaForCausalLM has none",
    ),
    # Qwen3-MoE: LoRA on the 3-D expert weights as PEFT writes it (`target_parameters`)
    Case(
        "qwen3_moe",
        "experts-and-attention",
        peft(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS),
    ),
    Case(
        "qwen3_moe",
        "experts-patterns-rslora",
        peft(
            r=8,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["o_proj"],
            target_parameters=EXPERTS,
            rank_pattern={"gate_up_proj": 4},
            alpha_pattern={"down_proj": 3},
        ),
    ),
    Case(
        "qwen3_moe",
        "down-experts-only",
        peft(r=4, lora_alpha=16, target_parameters=["mlp.experts.down_proj"]),
    ),
    Case("qwen3_moe", "attention", peft(r=8, lora_alpha=16, target_modules=ALL[:4])),
]


class World:
    """One architecture's base, its HF model, a registry over it and a native engine."""

    def __init__(self, arch: str, root: Path):
        import transformers

        self.root = root
        self.model_dir = make_model(root / "model", arch)
        self.twin_dir = make_split_twin(self.model_dir, root / "twin") if arch == "phi3" else None
        self.config = ModelConfig.from_dir(self.model_dir)
        self.base = transformers.AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=torch.float32
        ).eval()
        self.registry = Registry(
            f"sqlite:///{root}/registry.db",
            ArtifactStore(root / "store"),
            base_model_dir=self.model_dir,
            max_lora_rank=32,
        )
        self.registry.init()
        served = sum(1 for c in CASES if c.arch == arch and c.refused is None)
        self.engine = LLMEngine(
            EngineConfig(
                model_dir=self.model_dir,
                dtype="float32",
                max_loras=served,
                kv_cache_memory_bytes=4 * 2**20,
                max_lora_rank=32,
            )
        )
        self._seeds = iter(range(1000))

    def seed(self) -> int:
        return next(self._seeds)

    def reference(self, made: Made):
        import transformers
        from peft import PeftModel

        if made.on_twin:
            base = transformers.AutoModelForCausalLM.from_pretrained(
                self.twin_dir, dtype=torch.float32
            )
        else:
            base = copy.deepcopy(self.base)
        return PeftModel.from_pretrained(base, made.peft).eval()

    def close(self) -> None:
        self.engine.close()
        self.registry.close()


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """arch -> World, each built when its first case runs."""
    built: dict[str, World] = {}

    def get(arch: str) -> World:
        if arch not in built:
            built[arch] = World(arch, tmp_path_factory.mktemp(f"zoo-{arch}"))
        return built[arch]

    yield get
    for world in built.values():
        world.close()


def test_the_zoo_covers_twenty_adapters_on_six_architectures():
    assert len(CASES) >= 20
    assert {c.arch for c in CASES} >= {"llama", "qwen2", "qwen3", "mistral", "phi3", "qwen3_moe"}


@torch.no_grad()
def _hf(model, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """HF + PEFT's logprobs over the prompt and its greedy tokens."""
    ids = torch.tensor([prompt])
    logprobs = torch.log_softmax(model(ids).logits[0], dim=-1)
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    return logprobs, model.generate(input_ids=ids, **kwargs)[0, len(prompt) :].tolist()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.arch}-{c.name}" for c in CASES])
def test_each_adapter_is_served_as_its_trainer_serves_it_or_refused_in_one_line(
    worlds, case, tmp_path
):
    world = worlds(case.arch)
    made = case.make(world, tmp_path / case.name)
    if case.refused is not None:
        with pytest.raises(AdapterRejected) as refused:
            world.registry.add_revision(made.src, case.name)
        assert case.refused in str(refused.value) and "\n" not in str(refused.value)
        return
    revision = world.registry.add_revision(made.src, case.name)
    ref = world.engine.adapter_ref(case.name, world.registry.store.path(revision.digest))
    reference = world.reference(made)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for prompt in PROMPTS:
        expected, greedy = _hf(reference, prompt)
        base, _ = _hf(world.base, prompt)  # the split twin computes the fused base's function
        got = torch.log_softmax(world.engine.score([prompt], [ref])[0], dim=-1)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert (expected - base).abs().max() > 1e-2, "the adapter changes the output"
        assert world.engine.generate([prompt], params, [ref])[0] == greedy
