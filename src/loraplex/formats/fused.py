"""Fused projections of an adapter mapped to a split base (Llama's): a LoRA on `gate_up_proj` (or
`qkv_proj`) computes x·Aᵀ·Bᵀ with the parts' outputs stacked in B's rows, so each part is the same A
with its own rows of B, exactly, whatever B holds."""

from __future__ import annotations

import re

from loraplex.formats.draft import Draft, Joined, Piece, add_piece
from loraplex.lora_format import AdapterRejected
from loraplex.model_config import FUSED_MODULES as FUSED
from loraplex.model_config import ModelConfig

_FUSED_KEY = re.compile(rf"^(.*\.layers\.(\d+)\.\w+\.)({'|'.join(FUSED)})\.lora_([AB])\.weight$")


def split_fused(draft: Draft, model: ModelConfig) -> Draft:
    """The draft with every fused module's LoRA split into its parts, for a base with split
    projections (a fused base keeps them)."""
    if model.fused:
        return draft
    split: dict[str, int] = {}
    pieces: dict[str, Piece | Joined] = {}
    for key, piece in draft.pieces.items():
        match = _FUSED_KEY.fullmatch(key)
        if match is None:
            add_piece(pieces, key, piece)
            continue
        head, layer, fused, side = match[1], int(match[2]), match[3], match[4]
        assert isinstance(piece, Piece)  # a source tensor: only the fusing makes Joined ones
        split[fused] = split.get(fused, 0) + 1
        for part_key, part in _parts(draft, piece, head, layer, fused, side, model).items():
            add_piece(pieces, part_key, part)
    if not split:
        return draft
    draft.pieces = pieces
    draft.config = _split_config(draft.config)
    for fused, count in sorted(split.items()):
        draft.changes.append(
            f"modules: {fused} split into {', '.join(FUSED[fused])} (the same A, B sliced by "
            f"rows) in {count // 2} layers"
        )
    return draft


def _parts(
    draft: Draft, piece: Piece, head: str, layer: int, fused: str, side: str, model: ModelConfig
) -> dict[str, Piece]:
    parts = FUSED[fused]
    if side == "A":
        return {f"{head}{part}.lora_A.weight": piece for part in parts}
    sizes = [model.linear_shape(part)[1] for part in parts]
    rows = piece.shape(draft.header)[0]
    if rows != sum(sizes):
        raise AdapterRejected(
            "shape",
            f"layer {layer} {fused}: B has {rows} rows; the base's {', '.join(parts)} have "
            f"{sum(sizes)} outputs together",
        )
    out, start = {}, 0
    for part, size in zip(parts, sizes, strict=True):
        out[f"{head}{part}.lora_B.weight"] = piece.sliced(start, start + size)
        start += size
    return out


def _split_config(config: dict) -> dict:
    """The config naming the parts wherever it names a fused module: target and excluded modules
    (lists or patterns) and the rank and alpha patterns."""
    config = dict(config)
    for name in ("target_modules", "exclude_modules"):
        value = config.get(name)
        if isinstance(value, list):
            config[name] = [part for v in value for part in _part_names(v)]
        elif isinstance(value, str):
            for fused, parts in FUSED.items():
                value = value.replace(fused, f"(?:{'|'.join(parts)})")
            config[name] = value
    for name in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(name)
        if isinstance(patterns, dict):
            config[name] = {
                _with_part(pattern, fused, part): v
                for pattern, v in patterns.items()
                for fused, part in _fused_parts_in(pattern)
            }
    return config


def _part_names(name: str) -> list[str]:
    """A target's name (a module's, or a whole path as PEFT writes for `all-linear`) for each part
    when it ends in a fused module's name, else itself."""
    head, dot, last = name.rpartition(".")
    return [f"{head}{dot}{part}" for part in FUSED.get(last, (last,))]


def _fused_parts_in(pattern: str) -> list[tuple[str, str]]:
    """(fused, part) for each part of each fused module the pattern names; ("", "") when none."""
    named = [(fused, part) for fused, parts in FUSED.items() if fused in pattern for part in parts]
    return named or [("", "")]


def _with_part(pattern: str, fused: str, part: str) -> str:
    return pattern.replace(fused, part) if fused else pattern
