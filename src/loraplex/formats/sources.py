"""The source formats an adapter directory comes in, each read into a `Draft`: the PEFT config and
the canonical tensors as pieces of the source's, from the headers alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

from loraplex.formats.draft import Draft, Joined, Piece, add_piece
from loraplex.formats.nemo import NEMO_CONFIG, NEMO_WEIGHTS, nemo_draft
from loraplex.formats.torchtune import is_torchtune, torchtune_draft
from loraplex.lora_format import (
    CONFIG_FILE,
    PICKLE_SUFFIXES,
    WEIGHTS_FILE,
    AdapterRejected,
    read_adapter_config,
    read_safetensors_header,
)
from loraplex.model_config import ModelConfig

MLX_WEIGHTS_FILE = "adapters.safetensors"
PEFT_PICKLE = "adapter_model.bin"
PREFIX = "base_model.model."
# what a file that holds no adapter we read is, by its name's end
_UNREAD = {
    ".nemo": "a NeMo archive; its model_weights.ckpt is a pickle",
    ".gguf": "a GGUF file",
    ".npz": "a NumPy archive (older MLX-LM adapters)",
    "model_weights.ckpt": "NeMo's weights, a pickle; loading one can run code",
    **{suffix: "a PyTorch pickle; loading one can run code" for suffix in PICKLE_SUFFIXES},
}


def read_draft(src: Path, model: ModelConfig) -> Draft:
    """The adapter in `src` as a draft of its canonical form; AdapterRejected with one line naming
    what was found when it is in no format we read."""
    if not src.is_dir():
        raise AdapterRejected("path", f"{src} is not a directory")
    names = sorted(p.name for p in src.iterdir() if p.is_file())
    if WEIGHTS_FILE in names:
        header = read_safetensors_header(src / WEIGHTS_FILE).tensors
        if is_torchtune(header):
            draft = torchtune_draft(src, header, read_adapter_config(src), model)
        else:
            draft = _peft_draft(src)
    elif MLX_WEIGHTS_FILE in names:
        draft = _mlx_draft(src)
    elif NEMO_WEIGHTS in names and NEMO_CONFIG in names:
        draft = nemo_draft(src, read_safetensors_header(src / NEMO_WEIGHTS).tensors, model)
    else:
        raise AdapterRejected("format", _unsupported(src, names))
    draft.changes += _left_out(names, draft.weights.name)
    return draft


def _unsupported(src: Path, names: list[str]) -> str:
    found = [(n, what) for n in names for end, what in _UNREAD.items() if n.endswith(end)]
    if found:
        name, what = found[0]
        return (
            f"unsupported adapter format: found {name} ({what}); only safetensors are read: "
            "export the weights as safetensors (docs/registry.md, Formats)"
        )
    return (
        f"unsupported adapter format: {src} holds neither {WEIGHTS_FILE} (PEFT, torchtune) nor "
        f"{MLX_WEIGHTS_FILE} (MLX-LM) nor {NEMO_WEIGHTS} with {NEMO_CONFIG} (NeMo)"
    )


def _left_out(names: list[str], weights: str) -> list[str]:
    """Files beside the adapter that the canonical form leaves out, never read: trainer state,
    torchtune's own copy of the weights (`adapter_model.pt`, its names), other safetensors (MLX-LM's
    checkpoints). PEFT's pickled weights beside its safetensors are refused: PEFT writes one or the
    other, so two are two saves that may differ."""
    changes = []
    for name in names:
        if name == PEFT_PICKLE:
            raise AdapterRejected(
                "weights",
                f"{name} is a pickle file beside {weights}; remove it (only safetensors are read)",
            )
        if name.endswith(PICKLE_SUFFIXES) or (name.endswith(".safetensors") and name != weights):
            changes.append(f"left out {name} (not read)")
    return changes


# PEFT's names in a model's state dict, with the adapter name `default`, to the names that
# save_pretrained writes: `lora_A.default.weight` -> `lora_A.weight`, `lora_embedding_A.default` ->
# `lora_embedding_A`, `lora_magnitude_vector.default.weight` -> `lora_magnitude_vector`,
# `modules_to_save.default.weight` -> `weight`, `trainable_tokens_delta.default` ->
# `trainable_tokens_delta`
_DEFAULT = re.compile(
    r"\.(lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector|modules_to_save|trainable_tokens_delta)"
    r"\.default(\.weight)?$"
)


def _without_default(match: re.Match) -> str:
    name = match[1]
    if name == "modules_to_save":
        return ".weight"
    if name.startswith("lora_") and name[5] in "AB":
        return f".{name}.weight"
    return f".{name}"


def _peft_draft(src: Path) -> Draft:
    weights = src / WEIGHTS_FILE
    config = read_adapter_config(src)
    header = read_safetensors_header(weights).tensors
    pieces: dict[str, Piece | Joined] = {}
    renamed = {"prefix": 0, "default": 0}
    for key in header:
        new = _DEFAULT.sub(_without_default, key)
        renamed["default"] += new != key
        if not new.startswith(PREFIX):
            new = PREFIX + new
            renamed["prefix"] += 1
        add_piece(pieces, new, Piece(key))
    changes = []
    if renamed["prefix"]:
        changes.append(f"keys: added the {PREFIX} prefix to {renamed['prefix']} tensors")
    if renamed["default"]:
        changes.append(f"keys: dropped the adapter name .default from {renamed['default']} tensors")
    return Draft("peft", weights, header, config, pieces, changes)


def _mlx_draft(src: Path) -> Draft:
    """MLX-LM's LoRA computes x·a·b·scale with a [in, r] and b [r, out]: PEFT's A is aᵀ, B is bᵀ
    and lora_alpha is scale × rank."""
    weights = src / MLX_WEIGHTS_FILE
    mlx = _mlx_config(src)
    params = mlx["lora_parameters"]
    header = read_safetensors_header(weights).tensors
    pieces: dict[str, Piece | Joined] = {}
    for key in header:
        match = re.fullmatch(r"(.+)\.lora_([ab])", key)
        if match is None:
            raise AdapterRejected(
                "weights", f"{key} is not an MLX-LM LoRA tensor (…lora_a or …lora_b)"
            )
        add_piece(pieces, f"{PREFIX}{match[1]}.lora_{match[2].upper()}.weight", Piece(key, True))
    rank = params["rank"]
    modules = sorted({k.rsplit(".", 3)[-3] for k in pieces})
    # MLX-LM trains the last `num_layers` layers: PEFT puts a LoRA on those only
    layers = sorted({int(m[1]) for k in pieces if (m := re.search(r"\.layers\.(\d+)\.", k))})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": mlx.get("model"),
        "r": rank,
        "lora_alpha": params["scale"] * rank,
        "target_modules": modules,
        "layers_to_transform": layers or None,
        "bias": "none",
        "use_rslora": False,
    }
    changes = [
        "keys: MLX-LM names (…lora_a, …lora_b) to PEFT's (base_model.model.….lora_A.weight, …)",
        "weights: A and B transposed (MLX-LM stores A [in, r] and B [r, out])",
        f"config: lora_parameters rank {rank}, scale {params['scale']} to r {rank}, "
        f"lora_alpha {config['lora_alpha']}",
    ]
    return Draft("mlx-lm", weights, header, config, pieces, changes)


def _mlx_config(src: Path) -> dict:
    path = src / CONFIG_FILE
    if not path.is_file():
        raise AdapterRejected("config", f"missing {CONFIG_FILE} beside {MLX_WEIGHTS_FILE} in {src}")
    try:
        config = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterRejected("config", f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    params = config.get("lora_parameters") if isinstance(config, dict) else None
    if not isinstance(params, dict):
        raise AdapterRejected(
            "format",
            f"unsupported adapter format: {MLX_WEIGHTS_FILE} with a {CONFIG_FILE} that has no "
            "lora_parameters (not an MLX-LM adapter)",
        )
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterRejected("fine_tune_type", f"MLX-LM {kind!r} adapters are not supported")
    for name in ("rank", "scale"):
        value = params.get(name)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise AdapterRejected(f"lora_parameters.{name}", f"{value!r} is not a positive number")
    if not isinstance(params["rank"], int):
        raise AdapterRejected("lora_parameters.rank", f"{params['rank']!r} is not an integer")
    return config
