"""Reading and validating a PEFT LoRA directory from its config and safetensors header only (no torch)."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from loraplex.model_config import LINEAR_MODULES, ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class AdapterRejected(ValueError):
    """An adapter that cannot be served; `field` names what is wrong, the message says why."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class LoraModuleSpec:
    """One injected linear layer: A is [rank, d_in], B is [d_out, rank]."""

    layer: int
    module: str
    rank: int
    scaling: float
    key_a: str
    key_b: str


@dataclass(frozen=True)
class AdapterSpec:
    path: Path
    rank: int
    lora_alpha: float
    use_rslora: bool
    dtype: str
    task_type: str | None
    base_model_name: str | None
    target_modules: tuple[str, ...]
    modules: tuple[LoraModuleSpec, ...]
    estimated_bytes: int
    actual_bytes: int


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"}, read from the file's JSON header."""
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise AdapterRejected(path.name, "not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", raw_len)
        if length > 100 * 2**20:
            raise AdapterRejected(path.name, f"safetensors header of {length} bytes is implausible")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise AdapterRejected(path.name, f"not a safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return header


def read_adapter_config(adapter_dir: Path) -> dict:
    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise AdapterRejected("path", f"{adapter_dir} is not a directory")
    if not (adapter_dir / WEIGHTS_FILE).is_file():
        pickles = sorted(p.name for p in adapter_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise AdapterRejected(
                "weights",
                f"{pickles[0]} is a pickle file, which can run code when loaded; "
                f"only {WEIGHTS_FILE} is accepted (convert it with safetensors)",
            )
        raise AdapterRejected("weights", f"missing {WEIGHTS_FILE} in {adapter_dir}")
    if not (adapter_dir / CONFIG_FILE).is_file():
        raise AdapterRejected("config", f"missing {CONFIG_FILE} in {adapter_dir}")
    try:
        config = json.loads((adapter_dir / CONFIG_FILE).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterRejected("config", f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterRejected("config", f"{CONFIG_FILE} must hold a JSON object")
    return config


def _check_config(config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterRejected("peft_type", f"{config['peft_type']!r} is not supported; only LORA")
    if config.get("use_dora"):
        raise AdapterRejected("use_dora", "DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterRejected("bias", f"bias={config['bias']!r} is not supported; only 'none'")
    if config.get("modules_to_save"):
        raise AdapterRejected("modules_to_save", f"{config['modules_to_save']} is not supported (full weights)")
    targets = config.get("target_modules") or []
    if isinstance(targets, list):
        for name in targets:
            if name in ("embed_tokens", "lm_head"):
                raise AdapterRejected("target_modules", f"LoRA on {name} is not supported")


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rule: the first pattern that matches the end of the module's name wins."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def read_adapter(adapter_dir: str | Path, model: ModelConfig, max_rank: int) -> AdapterSpec:
    """Validate an adapter against the base model; raise AdapterRejected naming the field and reason."""
    adapter_dir = Path(adapter_dir)
    config = read_adapter_config(adapter_dir)
    _check_config(config)
    header = read_safetensors_header(adapter_dir / WEIGHTS_FILE)
    r_default, alpha_default = config.get("r", 8), config.get("lora_alpha", 8)
    use_rslora = bool(config.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    dtypes = set()
    actual = 0
    for key, info in header.items():
        match = _KEY.match(key)
        if match is None:
            what = "embedding or lm_head LoRA" if ("embed" in key or "lm_head" in key) else "an unexpected tensor"
            raise AdapterRejected("weights", f"{key} is {what}; only LoRA A/B of decoder linear layers are supported")
        layer, module, side = int(match[1]), match[3], match[4]
        if module not in LINEAR_MODULES:
            raise AdapterRejected("target_modules", f"{module} is not a linear layer of {model.architecture}")
        if layer >= model.num_layers:
            raise AdapterRejected("weights", f"{key}: layer {layer} does not exist (base has {model.num_layers})")
        if info["dtype"] not in DTYPE_BYTES:
            raise AdapterRejected("dtype", f"{key} has dtype {info['dtype']}; allowed: {', '.join(DTYPE_BYTES)}")
        dtypes.add(info["dtype"])
        actual += math.prod(info["shape"]) * DTYPE_BYTES[info["dtype"]]
        pairs.setdefault((layer, module), {})[side] = key
    if not pairs:
        raise AdapterRejected("weights", f"{WEIGHTS_FILE} holds no LoRA tensors")
    modules = []
    estimated = 0
    for (layer, module), sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            raise AdapterRejected("weights", f"layer {layer} {module}: lora_A and lora_B must both be present")
        d_in, d_out = model.linear_shape(module)
        shape_a, shape_b = header[sides["A"]]["shape"], header[sides["B"]]["shape"]
        rank = shape_a[0] if len(shape_a) == 2 else -1
        if shape_a != [rank, d_in] or shape_b != [d_out, rank]:
            raise AdapterRejected(
                "shape",
                f"layer {layer} {module}: A {shape_a} and B {shape_b} do not fit the base "
                f"(expected [r, {d_in}] and [{d_out}, r])",
            )
        if rank > max_rank:
            raise AdapterRejected("rank", f"rank {rank} of layer {layer} {module} is above max_lora_rank {max_rank}")
        path = ModelConfig.module_path(layer, module)
        r = _pattern_value(config.get("rank_pattern"), path, r_default)
        if r != rank:
            raise AdapterRejected("r", f"layer {layer} {module}: config says rank {r}, tensors have {rank}")
        alpha = _pattern_value(config.get("alpha_pattern"), path, alpha_default)
        scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        modules.append(LoraModuleSpec(layer, module, rank, scaling, sides["A"], sides["B"]))
        estimated += (d_in + d_out) * rank * DTYPE_BYTES[header[sides["A"]]["dtype"]]
    return AdapterSpec(
        path=adapter_dir,
        rank=max(m.rank for m in modules),
        lora_alpha=float(alpha_default),
        use_rslora=use_rslora,
        dtype=sorted(dtypes)[0] if len(dtypes) == 1 else "mixed",
        task_type=config.get("task_type"),
        base_model_name=config.get("base_model_name_or_path"),
        target_modules=tuple(sorted({m.module for m in modules})),
        modules=tuple(modules),
        estimated_bytes=estimated,
        actual_bytes=actual,
    )


def check_base_model(spec: AdapterSpec, base_name: str) -> None:
    """Refuse an adapter whose config names another base model than `base_name`.

    Names compare by their last path component, case-insensitively, so that a hub id `org/Model` and a
    local directory `/models/Model` match. An adapter that names no base model is accepted.
    """
    if not spec.base_model_name:
        return
    if _model_stem(spec.base_model_name) != _model_stem(base_name):
        raise AdapterRejected(
            "base_model_name_or_path",
            f"the adapter was trained on {spec.base_model_name!r}, not on the base model {base_name!r}",
        )


def _model_stem(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1].lower()
