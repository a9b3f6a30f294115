"""`serve --engine vllm --lora-modules` with adapters in MLX-LM, prefix-less PEFT and fused layouts:
greedy tokens equal HF transformers + PEFT's for the adapters they were made from."""

from __future__ import annotations

import sys

import pytest
import vllm_serve
from adapter_layouts import GROUPS, fused, shared_a, to_mlx, without_prefix
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
        # one request at a time: only adapter rows, each alone in its batch
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
