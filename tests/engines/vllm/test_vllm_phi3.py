"""A Phi-3 base (fused `qkv_proj` and `gate_up_proj`) on `serve --engine vllm`: an adapter on the
fused modules as PEFT writes it, and one with split names (q/k/v, gate/up) fused on import, give
HF transformers + PEFT's greedy tokens (the split one's reference: PEFT on the same model with its
projections split)."""

from __future__ import annotations

import sys

import pytest
import vllm_serve
from tinymodels import (
    make_adapter,
    make_model,
    make_split_twin,
    peft_reference,
    reference_greedy,
)

pytest.importorskip("vllm")

KEY = "alice-key-0123456789"
PROMPTS = [[5, 17, 42, 99, 7], [3, 8, 13, 21]]
TOKENS = 8
SPLIT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_fused_and_split_named_adapters_served_by_vllm_on_phi3_match_peft(tmp_path):
    # head size 64: vLLM's CPU attention refuses 16
    model = make_model(
        tmp_path / "phi3", "phi3", hidden_size=128, num_attention_heads=2, num_key_value_heads=1
    )
    twin = make_split_twin(model, tmp_path / "twin")
    fused = make_adapter(
        model,
        tmp_path / "fused",
        seed=1,
        r=8,
        lora_alpha=16,
        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    )
    # fused rank: q 4 + k 2 + v 4 and gate 4 + up 4, each part at its own scaling
    split = make_adapter(
        twin,
        tmp_path / "split",
        seed=2,
        r=4,
        lora_alpha=8,
        target_modules=SPLIT,
        rank_pattern={"k_proj": 2},
        alpha_pattern={"v_proj": 3},
    )
    (tmp_path / "keys.txt").write_text(f"alice {KEY}\n")
    args = [
        *(sys.executable, "-m", "loraplex.cli", "serve", "--engine", "vllm"),
        *("--model", model, "--port", "0"),
        *("--data-dir", tmp_path / "data", "--api-keys", tmp_path / "keys.txt"),
        *("--allowed-roots", tmp_path, "--dtype", "float32"),
        *("--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", "16"),
        "--vllm-arg=--max-model-len=128",
        *("--lora-modules", f"fused={fused}", f"split={split}"),
    ]
    proc, url = vllm_serve.start(args, tmp_path)
    try:
        got = {
            (name, tuple(p)): vllm_serve.greedy_ids(url, KEY, name, p, TOKENS, timeout=300)[1]
            for name in ("fused", "split", model.name)  # the base by its directory's name
            for p in PROMPTS
        }
    finally:
        vllm_serve.stop(proc)
    references = {"fused": peft_reference(model, {"fused": fused})}
    references["split"] = peft_reference(twin, {"split": split})
    for (name, prompt), ids in got.items():
        adapter = None if name == model.name else name
        reference = references[adapter or "fused"]
        assert ids == reference_greedy(reference, list(prompt), adapter, TOKENS), (name, prompt)
    base = {tuple(ids) for (name, _), ids in got.items() if name == model.name}
    assert base.isdisjoint(tuple(ids) for (name, _), ids in got.items() if name != model.name)
