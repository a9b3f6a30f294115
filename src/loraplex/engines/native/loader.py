"""Loading a base model from a local Hugging Face directory (safetensors only, single file or
sharded)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.engines.native.model import CausalLM, pack_for_cpu, rope_inv_freq
from loraplex.engines.native.moe import stack_expert_weights
from loraplex.model_config import ModelConfig, ModelConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    if name == "auto":
        return DTYPES.get(cfg.torch_dtype, torch.float32)
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelConfigError("device cuda was asked for, but torch sees no CUDA device")
    return torch.device(name)


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise ModelConfigError(
                f"{model_dir}: missing weight shard {missing[0]} named in {index.name}"
            )
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if any(model_dir.glob("*.bin")):
        raise ModelConfigError(
            f"{model_dir}: only pickle weights (*.bin) found; loraplex loads safetensors only"
        )
    raise ModelConfigError(
        f"{model_dir}: missing model.safetensors (or model.safetensors.index.json)"
    )


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device=device)
    state = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                state[key] = f.get_tensor(key)
    stack_expert_weights(state, cfg)
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = {k for k in model.state_dict()}
    missing = sorted(expected - state.keys())
    if missing:
        raise ModelConfigError(
            f"{model_dir}: weights are missing {missing[0]} (and {len(missing) - 1} more)"
        )
    unexpected = sorted(k for k in state.keys() - expected if not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise ModelConfigError(
            f"{model_dir}: unexpected weight {unexpected[0]} for {cfg.architecture}"
        )
    with torch.no_grad():
        for key, param in model.state_dict().items():
            param.copy_(state[key])
    model = model.to(dtype=dtype)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg).to(device)  # kept in float32, as Hugging Face does
    pack_for_cpu(model)
    return model.eval()
