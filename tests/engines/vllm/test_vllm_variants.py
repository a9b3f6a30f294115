"""The LoRA variants vLLM cannot serve are refused by the vLLM engine in one line naming the feature
and the engine that serves it: `serve --engine vllm --lora-modules` stops before anything is
registered. The rules are checked against the installed vLLM's own."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tinymodels import make_adapter, make_model

from loraplex.engines.vllm.support import HEAD_LORA_ARCHITECTURES, ServabilityCheck

REFUSED = {
    "dora": (dict(target_modules=["q_proj", "v_proj"], use_dora=True), "use_dora: DoRA"),
    "saved-lm-head": (
        dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
        "modules_to_save: full lm_head weights (modules_to_save) are not served by the vLLM",
    ),
    "tokens": (
        dict(target_modules=["q_proj"], trainable_token_indices=[3, 4]),
        "trainable_token_indices: trainable tokens are not served by the vLLM engine",
    ),
}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-variants")
    return {kind: make_model(root / kind, kind) for kind in ("llama", "qwen2")}


def test_serve_on_vllm_refuses_what_vllm_cannot_serve_before_registering_it(bases, tmp_path):
    llama, qwen2 = bases["llama"], bases["qwen2"]
    cases = {
        name: (llama, make_adapter(llama, tmp_path / name, r=4, lora_alpha=8, **args), expected)
        for name, (args, expected) in REFUSED.items()
    }
    head = make_adapter(qwen2, tmp_path / "head", r=4, lora_alpha=8, target_modules=["lm_head"])
    cases["qwen2-lm-head"] = (qwen2, head, "LoRA on lm_head is not served by the vLLM engine")
    procs = {
        name: subprocess.Popen(
            [
                *(sys.executable, "-m", "loraplex.cli", "serve", "--engine", "vllm"),
                *("--model", model, "--port", "0", "--data-dir", tmp_path / f"data-{name}"),
                *("--lora-modules", f"{name}={src}"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (model, src, _) in cases.items()
    }
    for name, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        lines = stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (name, stderr[-800:])
        assert lines[0].startswith(f"error: --lora-modules {name}: "), lines[0]
        assert cases[name][2] in lines[0] and "serve --engine native" in lines[0], lines[0]
        assert not list((tmp_path / f"data-{name}").rglob("*.safetensors")), f"{name} was stored"


def test_lora_on_lm_head_and_embeddings_passes_on_a_llama_base(bases, tmp_path):
    llama = bases["llama"]
    src = make_adapter(
        llama, tmp_path / "heads", r=4, lora_alpha=8, target_modules=["lm_head", "embed_tokens"]
    )
    ServabilityCheck(llama, 8).check_source(src)  # raises when refused


def test_the_rules_are_the_installed_vllms():
    """vLLM's own adapter check refuses DoRA and full lm_head weights, and its models put a LoRA on
    lm_head and embed_tokens for exactly the architectures the check lets through."""
    pytest.importorskip("vllm")
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.model_executor.models import llama, mistral, qwen2, qwen3

    common = dict(r=4, lora_alpha=8, target_modules=["q_proj"])
    assert PEFTHelper(**common, use_dora=True)._validate_features()
    assert PEFTHelper(**common, modules_to_save=["lm_head"])._validate_features()
    assert not PEFTHelper(**common)._validate_features()
    models = {
        "LlamaForCausalLM": llama.LlamaForCausalLM,
        "MistralForCausalLM": mistral.MistralForCausalLM,
        "Qwen2ForCausalLM": qwen2.Qwen2ForCausalLM,
        "Qwen3ForCausalLM": qwen3.Qwen3ForCausalLM,
    }
    with_heads = {
        name
        for name, cls in models.items()
        if {"lm_head", "embed_tokens"} <= set(getattr(cls, "embedding_modules", {}))
    }
    assert with_heads == HEAD_LORA_ARCHITECTURES
