"""The LoRA variants vLLM cannot serve are refused by the vLLM engine in one line naming the feature
and the engine that serves it: `serve --engine vllm --lora-modules` stops before anything is
registered. The rules are checked against the installed vLLM's own."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import vllm_serve
from tinymodels import make_adapter, make_model, peft_reference, reference_greedy

from loraplex.engines.vllm.support import HEAD_LORA_ARCHITECTURES, ServabilityCheck

KEY = "alice-key-0123456789"
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
    from vllm.model_executor.models import llama, mistral, phi3, qwen2, qwen3

    common = dict(r=4, lora_alpha=8, target_modules=["q_proj"])
    assert PEFTHelper(**common, use_dora=True)._validate_features()
    assert PEFTHelper(**common, modules_to_save=["lm_head"])._validate_features()
    assert not PEFTHelper(**common)._validate_features()
    models = {
        "LlamaForCausalLM": llama.LlamaForCausalLM,
        "MistralForCausalLM": mistral.MistralForCausalLM,
        "Phi3ForCausalLM": phi3.Phi3ForCausalLM,
        "Qwen2ForCausalLM": qwen2.Qwen2ForCausalLM,
        "Qwen3ForCausalLM": qwen3.Qwen3ForCausalLM,
    }
    with_heads = {
        name
        for name, cls in models.items()
        if {"lm_head", "embed_tokens"} <= set(getattr(cls, "embedding_modules", {}))
    }
    assert with_heads == HEAD_LORA_ARCHITECTURES


def test_a_registered_dora_revision_is_refused_at_its_request_and_head_loras_are_served(tmp_path):
    """On a running vLLM engine: a DoRA revision registered through the registry (which knows no
    engine) is refused at its request in one line, before it reaches vLLM; LoRA on lm_head and on
    embed_tokens, which vLLM serves for Llama, give HF + PEFT's greedy tokens."""
    pytest.importorskip("vllm")
    model, made = vllm_serve.make_world(
        tmp_path,
        {
            "lm-head": dict(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]),
            "embed": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "v_proj"]),
            "dora": dict(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True),
        },
    )
    registry = [sys.executable, "-m", "loraplex.registry.cli", "--data-dir", tmp_path / "data"]
    subprocess.run(list(map(str, [*registry, "init"])), check=True, capture_output=True)
    add = [*registry, "add", made["dora"], "--name", "dora-chat", "--base-model", model]
    subprocess.run(list(map(str, [*add, "--stable"])), check=True, capture_output=True)
    (tmp_path / "keys.txt").write_text(f"alice {KEY}\n")
    args = [
        *(sys.executable, "-m", "loraplex.cli", "serve", "--engine", "vllm"),
        *("--model", model, "--port", "0", "--data-dir", tmp_path / "data"),
        *("--api-keys", tmp_path / "keys.txt", "--allowed-roots", tmp_path, "--dtype", "float32"),
        *("--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "8"),
        "--vllm-arg=--max-model-len=128",
        *("--lora-modules", f"lm-head={made['lm-head']}", f"embed={made['embed']}"),
    ]
    proc, url = vllm_serve.start(args, tmp_path)
    try:
        r = httpx.post(
            f"{url}/v1/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": "dora-chat", "prompt": [5, 6, 7], "max_tokens": 2},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "adapter_not_servable" and "\n" not in error["message"]
        assert error["message"] == (
            "dora-chat: use_dora: DoRA is not served by the vLLM engine; the native engine "
            "(serve --engine native) serves it"
        )
        reference = peft_reference(model, {n: made[n] for n in ("lm-head", "embed")})
        for name in ("lm-head", "embed"):
            for prompt in ([5, 17, 42, 99, 7], [3, 8, 13, 21]):
                _, got = vllm_serve.greedy_ids(url, KEY, name, prompt, 8)
                assert got == reference_greedy(reference, prompt, name, 8), name
    finally:
        vllm_serve.stop(proc)
