"""`serve --engine vllm --lora-modules` with torchtune's and NeMo's own adapter layouts
(converted to the canonical PEFT form on registration): greedy tokens equal HF transformers +
PEFT's for the PEFT adapters they were written from. On a Llama, torchtune's q and k rows come in
Meta's rotary order and NeMo's fused q, k, v rows by query group, so a conversion that missed
either would change the tokens."""

from __future__ import annotations

import sys

import pytest
import vllm_serve
from adapter_layouts import GROUPS, shared_a, to_nemo, to_torchtune
from tinymodels import peft_reference, reference_greedy

pytest.importorskip("vllm")

KEY = "alice-key-0123456789"
PROMPTS = [[5, 17, 42, 99, 7], [3, 8, 13, 21]]
TOKENS = 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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
