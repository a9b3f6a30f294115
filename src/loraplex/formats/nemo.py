"""NeMo's LoRA, as a `.nemo` archive holds it: `model_config.yaml` (the `peft.lora_tuning` section:
`adapter_dim`, `alpha`) and the adapter's state dict, `model_weights.ckpt`, re-saved as
`model_weights.safetensors`. Megatron's names, as NeMo's `convert_nemo_to_canonical.py` script
reads them: `model.decoder.layers.N.self_attention.adapter_layer.lora_kqv_adapter.linear_in.weight`
(A [r, in]) and `….linear_out.weight` (B [out, r]) on the fused `linear_qkv`,
`lora_dense_attention_adapter` on `linear_proj`, `lora_hto4h_adapter` on `linear_fc1` (gate's rows,
then up's), `lora_4htoh_adapter` on `linear_fc2`; the `canonical` variant has one adapter per part
(`lora_unfused_kqv_adapter.q_adapter`, …). Megatron's `linear_qkv` output rows are grouped by query
group (each group's q heads, then its k head, then its v head), so the fused B's rows are put in
HF's order (all q's, all k's, all v's), as NeMo's `_export_qkv` does."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from loraplex.formats.draft import Draft, Piece, add_piece
from loraplex.lora_format import AdapterRejected
from loraplex.model_config import ModelConfig

NEMO_CONFIG = "model_config.yaml"
NEMO_WEIGHTS = "model_weights.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(
    r"^(?:model\.)?(?:module\.)?decoder\.layers\.(\d+)\.(?:self_attention|mlp)\.adapter_layer\."
    r"([\w.]+)\.linear_(in|out)\.weight$"
)
# NeMo's adapter names to the HF modules they are the LoRA of
MODULES = {
    "lora_kqv_adapter": "self_attn.qkv_proj",
    "lora_dense_attention_adapter": "self_attn.o_proj",
    "lora_hto4h_adapter": "mlp.gate_up_proj",
    "lora_4htoh_adapter": "mlp.down_proj",
    "lora_unfused_kqv_adapter.q_adapter": "self_attn.q_proj",
    "lora_unfused_kqv_adapter.k_adapter": "self_attn.k_proj",
    "lora_unfused_kqv_adapter.v_adapter": "self_attn.v_proj",
    "lora_unfused_hto4h_adapter.gate_adapter": "mlp.gate_proj",
    "lora_unfused_hto4h_adapter.up_adapter": "mlp.up_proj",
}


def nemo_draft(src: Path, header: dict, model: ModelConfig) -> Draft:
    """The NeMo adapter as PEFT's: keys renamed (the fused modules keep their fused HF names, so
    the base's layout decides whether they are split), `linear_qkv`'s B rows in HF's order."""
    lora = _lora_config(src / NEMO_CONFIG, model)
    order = _hf_qkv_rows(model)
    pieces: dict = {}
    for key in header:
        match = _KEY.fullmatch(key)
        if match is None or match[2] not in MODULES:
            raise AdapterRejected("weights", f"{key} is not a NeMo LoRA tensor")
        module = MODULES[match[2]]
        side = "A" if match[3] == "in" else "B"
        piece = Piece(key, order=order if module.endswith("qkv_proj") and side == "B" else None)
        add_piece(pieces, f"{PREFIX}model.layers.{match[1]}.{module}.lora_{side}.weight", piece)
    modules = sorted({MODULES[m[2]].split(".")[1] for k in header if (m := _KEY.fullmatch(k))})
    layers = sorted({int(m[1]) for k in header if (m := _KEY.fullmatch(k))})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": lora["adapter_dim"],
        "lora_alpha": lora["alpha"],
        "target_modules": modules,
        "layers_to_transform": layers,
        "bias": "none",
        "use_rslora": False,
    }
    changes = [
        "keys: NeMo names (….adapter_layer.lora_kqv_adapter.linear_in.weight, …) to PEFT's "
        "(base_model.model.model.layers.N.self_attn.qkv_proj.lora_A.weight, …)",
        f"config: peft.lora_tuning adapter_dim {lora['adapter_dim']}, alpha {lora['alpha']} to "
        f"r, lora_alpha",
    ]
    if any(p.order for p in pieces.values()):
        changes.append("weights: linear_qkv B rows from Megatron's query-group order to q, k, v")
    return Draft("nemo", src / NEMO_WEIGHTS, header, config, pieces, changes)


def _lora_config(path: Path, model: ModelConfig) -> dict:
    """`peft.lora_tuning` of NeMo's model config, with `alpha` given; AdapterRejected for what the
    import does not read (tensor or pipeline parallel shards, tied adapters) or a model shape that
    is not the base's."""
    try:
        cfg = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise AdapterRejected("config", f"{NEMO_CONFIG} is not valid YAML ({exc})") from None
    peft = cfg.get("peft") if isinstance(cfg, dict) else None
    lora = peft.get("lora_tuning") if isinstance(peft, dict) else None
    scheme = str(peft.get("peft_scheme", "lora")) if isinstance(peft, dict) else ""
    if not isinstance(lora, dict) or "lora" not in scheme:
        raise AdapterRejected("config", f"{NEMO_CONFIG} has no peft.lora_tuning (not a NeMo LoRA)")
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        if cfg.get(name, 1) != 1:
            raise AdapterRejected(
                name, f"{cfg[name]}: a NeMo adapter saved in shards is not read; merge it to one"
            )
    if lora.get("weight_tying"):
        raise AdapterRejected("weight_tying", "NeMo adapters tied across layers are not supported")
    dim = lora.get("adapter_dim")
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise AdapterRejected("adapter_dim", f"{dim!r} is not a positive integer")
    heads = cfg.get("num_attention_heads")
    shape = (heads, cfg.get("num_query_groups") or heads, cfg.get("kv_channels"))
    base = (model.num_heads, model.num_kv_heads, model.head_dim)
    if shape[:2] != base[:2] or shape[2] not in (None, model.head_dim):
        raise AdapterRejected(
            "model_config",
            f"NeMo's heads, query groups and kv channels {shape} are not the base's {base}",
        )
    return {"adapter_dim": dim, "alpha": lora.get("alpha") or dim}


def _hf_qkv_rows(model: ModelConfig) -> tuple[int, ...]:
    """HF's fused q, k, v row order as rows of Megatron's `linear_qkv`, whose heads (of
    `head_dim` rows each) come by query group: the group's q heads, its k head, its v head."""
    per_group = model.num_heads // model.num_kv_heads
    stride = per_group + 2
    q = [g * stride + j for g in range(model.num_kv_heads) for j in range(per_group)]
    k = [g * stride + per_group for g in range(model.num_kv_heads)]
    v = [g * stride + per_group + 1 for g in range(model.num_kv_heads)]
    d = model.head_dim
    return tuple(head * d + i for head in q + k + v for i in range(d))
