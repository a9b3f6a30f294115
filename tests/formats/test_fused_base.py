"""A Phi-3 base (fused `qkv_proj` and `gate_up_proj`) on the native engine, against HF transformers
+ PEFT: adapters on the fused modules as PEFT writes them, and adapters with split names (q/k/v,
gate/up) fused on import, checked against PEFT running the split adapter on the same model with
its projections split (a Llama)."""

from __future__ import annotations

import json

import pytest
import torch
from adapter_layouts import GROUPS, shared_a
from safetensors.torch import load_file
from tinymodels import make_adapter, make_model, make_split_twin

from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams
from loraplex.formats import import_adapter, read_import_record
from loraplex.lora_format import WEIGHTS_FILE, AdapterRejected
from loraplex.model_config import ModelConfig, ModelConfigError

FUSED = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
SPLIT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# served on the Phi-3 base, made by PEFT on it
FUSED_ADAPTERS = {
    "fused": dict(r=8, lora_alpha=16, target_modules=FUSED),
    "fused-pattern": dict(
        r=8,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["qkv_proj", "down_proj"],
        rank_pattern={"down_proj": 4},
        alpha_pattern={"qkv_proj": 24},
    ),
    "fused-dora": dict(
        r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"], use_dora=True
    ),
    "fused-lm-head": dict(r=4, lora_alpha=8, target_modules=["gate_up_proj", "lm_head"]),
}
# made by PEFT on the split twin, imported for the Phi-3 base; each part's scaling differs
SPLIT_ADAPTERS = {
    "split": dict(
        r=8,
        lora_alpha=16,
        target_modules=SPLIT,
        rank_pattern={"k_proj": 4, "up_proj": 2},
        alpha_pattern={"v_proj": 5, "gate_proj": 3},
    ),
    "split-qv-up": dict(
        r=4, lora_alpha=6, use_rslora=True, target_modules=r".*\.(q_proj|v_proj|up_proj)"
    ),
    "split-all-linear": dict(r=4, lora_alpha=8, target_modules="all-linear"),
    "split-layer-1": dict(
        r=4, lora_alpha=8, target_modules=["k_proj", "v_proj", "gate_proj"], layers_to_transform=[1]
    ),
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 5], [30, 31, 20, 33, 34]]


def peft_model(model_dir, adapter):
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return base.eval() if adapter is None else PeftModel.from_pretrained(base, adapter).eval()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """(engine, refs, references, sources, canonical): `references` holds PEFT on the Phi-3 base
    for the fused adapters and on its split twin for the split ones."""
    root = tmp_path_factory.mktemp("phi3")
    phi3_dir = make_model(root / "phi3", "phi3")
    twin_dir = make_split_twin(phi3_dir, root / "twin")
    config = ModelConfig.from_dir(phi3_dir)
    sources = {}
    for i, (name, args) in enumerate(FUSED_ADAPTERS.items()):
        sources[name] = make_adapter(phi3_dir, root / "peft" / name, seed=i, **args)
    for i, (name, args) in enumerate(SPLIT_ADAPTERS.items()):
        sources[name] = make_adapter(twin_dir, root / "peft" / name, seed=10 + i, **args)
    every_part = make_adapter(twin_dir, root / "peft" / "r4", seed=20, r=4, target_modules=SPLIT)
    sources["shared-a"] = shared_a(every_part, root / "shared-a", GROUPS)
    canonical = {n: import_adapter(p, config, root / "canonical" / n) for n, p in sources.items()}
    references = {None: peft_model(phi3_dir, None)}
    for name, src in sources.items():
        references[name] = peft_model(phi3_dir if name in FUSED_ADAPTERS else twin_dir, src)
    engine = LLMEngine(
        EngineConfig(
            model_dir=phi3_dir,
            dtype="float32",
            max_loras=len(sources),
            kv_cache_memory_bytes=4 * 2**20,
            max_lora_rank=32,
        )
    )
    refs = {name: engine.adapter_ref(name, imported.path) for name, imported in canonical.items()}
    yield engine, refs, references, sources, canonical, phi3_dir, twin_dir
    engine.close()


@torch.no_grad()
def peft_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0]


@torch.no_grad()
def peft_greedy(model, prompt: list[int], n: int) -> list[int]:
    kwargs = dict(max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return model.generate(input_ids=torch.tensor([prompt]), **kwargs)[0, len(prompt) :].tolist()


def test_the_split_twin_is_the_same_model(world):
    _, _, references, _, _, _, twin_dir = world
    twin = peft_model(twin_dir, None)
    for prompt in PROMPTS:
        torch.testing.assert_close(
            peft_logits(twin, prompt), peft_logits(references[None], prompt), atol=1e-5, rtol=0
        )


def test_each_adapter_and_the_base_match_peft_logits(world):
    engine, refs, references, _, _, _, _ = world
    for name in [None, *refs]:
        for prompt in PROMPTS:
            logits = engine.score([prompt], [refs[name] if name else None])[0]
            expected = peft_logits(references[name], prompt)
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0, msg=str(name))
            if name is not None:
                base = peft_logits(references[None], prompt)
                assert (expected - base).abs().max() > 1e-2, f"{name} does not change the output"


def test_mixed_batch_and_concurrent_greedy_generation_match_peft(world):
    engine, refs, references, _, _, _, _ = world
    names = [None, *refs, "split", None, "fused"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    chosen = [refs[n] if n else None for n in names]
    for prompt, name, logits in zip(prompts, names, engine.score(prompts, chosen)):
        expected = peft_logits(references[name], prompt)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0, msg=str(name))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for prompt, name, got in zip(prompts, names, engine.generate(prompts, params, chosen)):
        assert got == peft_greedy(references[name], prompt, 8), f"adapter {name}"


def test_fused_adapters_are_served_as_peft_wrote_them(world):
    _, _, _, sources, canonical, _, _ = world
    for name in FUSED_ADAPTERS:
        record = canonical[name].record
        if name == "fused-lm-head":  # PEFT's copy of the base's lm_head is left out, no more
            assert record is not None and all("embedding" in c for c in record.changes)
            kept = load_file(sources[name] / WEIGHTS_FILE)
            got = load_file(canonical[name].path / WEIGHTS_FILE)
            assert got.keys() == {k for k in kept if "base_layer" not in k}
        else:
            assert record is None and canonical[name].path == sources[name]


def test_split_names_are_fused_with_the_parts_ranks_summed(world):
    _, _, _, _, canonical, _, _ = world
    tensors = load_file(canonical["split"].path / WEIGHTS_FILE)
    assert not [k for k in tensors if any(f".{p}." in k for p in ("q_proj", "gate_proj"))]
    prefix = "base_model.model.model.layers.0"
    # q 8 + k 4 + v 8 and gate 8 + up 2; each part's B block on its own rows and columns
    assert tensors[f"{prefix}.self_attn.qkv_proj.lora_A.weight"].shape == (20, 64)
    b = tensors[f"{prefix}.self_attn.qkv_proj.lora_B.weight"]
    assert b.shape == (64 + 32 + 32, 20)
    assert b[:64, 8:].abs().sum() == 0 and b[64:96, :8].abs().sum() == 0
    assert tensors[f"{prefix}.mlp.gate_up_proj.lora_A.weight"].shape == (10, 64)
    record = read_import_record(canonical["split"].path)
    assert record is not None and record.changes == (
        "modules: gate_proj, up_proj fused into gate_up_proj (A's stacked, B's block-diagonal, "
        "each part's scaling kept) in 2 layers",
        "modules: q_proj, k_proj, v_proj fused into qkv_proj (A's stacked, B's block-diagonal, "
        "each part's scaling kept) in 2 layers",
    )


def test_equal_as_are_kept_once(world):
    """Parts that share their A (a fused LoRA written with split names) keep the fused rank."""
    _, _, _, _, canonical, _, _ = world
    tensors = load_file(canonical["shared-a"].path / WEIGHTS_FILE)
    prefix = "base_model.model.model.layers.1"
    assert tensors[f"{prefix}.self_attn.qkv_proj.lora_A.weight"].shape == (4, 64)
    assert tensors[f"{prefix}.mlp.gate_up_proj.lora_A.weight"].shape == (4, 64)
    assert tensors[f"{prefix}.mlp.gate_up_proj.lora_B.weight"].shape == (256, 4)


def test_peft_itself_reads_the_fused_form_of_a_split_adapter_the_same(world):
    _, _, references, _, canonical, phi3_dir, _ = world
    for name in [*SPLIT_ADAPTERS, "shared-a"]:
        fused = peft_model(phi3_dir, canonical[name].path)
        for prompt in PROMPTS:
            torch.testing.assert_close(
                peft_logits(fused, prompt),
                peft_logits(references[name], prompt),
                atol=1e-5,
                rtol=0,
                msg=name,
            )


def test_split_dora_for_a_fused_base_is_refused_in_one_line(world, tmp_path):
    _, _, _, _, _, phi3_dir, twin_dir = world
    src = make_adapter(twin_dir, tmp_path / "dora", r=4, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(AdapterRejected) as refused:
        import_adapter(src, ModelConfig.from_dir(phi3_dir), tmp_path / "out")
    assert str(refused.value) == (
        "use_dora: layer 0 q_proj: DoRA on split projections is not converted for a base with a "
        "fused qkv_proj"
    )


def test_a_split_part_the_config_does_not_select_is_refused(world, tmp_path):
    _, _, _, sources, _, phi3_dir, _ = world
    src = tmp_path / "unselected"
    src.mkdir()
    for path in sources["split-layer-1"].iterdir():
        (src / path.name).write_bytes(path.read_bytes())
    config = json.loads((src / "adapter_config.json").read_text())
    config["layers_to_transform"] = [0]
    (src / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterRejected, match="layer 1 gate_proj has weights, but the config"):
        import_adapter(src, ModelConfig.from_dir(phi3_dir), tmp_path / "out")


def test_a_phi3_with_a_sliding_window_matches_peft(tmp_path):
    """Phi-3 attends within `sliding_window` in every layer, as transformers does."""
    model_dir = make_model(tmp_path / "phi3", "phi3", sliding_window=4)
    src = make_adapter(model_dir, tmp_path / "fused", r=4, lora_alpha=8, target_modules=FUSED)
    reference = peft_model(model_dir, src)
    engine = LLMEngine(
        EngineConfig(model_dir=model_dir, dtype="float32", kv_cache_memory_bytes=4 * 2**20)
    )
    try:
        ref = engine.adapter_ref("fused", src)
        for prompt in PROMPTS:
            logits = engine.score([prompt], [ref])[0]
            torch.testing.assert_close(logits, peft_logits(reference, prompt), atol=1e-4, rtol=0)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        assert engine.generate([PROMPTS[0]], params, [ref])[0] == peft_greedy(
            reference, PROMPTS[0], 8
        )
    finally:
        engine.close()


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"partial_rotary_factor": 0.75}, "unsupported partial_rotary_factor 0.75; only 1.0"),
        ({"rope_type": "longrope", "short_factor": [1.0]}, "unsupported rope_type 'longrope'"),
    ],
)
def test_phi3_rope_variants_we_do_not_compute_are_refused(tmp_path, rope, message):
    raw = json.loads((make_model(tmp_path / "phi3", "phi3") / "config.json").read_text())
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_dict({**raw, "rope_parameters": {**raw["rope_parameters"], **rope}})


def test_a_fused_adapter_for_the_split_twin_is_split_exactly(world, tmp_path):
    """The converse: a LoRA trained on the fused modules (any B, not block-structured), imported
    for the split base, gives PEFT's logits of the fused one; `all-linear` saves whole paths."""
    _, _, _, _, _, phi3_dir, twin_dir = world
    src = make_adapter(phi3_dir, tmp_path / "fused", seed=7, r=4, target_modules="all-linear")
    imported = import_adapter(src, ModelConfig.from_dir(twin_dir), tmp_path / "split")
    assert not [k for k in load_file(imported.path / WEIGHTS_FILE) if "qkv_proj" in k]
    split, fused = peft_model(twin_dir, imported.path), peft_model(phi3_dir, src)
    for prompt in PROMPTS:
        torch.testing.assert_close(
            peft_logits(split, prompt), peft_logits(fused, prompt), atol=1e-5, rtol=0
        )
