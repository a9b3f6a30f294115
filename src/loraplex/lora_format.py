"""Reading and validating a PEFT LoRA adapter from its config and safetensors header only (no
torch)."""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.lora_common import (
    DTYPE_BYTES,
    AdapterRejected,
    config_selects,
    is_number,
    rank_and_scaling,
)
from loraplex.lora_experts import (
    ExpertLora,
    check_target_parameters,
    expert_elements,
    is_expert_key,
    read_experts,
)
from loraplex.lora_variants import Variants, check_variant_config, is_variant_key, read_variants
from loraplex.model_config import ModelConfig

__all__ = ["DTYPE_BYTES", "AdapterRejected"]  # defined in lora_common, imported from here too

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
    r"(?:lora_([AB])(?:\.default)?\.weight|lora_(magnitude)_vector)$"
)


@dataclass(frozen=True)
class LoraModuleSpec:
    """One injected linear layer: A is [rank, d_in], B is [d_out, rank]."""

    layer: int
    module: str
    rank: int
    scaling: float
    key_a: str
    key_b: str
    key_magnitude: str | None = None
    """DoRA's magnitude vector [d_out] (None: a plain LoRA)."""


@dataclass(frozen=True)
class AdapterSpec:
    path: Path | None  # None for an adapter validated from bytes in memory
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
    elements: int = 0
    """Numbers in the adapter's weights (A, B and DoRA's magnitude of every module, and the
    variants'): times the serving dtype's size, the host copy."""
    variants: Variants = field(default_factory=Variants)
    """LoRA on lm_head and embed_tokens, full weights, trainable tokens."""
    experts: tuple[ExpertLora, ...] = ()
    """LoRA on a mixture-of-experts base's 3-D expert weights (`target_parameters`)."""
    # the weights file's layout when validated from its bytes (pack_adapter then need not read the
    # header again)
    layout: SafetensorsLayout | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class SafetensorsLayout:
    """A safetensors file's header: where its data section starts and how long it is."""

    # name -> {"dtype", "shape", "data_offsets"}; offsets count from data_start
    tensors: dict[str, dict]
    data_start: int
    data_bytes: int


def read_safetensors_header(path: Path) -> SafetensorsLayout:
    """The header of a safetensors file, read without reading its tensors."""
    with path.open("rb") as f:
        length = _header_length(f.read(8), path.name)
        raw = f.read(length)
        size = os.fstat(f.fileno()).st_size
    return _decode_header(raw, length, size, path.name)


def parse_safetensors_header(
    data: bytes | bytearray | memoryview, name: str = WEIGHTS_FILE
) -> SafetensorsLayout:
    """The header of a safetensors file held in memory."""
    data = memoryview(data)
    length = _header_length(bytes(data[:8]), name)
    return _decode_header(bytes(data[8 : 8 + length]), length, len(data), name)


def _header_length(prefix: bytes, name: str) -> int:
    if len(prefix) != 8:
        raise AdapterRejected(name, "not a safetensors file (too short)")
    (length,) = struct.unpack("<Q", prefix)
    if length > 100 * 2**20:
        raise AdapterRejected(name, f"safetensors header of {length} bytes is implausible")
    return length


def _decode_header(raw: bytes, length: int, file_size: int, name: str) -> SafetensorsLayout:
    if 8 + length > file_size:
        raise AdapterRejected(
            name, f"not a safetensors file (a header of {length} bytes runs past its end)"
        )
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterRejected(name, f"not a safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise AdapterRejected(name, "not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    for key, info in header.items():
        if not _is_tensor_entry(info):
            raise AdapterRejected(
                name, f"not a safetensors file (malformed header entry for {key})"
            )
    return SafetensorsLayout(header, 8 + length, file_size - 8 - length)


def _is_tensor_entry(info) -> bool:
    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        return False
    shape, offsets = info.get("shape"), info.get("data_offsets")
    return _naturals(shape) and _naturals(offsets) and len(offsets) == 2


def _naturals(values) -> bool:
    return isinstance(values, list) and all(type(v) is int and v >= 0 for v in values)


def check_tiling(layout: SafetensorsLayout, name: str) -> None:
    """The tensors fill the data section exactly, in order, each as long as its shape and dtype say.

    So that a view of any tensor's bytes stays inside the file (as the safetensors library itself
    requires).
    """
    end = 0
    for key, info in sorted(layout.tensors.items(), key=lambda item: item[1]["data_offsets"]):
        begin, stop = info["data_offsets"]
        if begin != end or stop - begin != math.prod(info["shape"]) * DTYPE_BYTES[info["dtype"]]:
            raise AdapterRejected(
                name,
                f"{key}: data_offsets {info['data_offsets']} do not follow the previous tensor or "
                "fit its shape",
            )
        end = stop
    if end != layout.data_bytes:
        raise AdapterRejected(
            name, f"the tensors cover {end} bytes of a {layout.data_bytes}-byte data section"
        )


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
    return _parse_config((adapter_dir / CONFIG_FILE).read_bytes())


def _parse_config(raw: bytes) -> dict:
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterRejected("config", f"{CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterRejected("config", f"{CONFIG_FILE} must hold a JSON object")
    return config


# PEFT LoRA variants whose forward pass is not the plain x·Aᵀ·Bᵀ·scaling on every token, keyed by
# the config field that turns them on. Their weights can look like a plain LoRA's, so serving one
# would compute another function.
_VARIANTS = {
    "alora_invocation_tokens": (
        "activated LoRA (aLoRA: the adapter applies only after its invocation tokens) is not "
        "supported"
    ),
    "layer_replication": (
        "layer replication (the adapter runs on a rebuilt stack of layers) is not supported"
    ),
    "use_qalora": "QA-LoRA (pooled inputs) is not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "arrow_config": "Arrow (routing among several LoRAs) is not supported",
    "kasa_config": "KaSA is not supported",
    "lora_bias": "LoRA with a bias on B (lora_bias) is not supported",
}


def _check_config(config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterRejected("peft_type", f"{config['peft_type']!r} is not supported; only LORA")
    for name, why in _VARIANTS.items():
        if config.get(name):
            raise AdapterRejected(name, why)
    if config.get("bias", "none") != "none":
        raise AdapterRejected("bias", f"bias={config['bias']!r} is not supported; only 'none'")
    check_variant_config(config)
    for name in ("target_modules", "exclude_modules"):
        value = config.get(name)
        if (
            value is not None
            and not isinstance(value, str)
            and not (isinstance(value, list) and all(isinstance(v, str) for v in value))
        ):
            raise AdapterRejected(
                name, f"{value!r} is neither a pattern nor a list of module names"
            )
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as exc:
                raise AdapterRejected(name, f"{value!r} is not a valid pattern: {exc}") from None
    layers = config.get("layers_to_transform")
    if (
        layers is not None
        and not isinstance(layers, int)
        and not (isinstance(layers, list) and all(isinstance(v, int) for v in layers))
    ):
        raise AdapterRejected(
            "layers_to_transform", f"{layers!r} is neither a layer index nor a list of them"
        )
    for name in ("r", "lora_alpha"):
        if name in config and not is_number(config[name]):
            raise AdapterRejected(name, f"{config[name]!r} is not a finite number")
    for name in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(name) or {}
        if not isinstance(patterns, dict) or not all(is_number(v) for v in patterns.values()):
            raise AdapterRejected(name, "must map module name patterns to finite numbers")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as exc:
                raise AdapterRejected(name, f"{pattern!r} is not a valid pattern: {exc}") from None


def read_adapter(adapter_dir: str | Path, model: ModelConfig, max_rank: int) -> AdapterSpec:
    """Validate an adapter directory against the base model; raise AdapterRejected naming the field
    and reason."""
    adapter_dir = Path(adapter_dir)
    config = read_adapter_config(adapter_dir)
    return _adapter_spec(
        config, read_safetensors_header(adapter_dir / WEIGHTS_FILE), model, max_rank, adapter_dir
    )


def adapter_from_files(
    files: Mapping[str, bytes | bytearray | memoryview], model: ModelConfig, max_rank: int
) -> AdapterSpec:
    """Validate an adapter held in memory (file name -> bytes, as the cache reads and digest-checks
    it)."""
    for name, what in ((WEIGHTS_FILE, "weights"), (CONFIG_FILE, "config")):
        if name not in files:
            raise AdapterRejected(what, f"missing {name}")
    config = _parse_config(bytes(files[CONFIG_FILE]))
    return _adapter_spec(
        config, parse_safetensors_header(files[WEIGHTS_FILE]), model, max_rank, None
    )


def _adapter_spec(
    config: dict,
    layout: SafetensorsLayout,
    model: ModelConfig,
    max_rank: int,
    adapter_dir: Path | None,
) -> AdapterSpec:
    _check_config(config)
    check_target_parameters(config, model)
    header = layout.tensors
    pairs, others, dtypes, actual = _lora_pairs(header, model)
    expert_keys = [key for key in others if is_expert_key(key)]
    others = [key for key in others if not is_expert_key(key)]
    variants = read_variants(config, header, others, model, max_rank)
    experts = read_experts(config, header, expert_keys, model, max_rank) if expert_keys else ()
    if not pairs and variants.empty and not experts:
        raise AdapterRejected("weights", f"{WEIGHTS_FILE} holds no LoRA tensors")
    check_tiling(layout, WEIGHTS_FILE)
    modules = [
        _module_spec(config, header, model, max_rank, layer, module, sides)
        for (layer, module), sides in sorted(pairs.items())
    ]
    estimated, elements = variants.estimated_bytes, variants.elements
    expert_numbers, expert_bytes = expert_elements(header, experts)
    estimated, elements = estimated + expert_bytes, elements + expert_numbers
    for m in modules:
        # A [r, d_in], B [d_out, r] and DoRA's magnitude [d_out], each in its own dtype (a file
        # may store them in several)
        for key in (m.key_a, m.key_b, m.key_magnitude):
            if key is not None:
                numel = math.prod(header[key]["shape"])
                estimated += numel * DTYPE_BYTES[header[key]["dtype"]]
                elements += numel
    ranks = [m.rank for m in modules] + [h.rank for h in variants.head_loras]
    ranks += [e.rank for e in experts]
    return AdapterSpec(
        path=adapter_dir,
        rank=max(ranks, default=0),
        lora_alpha=float(config.get("lora_alpha", 8)),
        use_rslora=bool(config.get("use_rslora", False)),
        dtype=min(dtypes) if len(dtypes) == 1 else "mixed",
        task_type=config.get("task_type"),
        base_model_name=config.get("base_model_name_or_path"),
        target_modules=tuple(
            sorted({m.module for m in modules} | {h.module for h in variants.head_loras})
        ),
        modules=tuple(modules),
        estimated_bytes=estimated,
        actual_bytes=actual,
        elements=elements,
        variants=variants,
        experts=experts,
        layout=layout if adapter_dir is None else None,
    )


def _lora_pairs(
    header: dict, model: ModelConfig
) -> tuple[dict[tuple[int, str], dict[str, str]], list[str], set[str], int]:
    """The decoder tensors by (layer, module) and side (A, B, magnitude), the keys of the variants'
    and the experts' tensors (`lora_variants`, `lora_experts`), the dtypes and the bytes of all;
    AdapterRejected for a tensor that is none of these."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    others = []
    dtypes = set()
    actual = 0
    for key, info in header.items():
        if info["dtype"] not in DTYPE_BYTES:
            raise AdapterRejected(
                "dtype", f"{key} has dtype {info['dtype']}; allowed: {', '.join(DTYPE_BYTES)}"
            )
        dtypes.add(info["dtype"])
        actual += math.prod(info["shape"]) * DTYPE_BYTES[info["dtype"]]
        if is_variant_key(key) or is_expert_key(key):
            others.append(key)
            continue
        match = _KEY.fullmatch(key)
        if match is None:
            raise AdapterRejected(
                "weights",
                f"{key} is an unexpected tensor; LoRA A/B (and DoRA magnitudes) of decoder linear "
                "layers, lm_head and embed_tokens, LoRA on MoE experts, full lm_head and "
                "embed_tokens weights and trainable tokens are supported",
            )
        layer, module, side = int(match[1]), match[3], match[4] or "M"
        if module not in model.linear_modules:
            raise AdapterRejected(
                "target_modules", f"{module} is not a linear layer of {model.architecture}"
            )
        if layer >= model.num_layers:
            raise AdapterRejected(
                "weights", f"{key}: layer {layer} does not exist (base has {model.num_layers})"
            )
        pairs.setdefault((layer, module), {})[side] = key
    return pairs, others, dtypes, actual


def _module_spec(
    config: dict,
    header: dict,
    model: ModelConfig,
    max_rank: int,
    layer: int,
    module: str,
    sides: dict[str, str],
) -> LoraModuleSpec:
    """One module's A and B (and DoRA's magnitude) checked against the base's shapes, the rank
    limit and the config (the modules it selects, its rank and alpha patterns, DoRA)."""
    if not {"A", "B"} <= set(sides):
        raise AdapterRejected(
            "weights", f"layer {layer} {module}: lora_A and lora_B must both be present"
        )
    d_in, d_out = model.linear_shape(module)
    shape_a, shape_b = header[sides["A"]]["shape"], header[sides["B"]]["shape"]
    rank = shape_a[0] if len(shape_a) == 2 else -1
    if shape_a != [rank, d_in] or shape_b != [d_out, rank]:
        raise AdapterRejected(
            "shape",
            f"layer {layer} {module}: A {shape_a} and B {shape_b} do not fit the base "
            f"(expected [r, {d_in}] and [{d_out}, r])",
        )
    if rank < 1:
        raise AdapterRejected(
            "rank", f"layer {layer} {module} has rank {rank}; it must be at least 1"
        )
    if rank > max_rank:
        raise AdapterRejected(
            "rank", f"rank {rank} of layer {layer} {module} is above max_lora_rank {max_rank}"
        )
    path = ModelConfig.module_path(layer, module)
    if not config_selects(config, path, layer):
        raise AdapterRejected(
            "target_modules",
            f"layer {layer} {module} has weights, but the config's "
            "target_modules / layers_to_transform / exclude_modules do not select it (PEFT "
            "would not load them)",
        )
    r, scaling = rank_and_scaling(config, path)
    if r != rank:
        raise AdapterRejected(
            "r", f"layer {layer} {module}: config says rank {r}, tensors have {rank}"
        )
    magnitude = _magnitude(config, header, layer, module, sides.get("M"), d_out)
    return LoraModuleSpec(layer, module, rank, scaling, sides["A"], sides["B"], magnitude)


def _magnitude(
    config: dict, header: dict, layer: int, module: str, key: str | None, d_out: int
) -> str | None:
    """DoRA's magnitude vector of the module: present exactly when the config says use_dora."""
    if config.get("use_dora") and key is None:
        raise AdapterRejected(
            "use_dora", f"layer {layer} {module}: DoRA needs the module's lora_magnitude_vector"
        )
    if not config.get("use_dora") and key is not None:
        raise AdapterRejected(
            "use_dora",
            f"layer {layer} {module} has a DoRA magnitude vector, but the config does not say "
            "use_dora",
        )
    if key is not None and header[key]["shape"] != [d_out]:
        raise AdapterRejected(
            "shape",
            f"layer {layer} {module}: the magnitude vector is {header[key]['shape']}, the base's "
            f"output is [{d_out}]",
        )
    return key


def base_model_mismatch(spec: AdapterSpec, base_name: str) -> str | None:
    """Why the adapter's config names another base model than `base_name`; None when it does not.

    Names compare by their last path component, case-insensitively, so that a hub id `org/Model` and
    a local directory `/models/Model` match, and without a quantisation suffix, so that a QLoRA
    adapter trained on a 4-bit copy (`unsloth/Model-bnb-4bit`) matches the base `Model` it is served
    on. An adapter that names no base model names no other one.
    """
    if not spec.base_model_name or _model_stem(spec.base_model_name) == _model_stem(base_name):
        return None
    return (
        f"the adapter was trained on {spec.base_model_name!r}, not on the base model {base_name!r}"
    )


def quantised_base(spec: AdapterSpec) -> str | None:
    """A note when the adapter's config names a quantised copy of a model (QLoRA: trained on 4-bit
    weights, served on the full-precision base, so its outputs differ from the trainer's by the
    quantisation's error); None otherwise."""
    name = spec.base_model_name or ""
    if not _QUANTISED.search(name.rstrip("/")):
        return None
    return (
        f"the adapter was trained on a quantised copy of its base ({name!r}); it is served on the "
        "full-precision base, whose outputs differ from the trainer's by the quantisation's "
        "error (`loraplex registry verify` measures the difference)"
    )


# the suffixes of quantised copies' names (Unsloth's `-bnb-4bit`, `-unsloth-bnb-4bit`, AWQ, GPTQ)
_QUANTISED = re.compile(
    r"[-_.](?:unsloth[-_])?(?:bnb[-_])?(?:4bit|8bit|nf4|int4|int8|awq|gptq(?:[-_][\w-]+)?)$",
    re.IGNORECASE,
)


def _model_stem(name: str) -> str:
    return _QUANTISED.sub("", name.rstrip("/").rsplit("/", 1)[-1]).lower()
