"""LoRA on a mixture-of-experts base's 3-D expert weights, as PEFT writes it (`target_parameters`
such as `mlp.experts.gate_up_proj`), read from the config and safetensors header (no torch).

PEFT wraps each targeted parameter of `mlp.experts` in a `ParamWrapper`; a second one wraps the
first, so the inner one's tensors are keyed `mlp.experts.base_layer.lora_A.weight`. One LoRA holds
every expert's: A is [experts * r, d_in], expert e's rows e*r .. e*r + r - 1; B is
[d_out, r * experts], expert e's columns e, e + experts, e + 2 * experts, … (PEFT's
`ParamWrapper.get_delta_weight`). The shapes tell which parameter a LoRA is on: `gate_up_proj`
maps hidden to 2 * intermediate, `down_proj` intermediate to hidden."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from loraplex.lora_common import DTYPE_BYTES, AdapterRejected, rank_and_scaling
from loraplex.model_config import ModelConfig

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
_EXPERT_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.mlp\.experts\.((?:base_layer\.)*)"
    r"lora_([AB])\.weight$"
)


@dataclass(frozen=True)
class ExpertLora:
    """Every expert's LoRA on one 3-D parameter of one layer, as PEFT stores it."""

    layer: int
    parameter: str  # "gate_up_proj" or "down_proj"
    rank: int
    scaling: float
    key_a: str  # [experts * rank, d_in]
    key_b: str  # [d_out, rank * experts]


def is_expert_key(key: str) -> bool:
    return _EXPERT_KEY.fullmatch(key) is not None


def check_target_parameters(config: dict, model: ModelConfig) -> None:
    """`target_parameters` names only the experts' 3-D weights of a mixture-of-experts base."""
    targets = config.get("target_parameters")
    if not targets:
        return
    if model.experts is None:
        raise AdapterRejected(
            "target_parameters",
            f"LoRA on parameters is supported on the experts of a mixture-of-experts base only; "
            f"{model.architecture} has none",
        )
    if not isinstance(targets, list) or not all(
        isinstance(t, str) and _names_experts(t) for t in targets
    ):
        raise AdapterRejected(
            "target_parameters",
            f"{targets!r} is not supported; only the experts' "
            f"{' and '.join(f'mlp.experts.{p}' for p in EXPERT_PARAMETERS)}",
        )


def _names_experts(target: str) -> bool:
    """Whether a target names an expert weight by PEFT's rule: the parameter's path is the target
    or ends with "." + it."""
    if re.fullmatch(rf"model\.layers\.\d+\.mlp\.experts\.({'|'.join(EXPERT_PARAMETERS)})", target):
        return True
    paths = [f"model.layers.0.mlp.experts.{p}" for p in EXPERT_PARAMETERS]
    return any(p.endswith(f".{target}") for p in paths)


def read_experts(
    config: dict, header: dict, keys: list[str], model: ModelConfig, max_rank: int
) -> tuple[ExpertLora, ...]:
    """The expert LoRAs the tensors `keys` make, checked against the base and the config."""
    by_wrapper: dict[tuple[int, str], dict[str, str]] = {}
    for key in keys:
        match = _EXPERT_KEY.fullmatch(key)
        assert match is not None  # is_expert_key
        layer = int(match[1])
        if layer >= model.num_layers:
            raise AdapterRejected(
                "weights", f"{key}: layer {layer} does not exist (base has {model.num_layers})"
            )
        by_wrapper.setdefault((layer, match[2]), {})[match[3]] = key
    loras = [_expert_lora(config, header, model, max_rank, *k, s) for k, s in by_wrapper.items()]
    seen = set()
    for lora in loras:
        if (lora.layer, lora.parameter) in seen:
            raise AdapterRejected(
                "weights", f"layer {lora.layer} {lora.parameter} has two expert LoRAs"
            )
        seen.add((lora.layer, lora.parameter))
    return tuple(sorted(loras, key=lambda e: (e.layer, EXPERT_PARAMETERS.index(e.parameter))))


def _expert_lora(
    config: dict, header: dict, model: ModelConfig, max_rank: int, layer: int, nest: str, sides
) -> ExpertLora:
    assert model.experts is not None
    where = f"layer {layer} mlp.experts.{nest}"
    if set(sides) != {"A", "B"}:
        raise AdapterRejected("weights", f"{where}: lora_A and lora_B must both be present")
    for key in sides.values():
        if header[key]["dtype"] not in DTYPE_BYTES:
            raise AdapterRejected("dtype", f"{key} has dtype {header[key]['dtype']}")
    num = model.experts.num_experts
    shape_a, shape_b = header[sides["A"]]["shape"], header[sides["B"]]["shape"]
    for parameter in EXPERT_PARAMETERS:
        d_in, d_out = model.experts.expert_shape(model.hidden_size, parameter)
        rows = shape_a[0] if len(shape_a) == 2 else 0
        if rows and rows % num == 0 and shape_a == [rows, d_in] and shape_b == [d_out, rows]:
            break
    else:
        raise AdapterRejected(
            "shape",
            f"{where}: A {shape_a} and B {shape_b} fit neither expert weight of the base "
            f"({num} experts; gate_up_proj and down_proj)",
        )
    rank = rows // num
    if rank > max_rank:
        raise AdapterRejected(
            "rank",
            f"rank {rank} of layer {layer} experts' {parameter} is above max_lora_rank {max_rank}",
        )
    path = f"model.layers.{layer}.mlp.experts.{parameter}"  # PEFT's key for its patterns
    targets = config.get("target_parameters") or []
    if not any(path == t or path.endswith(f".{t}") for t in targets):
        raise AdapterRejected(
            "target_parameters",
            f"layer {layer} experts' {parameter} has weights, but the config's target_parameters "
            "do not name it (PEFT would not load them)",
        )
    r, scaling = rank_and_scaling(config, path)
    if r != rank:
        raise AdapterRejected(
            "r", f"layer {layer} experts' {parameter}: config says rank {r}, tensors have {rank}"
        )
    return ExpertLora(layer, parameter, rank, scaling, sides["A"], sides["B"])


def expert_elements(header: dict, experts: tuple[ExpertLora, ...]) -> tuple[int, int]:
    """The numbers in the expert LoRAs' tensors and their bytes as stored."""
    keys = [k for e in experts for k in (e.key_a, e.key_b)]
    elements = sum(math.prod(header[k]["shape"]) for k in keys)
    stored = sum(math.prod(header[k]["shape"]) * DTYPE_BYTES[header[k]["dtype"]] for k in keys)
    return elements, stored
