"""torchtune's own adapter layout, as its recipes' state dict names it (`adapter_model.pt` and
`adapter_N.pt`, re-saved as safetensors): `layers.N.attn.q_proj.lora_a.weight`, `….mlp.w1.…`,
`output.lora_b.weight`, with A [r, in] and B [out, r] as PEFT's, and DoRA's `….magnitude` [out]
(torchtune's `DoRALinear` computes PEFT's DoRA: m / ‖W + s·B·A‖ ⊙ (x·Wᵀ + s·x·Aᵀ·Bᵀ), the norm
detached). For Llama and Mistral, torchtune keeps q's and k's output rows in Meta's order (each
head's rotary pairs interleaved), so their B's rows, and their magnitudes, are put back in HF's
order, as torchtune's `tune_to_peft_adapter_weights` does for B."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from loraplex.formats.draft import Draft, Piece, add_piece
from loraplex.lora_format import CONFIG_FILE, WEIGHTS_FILE, AdapterRejected
from loraplex.model_config import ModelConfig

PREFIX = "base_model.model."
_KEY = re.compile(
    r"^(?:layers\.(\d+)\.(?:attn|mlp)\.(q_proj|k_proj|v_proj|output_proj|w1|w2|w3)|(output))"
    r"\.(lora_a|lora_b|magnitude)(?:\.weight)?$"
)
# torchtune's module names to PEFT's (its convert_weights module's _TO_PEFT_TARGET_MODULES)
MODULES = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "output_proj": "self_attn.o_proj",
    "w1": "mlp.gate_proj",
    "w2": "mlp.down_proj",
    "w3": "mlp.up_proj",
    "output": "lm_head",
}
# the bases whose torchtune model applies rotary embeddings to interleaved pairs
_META_ROPE = ("llama", "mistral")


def is_torchtune(header: dict) -> bool:
    """Whether every tensor of a weights file has a torchtune adapter name."""
    return bool(header) and all(_KEY.fullmatch(key) for key in header)


def torchtune_draft(src: Path, header: dict, config: dict, model: ModelConfig) -> Draft:
    """The torchtune adapter as PEFT's: keys renamed, q's and k's B rows reordered for a base
    with Meta's rotary order, the config's target modules named as PEFT names them."""
    pieces: dict = {}
    reordered = {"lora_b": 0, "magnitude": 0}
    magnitudes = 0
    for key in header:
        match = _KEY.fullmatch(key)
        assert match is not None  # is_torchtune checked every key
        layer, name, side = match[1], match[2] or match[3], match[4]
        path = MODULES[name] if layer is None else f"model.layers.{layer}.{MODULES[name]}"
        if side == "magnitude":
            canonical = f"{PREFIX}{path}.lora_magnitude_vector"
            magnitudes += 1
        else:
            canonical = f"{PREFIX}{path}.lora_{side[-1].upper()}.weight"
        piece = Piece(key)
        if side != "lora_a" and name in ("q_proj", "k_proj") and model.model_type in _META_ROPE:
            heads = model.num_heads if name == "q_proj" else model.num_kv_heads
            piece = Piece(key, order=_hf_rows(heads, model.head_dim))
            reordered[side] += 1
        add_piece(pieces, canonical, piece)
    changes = [
        "keys: torchtune names (layers.N.attn.q_proj.lora_a.weight, …) to PEFT's "
        "(base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight, …)"
    ]
    for side, what in (("lora_b", "B's"), ("magnitude", "DoRA magnitudes")):
        if reordered[side]:
            changes.append(
                f"weights: rows of {reordered[side]} q_proj and k_proj {what} from Meta's rotary "
                "order to HF's"
            )
    if magnitudes:
        changes.append(
            f"DoRA: {magnitudes} magnitudes (torchtune's `magnitude`) as lora_magnitude_vector, "
            "use_dora set"
        )
    config = _peft_config(config, dora=magnitudes > 0)
    return Draft("torchtune", src / WEIGHTS_FILE, header, config, pieces, changes)


def _hf_rows(heads: int, head_dim: int) -> tuple[int, ...]:
    """HF row (h, i, j) of a head's [2, head_dim / 2] rotary halves is Meta's row (h, j, i)."""
    rows = np.arange(heads * head_dim).reshape(heads, head_dim // 2, 2).transpose(0, 2, 1)
    return tuple(int(r) for r in rows.reshape(-1))


def _peft_config(config: dict, dora: bool) -> dict:
    """The config with torchtune's target module names made PEFT's (torchtune writes its own names
    in the recipe's adapter config, PEFT's in the one its HF checkpointer converts), and
    `use_dora` when the adapter holds magnitudes (the recipe's config does not say it)."""
    for name in ("r", "lora_alpha"):
        if name not in config:
            raise AdapterRejected("config", f"{CONFIG_FILE} of a torchtune adapter has no {name}")
    if config.get("use_dora") and not dora:
        raise AdapterRejected(
            "use_dora", "the config says use_dora, but the adapter holds no magnitudes"
        )
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterRejected(
            "target_modules", f"{targets!r} is not a list of torchtune's module names"
        )
    peft_names = {module.rsplit(".", 1)[-1] for module in MODULES.values()}
    unknown = [t for t in targets if t not in MODULES and t not in peft_names]
    if unknown:
        raise AdapterRejected("target_modules", f"{unknown[0]!r} is not a torchtune module name")
    return {
        **config,
        **({"use_dora": True} if dora else {}),
        "peft_type": "LORA",
        "task_type": config.get("task_type", "CAUSAL_LM"),
        "target_modules": sorted(
            {MODULES[t].split(".")[-1] if t in MODULES else t for t in targets}
        ),
    }
