"""Split parts fused for a base layout other than Phi-3's: Tinker's `in_proj_q`/`in_proj_k`/
`in_proj_v` for the fused `in_proj_qkv` of the linear-attention layers of Qwen3.5 and Qwen3-Next
(q's rows, then k's, then v's). No served architecture has that module, so the mapping is checked
here on a synthetic layout: the fused LoRA computes, row for row, what the parts compute."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from loraplex.formats.sources import read_draft
from loraplex.formats.stacked import FusedLayout, fuse_split
from loraplex.formats.tensors import read_tensors
from loraplex.lora_common import rank_and_scaling
from loraplex.lora_format import CONFIG_FILE, WEIGHTS_FILE, AdapterRejected
from loraplex.model_config import ModelConfig

HIDDEN, KEY_DIM, VALUE_DIM = 16, 8, 12
PARTS = ("in_proj_q", "in_proj_k", "in_proj_v")
SHAPES = {
    "in_proj_qkv": (HIDDEN, 2 * KEY_DIM + VALUE_DIM),
    "in_proj_q": (HIDDEN, KEY_DIM),
    "in_proj_k": (HIDDEN, KEY_DIM),
    "in_proj_v": (HIDDEN, VALUE_DIM),
}
LAYOUT = FusedLayout({"in_proj_qkv": PARTS}, SHAPES.__getitem__)
PREFIX = "base_model.model.model.layers"
BASE_RAW = {
    "vocab_size": 32,
    "hidden_size": HIDDEN,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
}
# any served base: the layout, not the base, says what is fused
BASE = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **BASE_RAW})


def _tinker_adapter(out, config: dict, ranks: dict[str, int], shared: bool = False):
    """Split LoRAs on two layers' linear attention, as Tinker exports them; with `shared`, q and k
    hold one A."""
    torch.manual_seed(0)
    tensors = {}
    for layer in (0, 1):
        a_shared = torch.randn(ranks["in_proj_q"], HIDDEN)
        for part, rank in ranks.items():
            d_in, d_out = SHAPES[part]
            key = f"{PREFIX}.{layer}.linear_attn.{part}"
            same = shared and part in ("in_proj_q", "in_proj_k")
            tensors[f"{key}.lora_A.weight"] = a_shared.clone() if same else torch.randn(rank, d_in)
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank)
    out.mkdir()
    save_file(tensors, out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", **config}))
    return out, tensors


def _delta(config: dict, path: str, a, b, x) -> np.ndarray:
    """s·x·Aᵀ·Bᵀ with the scaling PEFT reads from `config` for the module at `path`."""
    _, scaling = rank_and_scaling(config, path)
    return scaling * (x @ np.asarray(a).T) @ np.asarray(b).T


@pytest.mark.parametrize(
    "config, ranks, shared",
    [
        (dict(r=4, lora_alpha=8, target_modules=list(PARTS)), dict.fromkeys(PARTS, 4), False),
        (
            dict(
                r=4,
                lora_alpha=8,
                use_rslora=True,
                target_modules=list(PARTS),
                rank_pattern={"in_proj_k": 4, "in_proj_v": 2},
                alpha_pattern={"in_proj_v": 3},
            ),
            {"in_proj_q": 4, "in_proj_k": 4, "in_proj_v": 2},
            True,
        ),
        (
            dict(r=4, lora_alpha=16, target_modules=["in_proj_q", "in_proj_v"]),
            {"in_proj_q": 4, "in_proj_v": 4},
            False,
        ),
    ],
    ids=["plain", "patterns-shared-a", "k-left-out"],
)
def test_split_in_proj_parts_fuse_into_in_proj_qkv_exactly(tmp_path, config, ranks, shared):
    src, split = _tinker_adapter(tmp_path / "tinker", config, ranks, shared)
    draft = fuse_split(read_draft(src, BASE), BASE, LAYOUT)
    source, _ = read_tensors(draft.weights)
    x = np.random.default_rng(1).standard_normal((5, HIDDEN)).astype(np.float32)
    for layer in (0, 1):
        key = f"{PREFIX}.{layer}.linear_attn"
        assert not any(f"{key}.{p}." in k for k in draft.pieces for p in PARTS)
        a, b = (
            draft.pieces[f"{key}.in_proj_qkv.lora_{side}.weight"].made(source).float32()
            for side in "AB"
        )
        fused = _delta(draft.config, f"model.layers.{layer}.linear_attn.in_proj_qkv", a, b, x)
        rows = []
        for part in PARTS:
            if part not in ranks:
                rows.append(np.zeros((5, SHAPES[part][1]), dtype=np.float32))
                continue
            path = f"model.layers.{layer}.linear_attn.{part}"
            a_p, b_p = (split[f"{key}.{part}.lora_{s}.weight"].numpy() for s in "AB")
            rows.append(_delta(config, path, a_p, b_p, x))
        np.testing.assert_allclose(fused, np.concatenate(rows, axis=1), rtol=1e-5, atol=1e-5)
        distinct = sum(ranks.values()) - (ranks["in_proj_k"] if shared else 0)
        assert a.shape == (distinct, HIDDEN), "parts sharing an A share its rows"
    assert draft.config["target_modules"] == ["in_proj_qkv"]
    assert draft.changes[-1] == (
        f"modules: {', '.join(PARTS)} fused into in_proj_qkv (A's stacked, B's block-diagonal, "
        "each part's scaling kept) in 2 layers"
    )


def test_a_split_part_that_does_not_fit_the_layout_is_refused_in_one_line(tmp_path):
    config = dict(r=4, lora_alpha=8, target_modules=list(PARTS))
    src, split = _tinker_adapter(tmp_path / "tinker", config, dict.fromkeys(PARTS, 4))
    key = f"{PREFIX}.0.linear_attn.in_proj_v.lora_B.weight"
    split[key] = torch.randn(KEY_DIM, 4)  # v's B with k's rows
    save_file(split, src / WEIGHTS_FILE)
    with pytest.raises(AdapterRejected) as refused:
        fuse_split(read_draft(src, BASE), BASE, LAYOUT)
    assert str(refused.value) == (
        "shape: layer 0 in_proj_v: A [4, 16] and B [8, 4] do not fit the base (expected [r, 16] "
        "and [12, r])"
    )


def test_the_served_bases_layout_is_phi3s_and_none_for_a_split_base():
    assert FusedLayout.of(BASE).groups == {}
    phi3 = ModelConfig.from_dict({**BASE_RAW, "architectures": ["Phi3ForCausalLM"]})
    assert FusedLayout.of(phi3).groups == {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }
