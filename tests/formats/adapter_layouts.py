"""Adapters re-saved in the layouts other trainers write (from PEFT adapters, so that HF
transformers + PEFT on the original is the reference for the imported one)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from loraplex.lora_format import CONFIG_FILE, WEIGHTS_FILE

PREFIX = "base_model.model."


def to_mlx(peft_dir: Path, out: Path) -> Path:
    """The PEFT adapter re-saved as MLX-LM saves one: `adapters.safetensors` with A [in, r] and B
    [r, out] under the model's own module paths, `lora_parameters` holding rank and scale."""
    config = json.loads((peft_dir / CONFIG_FILE).read_text())
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = {
        key.removeprefix(PREFIX)
        .replace(".lora_A.weight", ".lora_a")
        .replace(".lora_B.weight", ".lora_b"): t.T.contiguous()
        for key, t in load_file(peft_dir / WEIGHTS_FILE).items()
    }
    out.mkdir(parents=True)
    save_file(tensors, out / "adapters.safetensors", metadata={"format": "mlx"})
    mlx_config = {
        "model": config["base_model_name_or_path"],
        "fine_tune_type": "lora",
        "num_layers": 2,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0},
    }
    (out / CONFIG_FILE).write_text(json.dumps(mlx_config))
    return out


def without_prefix(peft_dir: Path, out: Path) -> Path:
    """The PEFT adapter with keys as some trainers export them: `model.layers.…` and the adapter
    name `.default.` left in."""
    shutil.copytree(peft_dir, out)
    tensors = {
        key.removeprefix(PREFIX).replace(".weight", ".default.weight"): t
        for key, t in load_file(peft_dir / WEIGHTS_FILE).items()
    }
    save_file(tensors, out / WEIGHTS_FILE)
    return out


def shared_a(peft_dir: Path, out: Path, groups: dict[str, tuple[str, ...]]) -> Path:
    """The PEFT adapter with each group's parts given the first part's A (what a LoRA on the fused
    module computes)."""
    shutil.copytree(peft_dir, out)
    tensors = load_file(peft_dir / WEIGHTS_FILE)
    for parts in groups.values():
        for key in [k for k in tensors if f".{parts[0]}.lora_A" in k]:
            for part in parts[1:]:
                tensors[key.replace(parts[0], part)] = tensors[key].clone()
    save_file(tensors, out / WEIGHTS_FILE)
    return out


def fused(peft_dir: Path, out: Path, groups: dict[str, tuple[str, ...]]) -> Path:
    """A shared-A PEFT adapter written with fused modules: one A, the parts' B stacked by rows."""
    out.mkdir(parents=True)
    tensors = load_file(peft_dir / WEIGHTS_FILE)
    for name, parts in groups.items():
        for key_a in [k for k in tensors if f".{parts[0]}.lora_A" in k]:
            key_bs = [key_a.replace(parts[0], p).replace("lora_A", "lora_B") for p in parts]
            tensors[key_a.replace(parts[0], name)] = tensors[key_a]
            tensors[key_a.replace(parts[0], name).replace("lora_A", "lora_B")] = torch.cat(
                [tensors[k] for k in key_bs]
            )
            for part, key_b in zip(parts, key_bs, strict=True):
                del tensors[key_a.replace(parts[0], part)], tensors[key_b]
    save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})
    config = json.loads((peft_dir / CONFIG_FILE).read_text())
    named = {p for parts in groups.values() for p in parts}
    config["target_modules"] = sorted(
        {m for m in config["target_modules"] if m not in named} | set(groups)
    )
    (out / CONFIG_FILE).write_text(json.dumps(config))
    return out


GROUPS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# PEFT's module paths to torchtune's (torchtune/models/convert_weights.py: _FROM_HF and
# _TO_PEFT_TARGET_MODULES)
TORCHTUNE_MODULES = {
    "self_attn.q_proj": "attn.q_proj",
    "self_attn.k_proj": "attn.k_proj",
    "self_attn.v_proj": "attn.v_proj",
    "self_attn.o_proj": "attn.output_proj",
    "mlp.gate_proj": "mlp.w1",
    "mlp.down_proj": "mlp.w2",
    "mlp.up_proj": "mlp.w3",
}


def to_torchtune(peft_dir: Path, out: Path, heads: int, kv_heads: int, meta_rope: bool) -> Path:
    """The PEFT adapter as torchtune's recipes save it (its state dict names, DoRA's magnitudes as
    `….magnitude`; q's and k's B rows and magnitudes in Meta's rotary order for a Llama, the
    inverse of `_permute_lora_matrix` in torchtune/models/convert_weights.py), re-saved as
    safetensors, with the adapter config the recipe writes (`r`, `lora_alpha`, torchtune's
    `target_modules`, `peft_type`; no `use_dora`)."""
    config = json.loads((peft_dir / CONFIG_FILE).read_text())
    tensors = {}
    for key, t in load_file(peft_dir / WEIGHTS_FILE).items():
        if ".base_layer." in key:  # PEFT's copy of the base's lm_head: torchtune saves none
            continue
        name = (
            key.removeprefix(PREFIX)
            .replace(".lora_A.", ".lora_a.")
            .replace(".lora_B.", ".lora_b.")
            .replace(".lora_magnitude_vector", ".magnitude")  # DoRALinear's parameter
        )
        if name.startswith("lm_head."):
            name = name.replace("lm_head.", "output.")
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            block, proj, side = rest.split(".", 2)  # side: lora_a.weight, …, magnitude
            module = f"{block}.{proj}"
            name = f"layers.{layer}.{TORCHTUNE_MODULES[module]}.{side}"
            n = heads if module.endswith("q_proj") else kv_heads
            if meta_rope and side.startswith("lora_b") and module[-6:] in ("q_proj", "k_proj"):
                rank = t.shape[1]
                t = t.view(n, 2, t.shape[0] // n // 2, rank).transpose(1, 2).reshape(-1, rank)
            if meta_rope and side == "magnitude" and module[-6:] in ("q_proj", "k_proj"):
                t = t.view(n, 2, t.shape[0] // n // 2).transpose(1, 2).reshape(-1)
        tensors[name] = t.contiguous()
    out.mkdir(parents=True)
    save_file(tensors, out / WEIGHTS_FILE)
    short = {m.rsplit(".", 1)[-1]: t.rsplit(".", 1)[-1] for m, t in TORCHTUNE_MODULES.items()}
    targets = [short.get(m, "output" if m == "lm_head" else m) for m in config["target_modules"]]
    tune_config = {
        "r": config["r"],
        "lora_alpha": config["lora_alpha"],
        "target_modules": targets,
        "peft_type": "LORA",
    }
    (out / CONFIG_FILE).write_text(json.dumps(tune_config))
    return out


# PEFT's module paths to NeMo's adapters (NeMo's scripts/checkpoint_converters/lora_converters/
# convert_nemo_to_canonical.py); q, k, v and gate, up are fused in NeMo's `nemo` variant
NEMO_MODULES = {
    "self_attn.o_proj": "self_attention.adapter_layer.lora_dense_attention_adapter",
    "mlp.down_proj": "mlp.adapter_layer.lora_4htoh_adapter",
    "self_attn.q_proj": "self_attention.adapter_layer.lora_unfused_kqv_adapter.q_adapter",
    "self_attn.k_proj": "self_attention.adapter_layer.lora_unfused_kqv_adapter.k_adapter",
    "self_attn.v_proj": "self_attention.adapter_layer.lora_unfused_kqv_adapter.v_adapter",
    "mlp.gate_proj": "mlp.adapter_layer.lora_unfused_hto4h_adapter.gate_adapter",
    "mlp.up_proj": "mlp.adapter_layer.lora_unfused_hto4h_adapter.up_adapter",
}


def to_nemo(peft_dir: Path, out: Path, heads: int, kv_heads: int, fused: bool) -> Path:
    """The PEFT adapter as a NeMo LoRA (`.nemo` archive members, the weights re-saved as
    safetensors): `model_config.yaml` and `model_weights.safetensors` under Megatron's names. With
    `fused` (NeMo's default `nemo` variant; the parts must share their A), q, k, v are one
    `lora_kqv_adapter` whose B rows come by query group (NeMo's `_import_qkv` order in
    nemo/collections/llm/gpt/model/llama.py) and gate, up one `lora_hto4h_adapter`."""
    config = json.loads((peft_dir / CONFIG_FILE).read_text())
    tensors = load_file(peft_dir / WEIGHTS_FILE)
    layers = sorted({int(k.split(".")[4]) for k in tensors})
    nemo = {}
    for layer in layers:
        lora = {
            (m, side): tensors[k]
            for m in NEMO_MODULES
            for side in "AB"
            if (k := f"{PREFIX}model.layers.{layer}.{m}.lora_{side}.weight") in tensors
        }
        pairs = {NEMO_MODULES[m]: (lora[m, "A"], lora[m, "B"]) for m, side in lora if side == "A"}
        if fused:
            pairs = {a: p for a, p in pairs.items() if "unfused" not in a}
            pairs.update(_fused_pairs(lora, heads, kv_heads))
        for adapter, (a, b) in pairs.items():
            head = f"model.decoder.layers.{layer}.{adapter}"
            nemo[f"{head}.linear_in.weight"], nemo[f"{head}.linear_out.weight"] = a, b
    out.mkdir(parents=True)
    save_file({k: t.contiguous() for k, t in nemo.items()}, out / "model_weights.safetensors")
    model_config = {
        "num_layers": len(layers),
        "num_attention_heads": heads,
        "num_query_groups": kv_heads,
        "kv_channels": None,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
        "peft": {
            "peft_scheme": "lora",
            "lora_tuning": {
                "target_modules": ["attention_qkv", "attention_dense", "mlp_fc1", "mlp_fc2"],
                "adapter_dim": config["r"],
                "alpha": config["lora_alpha"],
                "adapter_dropout": 0.0,
                "layer_selection": None,
                "weight_tying": False,
                "variant": "nemo" if fused else "canonical",
            },
        },
    }
    (out / "model_config.yaml").write_text(yaml.safe_dump(model_config))
    return out


def _fused_pairs(lora: dict, heads: int, kv_heads: int) -> dict:
    """NeMo's fused adapters of one layer: q, k, v's B rows by query group, gate's then up's."""
    pairs = {}
    if ("self_attn.q_proj", "A") in lora:
        q, k, v = (lora[f"self_attn.{p}_proj", "B"] for p in "qkv")
        d, per = q.shape[0] // heads, heads // kv_heads
        groups = [
            torch.cat(
                [q[g * per * d : (g + 1) * per * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
            )
            for g in range(kv_heads)
        ]
        adapter = "self_attention.adapter_layer.lora_kqv_adapter"
        pairs[adapter] = (lora["self_attn.q_proj", "A"], torch.cat(groups))
    if ("mlp.gate_proj", "A") in lora:
        b = torch.cat([lora["mlp.gate_proj", "B"], lora["mlp.up_proj", "B"]])
        pairs["mlp.adapter_layer.lora_hto4h_adapter"] = (lora["mlp.gate_proj", "A"], b)
    return pairs
