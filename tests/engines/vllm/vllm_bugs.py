"""Reproductions of two vLLM LoRA bugs against vLLM alone (its offline `LLM`, no loraplex code in
the process but the plugin vLLM loads itself). Run as a script by test_vllm_patches.py, once
with loraplex's plugin left out (VLLM_PLUGINS="") and once with it; writes its findings as
JSON to REPORT (vLLM's processes share its stdout).

    python vllm_bugs.py REPORT MODEL_DIR ADAPTER_A ADAPTER_B ADAPTER_C

- mixed_batch: greedy outputs of a base prompt, and of adapters A and B, each alone; then the
  three in one batch (max_loras 2, so both slots hold an adapter). Reports whether the base row
  of the batch came out as it does alone.
- pinned_slots: A pinned (`pin_lora`), then B and C in one batch: two unpinned adapters for the
  one unpinned slot. Reports the outputs against each alone, or the error vLLM raised.
"""

from __future__ import annotations

import json
import sys


def greedy(llm, prompts, loras, n=8):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def main(model: str, a: str, b: str, c: str) -> dict:
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    llm = LLM(
        model=model,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=4,
        max_lora_rank=8,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        seed=0,
    )
    lora = {
        n: LoRARequest(n, i + 1, p) for i, (n, p) in enumerate({"a": a, "b": b, "c": c}.items())
    }
    prompt = [5, 17, 42, 99, 7]
    alone = {n: greedy(llm, [prompt], [lora.get(n)])[0] for n in ("base", "a", "b", "c")}
    batch = greedy(llm, [prompt] * 3, [None, lora["a"], lora["b"]])
    report = {
        "alone": alone,
        "mixed_batch": {
            "base_row": batch[0],
            "base_row_as_alone": batch[0] == alone["base"],
            "adapter_rows_as_alone": batch[1:] == [alone["a"], alone["b"]],
        },
    }
    engine = llm.llm_engine
    engine.pin_lora(lora["a"].lora_int_id)
    try:
        rows = greedy(llm, [prompt] * 2, [lora["b"], lora["c"]])
        report["pinned_slots"] = {"as_alone": rows == [alone["b"], alone["c"]], "error": None}
    except Exception as exc:  # the engine core fails; the error is the finding
        report["pinned_slots"] = {"as_alone": False, "error": f"{type(exc).__name__}: {exc}"}
    return report


if __name__ == "__main__":
    report = main(*sys.argv[2:6])
    with open(sys.argv[1], "w") as out:
        json.dump(report, out)
