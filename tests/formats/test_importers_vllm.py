"""`serve --engine vllm --lora-modules` with adapters in MLX-LM, prefix-less PEFT and fused
layouts, and in torchtune's and NeMo's own layouts (converted to the canonical PEFT form on
registration): greedy tokens equal HF transformers + PEFT's for the adapters they were made from.
On a Llama, torchtune's q and k rows come in Meta's rotary order and NeMo's fused q, k, v rows by
query group, so a conversion that missed either would change the tokens."""

from __future__ import annotations

import sys

import pytest
import vllm_serve
from adapter_layouts import GROUPS, fused, shared_a, to_mlx, to_nemo, to_torchtune, without_prefix
from tinymodels import make_adapter, make_model, peft_reference, reference_greedy

pytest.importorskip("vllm")

KEY = "alice-key-0123456789"
PROMPTS = [[5, 17, 42, 99, 7], [3, 8, 13, 21]]
TOKENS = 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_imported_adapters_served_by_vllm_match_peft(tmp_path):
    # head size 64: vLLM's CPU attention refuses 16
    model = make_model(
        tmp_path / "model", "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1
    )
    made = {
        "mlp": make_adapter(
            model, tmp_path / "mlp", seed=1, r=4, lora_alpha=8, target_modules=ALL[4:]
        ),
        "pattern": make_adapter(
            model,
            tmp_path / "pattern",
            seed=2,
            r=8,
            lora_alpha=16,
            target_modules=["q_proj", "v_proj", "down_proj"],
            rank_pattern={"v_proj": 4},
            alpha_pattern={"down_proj": 3},
        ),
        "all": make_adapter(model, tmp_path / "all", seed=3, r=8, lora_alpha=8, target_modules=ALL),
    }
    made["shared"] = shared_a(made["all"], tmp_path / "shared", GROUPS)
    served = {
        "mlx": (to_mlx(made["mlp"], tmp_path / "as-mlx"), "mlp"),
        "no-prefix": (without_prefix(made["pattern"], tmp_path / "as-no-prefix"), "pattern"),
        "fused": (fused(made["shared"], tmp_path / "as-fused", GROUPS), "shared"),
    }
    reference = peft_reference(model, {n: made[n] for n in ("mlp", "pattern", "shared")})
    _served_match_peft(tmp_path, model, served, reference)


def test_torchtune_and_nemo_exports_served_by_vllm_match_peft(tmp_path):
    model, made = vllm_serve.make_world(
        tmp_path,
        {
            "tune": dict(r=8, lora_alpha=16, target_modules=ALL),
            "every": dict(r=4, lora_alpha=12, target_modules=ALL),
        },
    )
    made["fusable"] = shared_a(made["every"], tmp_path / "fusable", GROUPS)
    heads, kv = 2, 1  # make_world's Llama
    served = {
        "torchtune": (to_torchtune(made["tune"], tmp_path / "tt", heads, kv, True), "tune"),
        "nemo": (to_nemo(made["fusable"], tmp_path / "nemo", heads, kv, fused=True), "fusable"),
        "nemo-canonical": (
            to_nemo(made["every"], tmp_path / "nemo-c", heads, kv, fused=False),
            "every",
        ),
    }
    reference = peft_reference(model, {n: made[n] for n in ("tune", "fusable", "every")})
    _served_match_peft(tmp_path, model, served, reference)


def _served_match_peft(tmp_path, model, served: dict, reference) -> None:
    """`serve --engine vllm --lora-modules` the `served` adapters (name -> (its files, the PEFT
    adapter it was written from)), one request at a time so that each runs alone in its batch: each
    one's greedy tokens equal HF + PEFT's for its source, and none equal the base model's."""
    (tmp_path / "keys.txt").write_text(f"alice {KEY}\n")
    args = [
        *(sys.executable, "-m", "loraplex.cli", "serve", "--engine", "vllm"),
        *("--model", model, "--port", "0"),
        *("--data-dir", tmp_path / "data", "--api-keys", tmp_path / "keys.txt"),
        *("--allowed-roots", tmp_path, "--dtype", "float32"),
        *("--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "8"),
        "--vllm-arg=--max-model-len=128",
        "--lora-modules",
        *[f"{n}={src}" for n, (src, _) in served.items()],
    ]
    proc, url = vllm_serve.start(args, tmp_path)
    try:
        got = {
            (name, tuple(p)): vllm_serve.greedy_ids(url, KEY, name, p, TOKENS, timeout=300)[1]
            for name in served
            for p in PROMPTS
        }
    finally:
        vllm_serve.stop(proc)
    for (name, prompt), ids in got.items():
        expected = reference_greedy(reference, list(prompt), served[name][1], TOKENS)
        assert ids == expected, (name, prompt)
    base = {tuple(reference_greedy(reference, p, None, TOKENS)) for p in PROMPTS}
    assert base.isdisjoint(tuple(ids) for ids in got.values())
