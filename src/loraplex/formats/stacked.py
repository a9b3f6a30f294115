"""Split projections of an adapter mapped to a fused base (Phi-3's `qkv_proj`, `gate_up_proj`).

The parts' LoRAs become one LoRA on the fused module, exactly: each distinct A of the parts is one
block of the fused A's rows (parts whose A's are equal share theirs), and each part's B sits in the
fused B at the part's output rows and its A's columns, zero elsewhere. So the fused module's output
rows of a part are B_part·A_part·x, with the part's own scaling folded into its block (relative to
the fused module's scaling, which is the first part's). The fused rank is the sum of the distinct
A's ranks; the config names it per layer in `rank_pattern` and `alpha_pattern`.

Which modules are fused, from which parts, is a `FusedLayout`: the served fused base's (Phi-3's)
by default, or another, such as the `in_proj_qkv` of the linear-attention layers of Qwen3.5 and
Qwen3-Next (q's, k's then v's rows), against which Tinker exports split `in_proj_q`/`k`/`v`."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import NamedTuple

from loraplex.formats.draft import Block, Draft, Joined, Piece
from loraplex.formats.tensors import read_tensors
from loraplex.lora_common import config_selects, rank_and_scaling
from loraplex.lora_format import AdapterRejected
from loraplex.model_config import FUSED_MODULES, ModelConfig


class FusedLayout(NamedTuple):
    """A base's fused modules: each one's parts in the order their outputs are stacked in its
    weight's rows, and the (d_in, d_out) of every fused module and part."""

    groups: dict[str, tuple[str, ...]]
    shape: Callable[[str], tuple[int, int]]

    @classmethod
    def of(cls, model: ModelConfig) -> FusedLayout:
        """The served base's: Phi-3's `qkv_proj` and `gate_up_proj`; none for a split base."""
        return cls(FUSED_MODULES if model.fused else {}, model.linear_shape)

    @property
    def fused_of(self) -> dict[str, str]:
        return {part: fused for fused, parts in self.groups.items() for part in parts}

    def part_key(self) -> re.Pattern:
        return re.compile(
            rf"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.({'|'.join(self.fused_of)})\."
            r"(?:lora_([AB])\.weight|(lora_magnitude_vector))$"
        )


class Part(NamedTuple):
    """One split part's LoRA: its A and B pieces, rank and scaling."""

    name: str
    a: Piece
    b: Piece
    rank: int
    scaling: float


def fuse_split(draft: Draft, model: ModelConfig, layout: FusedLayout | None = None) -> Draft:
    """The draft with the split parts' LoRAs of a fused base made into its fused modules' LoRAs
    (`layout`: the base's fused modules, the served base's by default)."""
    layout = layout or FusedLayout.of(model)
    if not layout.groups:
        return draft
    found = _split_parts(draft, layout)
    if not found:
        return draft
    source, _ = read_tensors(draft.weights)
    ranks: dict[str, int] = {}
    scalings: dict[str, float] = {}
    for (layer, block, fused), named in sorted(found.items()):
        prefix = f"base_model.model.model.layers.{layer}.{block}"
        parts = [
            _part(draft, layout, prefix, name, named[name])
            for name in layout.groups[fused]
            if name in named
        ]
        for part, side in ((p.name, s) for p in parts for s in "AB"):
            del draft.pieces[f"{prefix}.{part}.lora_{side}.weight"]
        a, b, rank = _fused_pair(layout, fused, parts, source)
        for side, piece in (("A", a), ("B", b)):
            key = f"{prefix}.{fused}.lora_{side}.weight"
            if key in draft.pieces:
                raise AdapterRejected("weights", f"{key} is given both fused and split")
            draft.pieces[key] = piece
        path = f"{prefix.removeprefix('base_model.model.')}.{fused}"
        ranks[path], scalings[path] = rank, parts[0].scaling
    draft.config = _fused_config(draft.config, layout, ranks, scalings)
    draft.changes += _changes(layout, found)
    return draft


def _split_parts(
    draft: Draft, layout: FusedLayout
) -> dict[tuple[int, str, str], dict[str, dict[str, Piece]]]:
    """(layer, block, fused module) -> part -> side ("A", "B") -> its piece, for every split
    part's tensor of the draft."""
    found: dict[tuple[int, str, str], dict[str, dict[str, Piece]]] = {}
    part_key, fused_of = layout.part_key(), layout.fused_of
    for key, piece in draft.pieces.items():
        match = part_key.fullmatch(key)
        if match is None:
            continue
        layer, block, part = int(match[1]), match[2], match[3]
        if match[5]:
            raise AdapterRejected(
                "use_dora",
                f"layer {layer} {part}: DoRA on split projections is not converted for a base "
                f"with a fused {fused_of[part]}",
            )
        assert isinstance(piece, Piece)  # a source tensor: only the fusing joins pieces
        sides = found.setdefault((layer, block, fused_of[part]), {}).setdefault(part, {})
        sides[match[4]] = piece
    return found


def _part(draft: Draft, layout: FusedLayout, prefix: str, name: str, sides: dict) -> Part:
    """One part's LoRA checked as the split base would check it: both sides, the shapes, the rank
    the config gives and the config selecting it (PEFT ignores the weights of a module it does not
    select)."""
    path = f"{prefix.removeprefix('base_model.model.')}.{name}"
    layer = int(path.split(".")[2])
    if set(sides) != {"A", "B"}:
        raise AdapterRejected(
            "weights", f"layer {layer} {name}: lora_A and lora_B must both be present"
        )
    d_in, d_out = layout.shape(name)
    shape_a, shape_b = sides["A"].shape(draft.header), sides["B"].shape(draft.header)
    rank = shape_a[0] if len(shape_a) == 2 else -1
    if rank < 1 or shape_a != [rank, d_in] or shape_b != [d_out, rank]:
        raise AdapterRejected(
            "shape",
            f"layer {layer} {name}: A {shape_a} and B {shape_b} do not fit the base "
            f"(expected [r, {d_in}] and [{d_out}, r])",
        )
    if not config_selects(draft.config, path, layer):
        raise AdapterRejected(
            "target_modules",
            f"layer {layer} {name} has weights, but the config does not select it (PEFT would "
            "not load them)",
        )
    config_rank, scaling = rank_and_scaling(draft.config, path)
    if config_rank != rank:
        raise AdapterRejected(
            "r", f"layer {layer} {name}: config says rank {config_rank}, tensors have {rank}"
        )
    return Part(name, sides["A"], sides["B"], rank, scaling)


def _fused_pair(
    layout: FusedLayout, fused: str, parts: list[Part], source: dict
) -> tuple[Joined, Joined, int]:
    """The fused A and B of the parts, and the fused rank."""
    columns: dict[bytes, int] = {}  # an A's bytes -> its first row in the fused A
    a_blocks, b_blocks, rank = [], [], 0
    row = 0
    for name in layout.groups[fused]:
        part = next((p for p in parts if p.name == name), None)
        if part is not None:
            made = part.a.made(source)
            identity = made.dtype.encode() + made.data
            if identity not in columns:
                columns[identity] = rank
                a_blocks.append(Block(rank, 0, part.a))
                rank += part.rank
            scale = part.scaling / parts[0].scaling
            b_blocks.append(Block(row, columns[identity], part.b, scale))
        row += layout.shape(name)[1]
    d_in = layout.shape(fused)[0]
    return Joined((rank, d_in), tuple(a_blocks)), Joined((row, rank), tuple(b_blocks)), rank


def _fused_config(
    config: dict, layout: FusedLayout, ranks: dict[str, int], scalings: dict[str, float]
) -> dict:
    """The config selecting the fused modules where it selected their parts, with each fused
    module's rank and an alpha that gives it its first part's scaling (its patterns first: PEFT
    takes the first pattern that matches)."""
    config = dict(config)
    targets = config.get("target_modules")
    if isinstance(targets, list):
        fused_of = layout.fused_of
        config["target_modules"] = list(dict.fromkeys(_fused_name(n, fused_of) for n in targets))
    elif isinstance(targets, str) and targets != "all-linear":  # all-linear names the fused too
        paths = "|".join(re.escape(path) for path in sorted(ranks))
        config["target_modules"] = f"(?:{targets})|(?:{paths})"
    rslora = config.get("use_rslora", False)
    patterns = {path: re.escape(path) for path in ranks}
    alphas = {
        path: scalings[path] * (math.sqrt(rank) if rslora else rank) for path, rank in ranks.items()
    }
    config["rank_pattern"] = {
        **{patterns[p]: r for p, r in ranks.items()},
        **(config.get("rank_pattern") or {}),
    }
    config["alpha_pattern"] = {
        **{patterns[p]: a for p, a in alphas.items()},
        **(config.get("alpha_pattern") or {}),
    }
    return config


def _fused_name(name: str, fused_of: dict[str, str]) -> str:
    """A target's name with a part's name at its end made the fused module's (PEFT writes module
    names or, for `all-linear`, whole paths)."""
    head, dot, last = name.rpartition(".")
    return f"{head}{dot}{fused_of.get(last, last)}"


def _changes(layout: FusedLayout, found: dict) -> list[str]:
    counts: dict[str, int] = {}
    for _, _, fused in found:
        counts[fused] = counts.get(fused, 0) + 1
    return [
        f"modules: {', '.join(layout.groups[fused])} fused into {fused} (A's stacked, B's "
        f"block-diagonal, each part's scaling kept) in {count} layers"
        for fused, count in sorted(counts.items())
    ]
