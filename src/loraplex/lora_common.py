"""What the adapter format's modules share: the refusal and the stored dtypes."""

from __future__ import annotations

import math
import re

DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}


class AdapterRejected(ValueError):
    """An adapter that cannot be served; `field` names what is wrong, the message says why."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def config_selects(config: dict, path: str, layer: int | None) -> bool:
    """Whether PEFT, reading this config, puts a LoRA on the module at `path` (its matching rules: a
    string is a regex the whole path must match, a list names path suffixes, and then
    `layers_to_transform` limits the layers). PEFT ignores the weights of a module it does not
    select, so serving them would serve another adapter. A config without `target_modules` selects
    by the weights. `layer` is None for a module outside the decoder layers."""

    def named(names) -> bool:
        if isinstance(names, str):
            return names == "all-linear" or re.fullmatch(names, path) is not None
        return any(path == name or path.endswith(f".{name}") for name in names)

    excluded = config.get("exclude_modules")
    if excluded and named(excluded):
        return False
    targets = config.get("target_modules")
    if not targets:
        return True
    if isinstance(targets, str) or path in targets:
        return named(targets)
    layers = config.get("layers_to_transform")
    layers = [layers] if isinstance(layers, int) else layers
    return named(targets) and (not layers or layer in layers)


def is_number(value) -> bool:
    """A finite int or float: an infinite or NaN alpha makes every logit NaN."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def pattern_value(patterns: dict, key: str, default):
    """PEFT's rule: the first pattern that matches the end of the module's name wins."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def rank_and_scaling(config: dict, path: str) -> tuple[int, float]:
    """The module's rank and LoRA scaling as PEFT reads them (rank and alpha patterns, rsLoRA)."""
    rank = pattern_value(config.get("rank_pattern"), path, config.get("r", 8))
    alpha = pattern_value(config.get("alpha_pattern"), path, config.get("lora_alpha", 8))
    if config.get("use_rslora", False):
        return rank, alpha / math.sqrt(rank)
    return rank, alpha / rank
