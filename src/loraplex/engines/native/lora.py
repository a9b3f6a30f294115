"""LoRA on the device: packed host copies, the slot pool, per-step batch metadata and the batched
ops."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from loraplex.engines.native.moe import ExpertSlots
from loraplex.engines.native.variants import EMPTY_SLOT, DoraScales, SlotHeads, head_tensors
from loraplex.lora_format import DTYPE_BYTES, AdapterSpec, parse_safetensors_header
from loraplex.model_config import ALL_LINEAR_MODULES, ModelConfig

MODULE_INDEX = {name: i for i, name in enumerate(ALL_LINEAR_MODULES)}
TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# On CUDA a run of at least this many consecutive tokens of one adapter is computed as a segment
# (two plain matmuls reading the adapter once); the shorter runs of a step are gathered per token
# into one batched matmul pair per module, padded to the largest rank among them: a decode step is
# launch-bound on a GPU, and one gather per module costs a quarter of one per rank bucket
# (bench/lora_ops.py --device cuda). On CPU there are no launches to save and the gather's weight
# copies cost more than they save, so every run is a segment there.
MIN_SEGMENT_TOKENS = {"cuda": 8, "cpu": 1}
_TRANSPOSE_BLOCK_BYTES = 32 << 10  # a block of B's rows, transposed at once, stays in the L1 cache
# element size -> the integer type that moves its bits unchanged
_BITS = {
    1: np.int8,
    2: np.int16,
    4: np.int32,
}
_TORCH_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class PackedAdapter:
    """An adapter's A and scaled Bᵀ matrices in one contiguous host buffer, so a slot load is one
    copy."""

    buffer: torch.Tensor  # [numel]
    # (layer, module index, rank, offset of A, offset of Bᵀ)
    entries: tuple[tuple[int, int, int, int, int], ...]
    # per module index, the largest rank over layers (0: not targeted)
    module_ranks: tuple[int, ...]
    spec: AdapterSpec
    # every tensor's offset in `buffer`, by its key (a B's holds its scaled Bᵀ): the variants' and
    # DoRA's tensors are read from here
    offsets: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def tensor(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A view of one of its tensors, in the serving dtype."""
        begin = self.offsets[key]
        return self.buffer[begin : begin + math.prod(shape)].view(shape)


class LoraPair(NamedTuple):
    """The tensors of one LoRA: A as stored, B made into its scaled Bᵀ."""

    key_a: str
    key_b: str
    scaling: float


def lora_pairs(spec: AdapterSpec) -> list[LoraPair]:
    """Every LoRA of the adapter: the decoder modules' and the head modules'."""
    loras = [*spec.modules, *spec.variants.head_loras]
    return [LoraPair(m.key_a, m.key_b, m.scaling) for m in loras]


def plain_keys(spec: AdapterSpec) -> list[str]:
    """The tensors used as stored: DoRA's magnitudes, full weights, trainable tokens, expert
    LoRAs (scaled when a slot takes them)."""
    keys = [m.key_magnitude for m in spec.modules if m.key_magnitude is not None]
    keys += [key for e in spec.experts for key in (e.key_a, e.key_b)]
    return (
        keys
        + [f.key for f in spec.variants.full]
        + ([spec.variants.tokens.key] if spec.variants.tokens else [])
    )


def pack_adapter(
    spec: AdapterSpec,
    weights: bytearray | memoryview,
    dtype: torch.dtype,
    pin: bool = False,
    hashed: Callable[[int], None] | None = None,
) -> PackedAdapter:
    """Pack a validated safetensors file (never pickle) for a slot: A as stored, the scaling folded
    into Bᵀ.

    `spec` is what validating these `weights` gave (its layout is read again only when it holds
    none). When the file holds `dtype` already, the packing happens in place in `weights` (each B
    becomes its scaled Bᵀ in its own bytes), so a load makes no second host copy of the adapter;
    otherwise into a new buffer. Either way `weights` is consumed: pack bytes read for this load,
    never bytes kept for anything else. When the digest check is still running (`read_artifact`'s
    `use`), `hashed(end)` returns once it has read the first `end` bytes; it is called before any
    byte below `end` is overwritten.
    """
    layout = spec.layout if spec.layout is not None else parse_safetensors_header(weights)
    if memoryview(weights).readonly:
        weights = bytearray(weights)
    raw = torch.frombuffer(weights, dtype=torch.uint8)  # shares the bytes: a view, not a copy
    in_place = layout.data_start % dtype.itemsize == 0 and all(
        TORCH_DTYPES[info["dtype"]] == dtype for info in layout.tensors.values()
    )
    if in_place:
        # in file order, so that the waits for the digest check move forward with it
        pairs = sorted(lora_pairs(spec), key=lambda m: layout.tensors[m.key_b]["data_offsets"][0])
        _pack_in_place(layout, pairs, raw, dtype, hashed)
        buffer = raw[layout.data_start :].view(dtype)
        offsets = {
            key: info["data_offsets"][0] // dtype.itemsize for key, info in layout.tensors.items()
        }
    else:
        buffer, offsets = _pack_converted(layout, spec, raw, dtype, pin)
    entries = [
        (m.layer, MODULE_INDEX[m.module], m.rank, offsets[m.key_a], offsets[m.key_b])
        for m in spec.modules
    ]
    ranks = [0] * len(ALL_LINEAR_MODULES)
    for _, index, rank, _, _ in entries:
        ranks[index] = max(ranks[index], rank)
    if pin and in_place:
        buffer = buffer.pin_memory()
    return PackedAdapter(buffer, tuple(entries), tuple(ranks), spec, offsets)


def _pack_in_place(layout, pairs, raw: torch.Tensor, dtype: torch.dtype, hashed) -> None:
    """Each B's bytes receive its scaled Bᵀ (A stays as stored). The work is in numpy, whose calls
    cost a tenth of torch's: a small adapter is a few hundred of them, which in torch took longer
    than moving its bytes."""
    data = raw.numpy()[layout.data_start :]
    bits = _BITS[dtype.itemsize]  # bit patterns move unchanged
    numel = max((math.prod(layout.tensors[m.key_b]["shape"]) for m in pairs), default=0)
    scratch = np.empty(numel, dtype=bits)
    scratch_torch = torch.from_numpy(scratch).view(dtype)
    with np.errstate(all="ignore"):
        # an overflow gives inf, as torch's product does, without a warning
        for m in pairs:
            _pack_module(m, layout, data, bits, scratch, scratch_torch, dtype, hashed)


def _pack_module(
    m,
    layout,
    data: np.ndarray,
    bits,
    scratch: np.ndarray,
    scratch_torch: torch.Tensor,
    dtype: torch.dtype,
    hashed,
) -> None:
    """One LoRA's B, in its own bytes, becomes its scaled Bᵀ."""
    begin_b, end_b = layout.tensors[m.key_b]["data_offsets"]
    d_out, rank = layout.tensors[m.key_b]["shape"]
    b = data[begin_b:end_b].view(bits).reshape(d_out, rank)
    scaled = scratch[: d_out * rank].reshape(d_out, rank)
    # b's own bytes receive Bᵀ, so it is scaled into scratch first (one rounding, in dtype)
    if dtype == torch.float32:  # numpy's product with a float32 factor is torch's, bit for bit
        np.multiply(b.view(np.float32), np.float32(m.scaling), out=scaled.view(np.float32))
    else:  # numpy has no bfloat16, and rounds a half factor to half first
        torch.mul(
            torch.from_numpy(b).view(dtype),
            m.scaling,
            out=scratch_torch[: d_out * rank].view(d_out, rank),
        )
    if hashed is not None:
        hashed(layout.data_start + end_b)
    _transpose_into(data[begin_b:end_b].view(bits).reshape(rank, d_out), scaled)


def _pack_converted(layout, spec: AdapterSpec, raw: torch.Tensor, dtype: torch.dtype, pin: bool):
    """A new buffer in `dtype`: each A and plain tensor converted, each Bᵀ an exact float32
    product rounded once by the copy. Returns it and each tensor's offset in it."""

    def stored(key: str) -> torch.Tensor:
        info = layout.tensors[key]
        begin, end = (layout.data_start + offset for offset in info["data_offsets"])
        data = raw[begin:end]
        if begin % DTYPE_BYTES[info["dtype"]]:
            # safetensors aligns tensors; a hand-made file may not
            data = data.clone()
        return data.view(TORCH_DTYPES[info["dtype"]]).view(info["shape"])

    pairs = lora_pairs(spec)
    numels = {key: math.prod(info["shape"]) for key, info in layout.tensors.items()}
    keys = [key for m in pairs for key in (m.key_a, m.key_b)] + plain_keys(spec)
    buffer = torch.empty(sum(numels[key] for key in keys), dtype=dtype, pin_memory=pin)
    offset_of = dict(zip(keys, itertools.accumulate((numels[key] for key in keys), initial=0)))
    scaled = {m.key_b: m.scaling for m in pairs}
    for key in keys:
        t, off = stored(key), offset_of[key]
        if key in scaled:  # b: [d_out, r] -> scaled bᵀ: [r, d_out]
            t = (t.float() * scaled[key]).t()
        buffer[off : off + numels[key]].view(t.shape).copy_(t)
    return buffer, offset_of


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor's memory as a numpy array of integers of its element size (the bits,
    unchanged)."""
    return tensor.view(_TORCH_BITS[tensor.element_size()]).numpy()


def _transpose_into(out: np.ndarray, x: np.ndarray) -> None:
    """out = xᵀ for arrays of one bit type. numpy's copy is used because for a narrow x (B is
    [d_out, r], r of 8 or 16) it runs about three times as fast as torch's transposing copy_. It
    goes by blocks of rows that fit in the L1 cache: for r = 64 that is 2-2.5 times as fast as one
    transposing copy (bench/adapter_load.py)."""
    # x: [d_out, r], out: [r, d_out]
    rows = max(1, _TRANSPOSE_BLOCK_BYTES // (x.shape[1] * x.itemsize))
    for start in range(0, x.shape[0], rows):
        np.copyto(out[:, start : start + rows], x[start : start + rows].T)


class LoRASlotPool:
    """`max_loras` slots in one preallocated device buffer; each slot holds every module padded to
    max rank."""

    def __init__(
        self, model: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype, device
    ):
        self.model = model
        self.num_slots = max_loras
        self.max_rank = max_rank
        offsets, numel = {}, 0
        for layer in range(model.num_layers):
            for index, name in enumerate(ALL_LINEAR_MODULES):
                d_in, d_out = model.slot_shape(name)
                offsets[layer, index] = (numel, numel + max_rank * d_in)
                numel += max_rank * (d_in + d_out)
        self.slot_numel = numel
        self.buffer = torch.zeros(max_loras, numel, dtype=dtype, device=device)
        # a[layer][module]: [max_loras, max_rank, d_in]; bt[layer][module]: [max_loras, max_rank,
        # d_out], by MODULE_INDEX (d_in = d_out = 0 for a module the base does not have: a split
        # base has no qkv_proj, a fused one no q_proj)
        self.a: list[list[torch.Tensor]] = []
        self.bt: list[list[torch.Tensor]] = []
        for layer in range(model.num_layers):
            row_a, row_bt = [], []
            for index, name in enumerate(ALL_LINEAR_MODULES):
                d_in, d_out = model.slot_shape(name)
                off_a, off_b = offsets[layer, index]
                row_a.append(
                    self.buffer[:, off_a : off_a + max_rank * d_in].view(max_loras, max_rank, d_in)
                )
                row_bt.append(
                    self.buffer[:, off_b : off_b + max_rank * d_out].view(
                        max_loras, max_rank, d_out
                    )
                )
            self.a.append(row_a)
            self.bt.append(row_bt)
        self.module_ranks: list[tuple[int, ...]] = [(0,) * len(ALL_LINEAR_MODULES)] * max_loras
        self.heads = SlotHeads(max_loras)
        self.experts = ExpertSlots(max_loras)
        self.dora = DoraScales(model, max_loras, dtype, device)
        # On the host, slot writes go through numpy views of the same memory (bit patterns: numpy
        # has no bfloat16): a small adapter is a hundred or so copies, and numpy's calls cost a
        # tenth of torch's.
        self._host_rows = None
        if self.buffer.device.type == "cpu":
            self._host_rows = tuple(
                [[_bits(t) for t in row] for row in rows] for rows in (self.a, self.bt)
            )

    @property
    def slot_bytes(self) -> int:
        return self.slot_numel * self.buffer.element_size()

    def set_slot(self, slot: int, packed: PackedAdapter) -> None:
        self._zero_rows(slot, {(layer, index): rank for layer, index, rank, _, _ in packed.entries})
        if self._host_rows is None:
            (rows_a, rows_bt), copy = (self.a, self.bt), torch.Tensor.copy_
            staging = packed.buffer.to(self.buffer.device, non_blocking=True)
        else:
            (rows_a, rows_bt), copy = self._host_rows, np.copyto
            staging = _bits(packed.buffer)
        for layer, index, rank, off_a, off_b in packed.entries:
            a, bt = rows_a[layer][index], rows_bt[layer][index]
            copy(
                a[slot, :rank], staging[off_a : off_a + rank * a.shape[2]].reshape(rank, a.shape[2])
            )
            copy(
                bt[slot, :rank],
                staging[off_b : off_b + rank * bt.shape[2]].reshape(rank, bt.shape[2]),
            )
        self.module_ranks[slot] = packed.module_ranks
        self.heads.slots[slot] = head_tensors(packed, self.model, self.buffer.device)
        self.experts.set_slot(slot, packed, self.model, self.buffer.device)
        self.dora.set_slot(slot, packed, self.a, self.bt)

    def clear_slot(self, slot: int) -> None:
        self._zero_rows(slot, {})
        self.module_ranks[slot] = (0,) * len(ALL_LINEAR_MODULES)
        self.heads.slots[slot] = None
        self.experts.clear_slot(slot)
        self.dora.clear_slot(slot)

    def _zero_rows(self, slot: int, kept: dict[tuple[int, int], int]) -> None:
        """Zero the rows the slot's adapter wrote, except the first `kept[layer, module]` (about to
        be overwritten).

        Rows past an adapter's rank must read as zero (a gathered decode reads up to the step's
        largest rank). They are kept zero, so only rows below the slot's recorded ranks can hold
        data: zeroing those alone costs a pass over what the old adapter wrote instead of over the
        whole max-rank slot.
        """
        rows_a, rows_bt = self._host_rows or (self.a, self.bt)
        for index, old_rank in enumerate(self.module_ranks[slot]):
            for layer in range(self.model.num_layers):
                rank = kept.get((layer, index), 0)
                if rank < old_rank:
                    rows_a[layer][index][slot, rank:old_rank] = 0
                    rows_bt[layer][index][slot, rank:old_rank] = 0


@dataclass
class LoraGroups:
    """How one module's LoRA is computed in one step."""

    # (start, end, slot, rank)
    segments: list[tuple[int, int, int, int]] = field(default_factory=list)
    # (tokens, slots, rank)
    gathered: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)
    # each token's row of DoRA's scale tables, when a token's adapter has DoRA on the module
    dora_rows: torch.Tensor | None = None


def build_lora_groups(
    token_slots: list[int],
    module_ranks: list[tuple[int, ...]],
    device,
    min_segment: int | None = None,
    dora_rows: list[torch.Tensor | None] | None = None,
) -> list[LoraGroups] | None:
    """Per module index, the segments and the gather for a step; None when no token has an adapter.

    The gather's token and slot indices are the same tensors for every module (built once per step):
    a slot's rows past its rank are zero, so a token whose adapter does not target a module adds
    nothing there."""
    if min_segment is None:
        min_segment = MIN_SEGMENT_TOKENS.get(torch.device(device).type, 8)
    runs, start = [], 0
    for i in range(1, len(token_slots) + 1):
        if i == len(token_slots) or token_slots[i] != token_slots[start]:
            if token_slots[start] != EMPTY_SLOT:
                runs.append((start, i, token_slots[start]))
            start = i
    if not runs:
        return None
    short = [(begin, end, slot) for begin, end, slot in runs if end - begin < min_segment]
    gather = None
    if short:
        tokens = [t for begin, end, _ in short for t in range(begin, end)]
        slots = [slot for begin, end, slot in short for _ in range(begin, end)]
        gather = (torch.tensor(tokens, device=device), torch.tensor(slots, device=device))
        short_slots = {slot for _, _, slot in short}
    groups = []
    for index in range(len(module_ranks[runs[0][2]])):  # per module index
        group = LoraGroups(dora_rows=dora_rows[index] if dora_rows else None)
        for begin, end, slot in runs:
            rank = module_ranks[slot][index]
            if rank and end - begin >= min_segment:
                group.segments.append((begin, end, slot, rank))
        if gather is not None:
            rank = max(module_ranks[s][index] for s in short_slots)
            if rank:
                group.gathered.append((*gather, rank))
        groups.append(group)
    return groups


def add_lora(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, group: LoraGroups
) -> None:
    """y += x·Aᵀ·Bᵀ per token's adapter, in place. x: [T, d_in], y: [T, d_out]."""
    for start, end, slot, rank in group.segments:
        y[start:end] += (x[start:end] @ a[slot, :rank].t()) @ bt[slot, :rank]
    for tokens, slots, rank in group.gathered:
        xa = torch.bmm(x[tokens].unsqueeze(1), a[slots, :rank].transpose(1, 2))  # [n, 1, rank]
        y.index_add_(0, tokens, torch.bmm(xa, bt[slots, :rank]).squeeze(1))


def add_lora_reference(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, token_slots: list[int]
):
    """The simplest per-token loop; the oracle the batched op is tested against."""
    for t, slot in enumerate(token_slots):
        if slot != EMPTY_SLOT:
            y[t] += (x[t] @ a[slot].t()) @ bt[slot]
