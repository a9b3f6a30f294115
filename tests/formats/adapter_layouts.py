"""Adapters re-saved in the layouts other trainers write (from PEFT adapters, so that HF
transformers + PEFT on the original is the reference for the imported one)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
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
