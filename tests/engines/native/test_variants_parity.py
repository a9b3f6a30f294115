"""The LoRA variants trainers make (LoRA on lm_head and embed_tokens, modules_to_save, trainable
tokens, DoRA), imported and served by the native engine, against HF transformers + PEFT: logits
and greedy tokens, alone and in mixed batches, and the bytes the residency counts."""

from __future__ import annotations

import pytest
import torch
from tinymodels import make_adapter, make_model

from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams
from loraplex.formats import import_adapter
from loraplex.model_config import ModelConfig

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "plain": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "lm-head": dict(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]),
    "lm-head-only": dict(r=8, lora_alpha=4, target_modules=["lm_head"]),
    "embed": dict(r=4, lora_alpha=12, target_modules=["embed_tokens", "v_proj"]),
    "saved-heads": dict(
        r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head", "embed_tokens"]
    ),
    "tokens": dict(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[5, 20]),
    "dora": dict(r=8, lora_alpha=16, target_modules=ALL_LINEAR, use_dora=True),
    "dora-rslora": dict(
        r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "down_proj"], use_dora=True
    ),
}
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12],
    [20, 21, 22, 5],
    [30, 31, 20, 33, 34],
    [40, 41, 42, 43, 5, 20],
]
# llama: untied; tied: lm_head is the embedding (trainable tokens change both); qwen2: biases on
# q/k/v (DoRA leaves the bias out of its scale)
MODELS = {
    "llama": dict(kind="llama"),
    "llama-tied": dict(kind="llama", tie_word_embeddings=True),
    "qwen2": dict(kind="qwen2"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def world(request, tmp_path_factory):
    import transformers
    from peft import PeftModel

    spec = dict(MODELS[request.param])
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_model(root / "model", spec.pop("kind"), **spec)
    config = ModelConfig.from_dir(model_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sources, served, references = {}, {}, {}
    for i, (name, args) in enumerate(ADAPTERS.items()):
        sources[name] = make_adapter(model_dir, root / "peft" / name, seed=i, base=base, **args)
        served[name] = import_adapter(sources[name], config, root / "canonical" / name).path
        fresh = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        references[name] = PeftModel.from_pretrained(fresh, sources[name]).eval()
    references[None] = base.eval()
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            dtype="float32",
            max_loras=len(ADAPTERS),
            kv_cache_memory_bytes=4 * 2**20,
            max_lora_rank=16,
        )
    )
    refs = {name: engine.adapter_ref(name, path) for name, path in served.items()}
    yield engine, refs, references, config
    engine.close()


@torch.no_grad()
def peft_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0]


@torch.no_grad()
def peft_greedy(model, prompt: list[int], n: int) -> list[int]:
    kwargs = dict(max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = model.generate(input_ids=torch.tensor([prompt]), **kwargs)
    return out[0, len(prompt) :].tolist()


def test_each_variant_alone_matches_peft_and_changes_the_output(world):
    engine, refs, references, _ = world
    for name, ref in refs.items():
        for prompt in PROMPTS:
            logits = engine.score([prompt], [ref])[0]
            expected = peft_logits(references[name], prompt)
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0, msg=name)
            base = peft_logits(references[None], prompt)
            assert (expected - base).abs().max() > 1e-2, f"{name} does not change the output"


def test_mixed_batch_of_every_variant_beside_base_rows_matches_peft(world):
    engine, refs, references, _ = world
    names = [None, *refs, None, "lm-head", "dora", "plain"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    ours = engine.score(prompts, [refs[n] if n else None for n in names])
    for prompt, name, logits in zip(prompts, names, ours):
        expected = peft_logits(references[name], prompt)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0, msg=f"adapter {name}")


def test_concurrent_greedy_generation_matches_peft_token_for_token(world):
    engine, refs, references, _ = world
    names = [*refs, None, "tokens", "embed"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = engine.generate(prompts, params, [refs[n] if n else None for n in names])
    for prompt, name, got in zip(prompts, names, outputs):
        assert got == peft_greedy(references[name], prompt, 8), f"adapter {name}"


def test_the_residency_counts_every_byte_of_the_variants(world):
    """What the cache charges an adapter is its host copy: the lm_head LoRA and the full weights
    included, in the serving dtype."""
    engine, refs, _, config = world
    engine.score([PROMPTS[0]] * len(refs), list(refs.values()))
    vocab, hidden = config.vocab_size, config.hidden_size
    sizes = {name: engine.adapters.nbytes_of(ref.key) for name, ref in refs.items()}
    for name, ref in refs.items():
        spec = engine.validate_adapter(ref.path)
        assert sizes[name] == spec.elements * 4, name  # float32
    assert sizes["saved-heads"] > 2 * vocab * hidden * 4
    assert sizes["lm-head-only"] == 8 * (vocab + hidden) * 4
