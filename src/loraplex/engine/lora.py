"""LoRA on the device: packed host copies, the slot pool, per-step batch metadata and the batched ops."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex.lora_format import DTYPE_BYTES, AdapterSpec, parse_safetensors_header
from loraplex.model_config import LINEAR_MODULES, ModelConfig

EMPTY_SLOT = -1
MODULE_INDEX = {name: i for i, name in enumerate(LINEAR_MODULES)}
TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# On CUDA a run of at least this many consecutive tokens of one adapter is computed as a segment (two plain
# matmuls reading the adapter once); the shorter runs of a step are gathered per token into one batched
# matmul pair per module, padded to the largest rank among them: a decode step is launch-bound on a GPU, and
# one gather per module costs a quarter of one per rank bucket (bench/lora_ops.py --device cuda). On CPU
# there are no launches to save and the gather's weight copies cost more than they save, so every run is a
# segment there.
MIN_SEGMENT_TOKENS = {"cuda": 8, "cpu": 1}
_TRANSPOSE_BLOCK_BYTES = 32 << 10  # a block of B's rows, transposed at once, stays in the L1 cache


@dataclass(frozen=True)
class PackedAdapter:
    """An adapter's A and scaled Bᵀ matrices in one contiguous host buffer, so a slot load is one copy."""

    buffer: torch.Tensor  # [numel]
    entries: tuple[tuple[int, int, int, int, int], ...]  # (layer, module index, rank, offset of A, offset of Bᵀ)
    module_ranks: tuple[int, ...]  # per module index, the largest rank over layers (0: not targeted)
    spec: AdapterSpec

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def pack_adapter(spec: AdapterSpec, weights: bytearray | memoryview, dtype: torch.dtype, pin: bool = False,
                 hashed: Callable[[int], None] | None = None) -> PackedAdapter:
    """Pack a validated safetensors file (never pickle) for a slot: A as stored, the scaling folded into Bᵀ.

    When the file holds `dtype` already, the packing happens in place in `weights` (each B becomes its scaled Bᵀ
    in its own bytes), so a load makes no second host copy of the adapter; otherwise into a new buffer. Either
    way `weights` is consumed: pack bytes read for this load, never bytes kept for anything else. When the digest
    check is still running (`read_artifact`'s `use`), `hashed(end)` returns once it has read the first `end` bytes;
    it is called before any byte below `end` is overwritten.
    """
    layout = parse_safetensors_header(weights)
    if memoryview(weights).readonly:
        weights = bytearray(weights)
    raw = torch.frombuffer(weights, dtype=torch.uint8)  # shares the bytes: a view, not a copy
    in_place = layout.data_start % dtype.itemsize == 0 and all(
        TORCH_DTYPES[info["dtype"]] == dtype for info in layout.tensors.values()
    )

    def stored(key: str) -> torch.Tensor:
        info = layout.tensors[key]
        begin, end = (layout.data_start + offset for offset in info["data_offsets"])
        data = raw[begin:end]
        if begin % DTYPE_BYTES[info["dtype"]]:  # safetensors aligns tensors; a hand-made file may not
            data = data.clone()
        return data.view(TORCH_DTYPES[info["dtype"]]).view(info["shape"])

    numels = {key: math.prod(info["shape"]) for key, info in layout.tensors.items()}
    if in_place:
        buffer = raw[layout.data_start :].view(dtype)
        offset_of = {key: info["data_offsets"][0] // dtype.itemsize for key, info in layout.tensors.items()}
        scratch = torch.empty(max(numels[m.key_b] for m in spec.modules), dtype=dtype)
    else:
        keys = [key for m in spec.modules for key in (m.key_a, m.key_b)]
        buffer = torch.empty(sum(numels.values()), dtype=dtype, pin_memory=pin)
        offset_of = dict(zip(keys, itertools.accumulate((numels[key] for key in keys), initial=0)))
    entries = []
    ranks = [0] * len(LINEAR_MODULES)
    # in file order, so that the waits for the digest check move forward with it
    for m in sorted(spec.modules, key=lambda m: layout.tensors[m.key_b]["data_offsets"][0]):
        a, b = stored(m.key_a), stored(m.key_b)  # a: [r, d_in], b: [d_out, r]
        off_a, off_b = offset_of[m.key_a], offset_of[m.key_b]
        bt = buffer[off_b : off_b + b.numel()].view(b.shape[1], b.shape[0])  # [r, d_out]
        if in_place:  # b's own bytes receive Bᵀ, so it is scaled into scratch first (one rounding, in dtype)
            torch.mul(b, m.scaling, out=scratch[: b.numel()].view(b.shape))
            if hashed is not None:
                hashed(layout.data_start + layout.tensors[m.key_b]["data_offsets"][1])
            _transpose_into(bt, scratch[: b.numel()].view(b.shape))
        else:  # an exact float32 product, rounded once by the copy into dtype
            buffer[off_a : off_a + a.numel()].view(a.shape).copy_(a)
            bt.copy_((b.float() * m.scaling).t())
        index = MODULE_INDEX[m.module]
        entries.append((m.layer, index, m.rank, off_a, off_b))
        ranks[index] = max(ranks[index], m.rank)
    if pin and in_place:
        buffer = buffer.pin_memory()
    return PackedAdapter(buffer, tuple(entries), tuple(ranks), spec)


def _transpose_into(out: torch.Tensor, x: torch.Tensor) -> None:
    """out = xᵀ for host tensors of one dtype. numpy's copy is used because for a narrow x (B is [d_out, r], r of 8
    or 16) it runs about three times as fast as torch's transposing copy_. It goes by blocks of rows that fit in
    the L1 cache: for r = 64 that is 2-2.5 times as fast as one transposing copy (bench/adapter_load.py)."""
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32}[x.element_size()]  # bit patterns move unchanged
    src, dst = x.view(as_int).numpy(), out.view(as_int).numpy()  # src: [d_out, r], dst: [r, d_out]
    rows = max(1, _TRANSPOSE_BLOCK_BYTES // (src.shape[1] * src.itemsize))
    for start in range(0, src.shape[0], rows):
        np.copyto(dst[:, start : start + rows], src[start : start + rows].T)


class LoRASlotPool:
    """`max_loras` slots in one preallocated device buffer; each slot holds every module padded to max rank."""

    def __init__(self, model: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype, device):
        self.model = model
        self.num_slots = max_loras
        self.max_rank = max_rank
        offsets, numel = {}, 0
        for layer in range(model.num_layers):
            for index, name in enumerate(LINEAR_MODULES):
                d_in, d_out = model.linear_shape(name)
                offsets[layer, index] = (numel, numel + max_rank * d_in)
                numel += max_rank * (d_in + d_out)
        self.slot_numel = numel
        self.buffer = torch.zeros(max_loras, numel, dtype=dtype, device=device)
        # a[layer][module]: [max_loras, max_rank, d_in]; bt[layer][module]: [max_loras, max_rank, d_out]
        self.a: list[list[torch.Tensor]] = []
        self.bt: list[list[torch.Tensor]] = []
        for layer in range(model.num_layers):
            row_a, row_bt = [], []
            for index, name in enumerate(LINEAR_MODULES):
                d_in, d_out = model.linear_shape(name)
                off_a, off_b = offsets[layer, index]
                row_a.append(self.buffer[:, off_a : off_a + max_rank * d_in].view(max_loras, max_rank, d_in))
                row_bt.append(self.buffer[:, off_b : off_b + max_rank * d_out].view(max_loras, max_rank, d_out))
            self.a.append(row_a)
            self.bt.append(row_bt)
        self.module_ranks: list[tuple[int, ...]] = [(0,) * len(LINEAR_MODULES)] * max_loras

    @property
    def slot_bytes(self) -> int:
        return self.slot_numel * self.buffer.element_size()

    def set_slot(self, slot: int, packed: PackedAdapter) -> None:
        self._zero_rows(slot, {(layer, index): rank for layer, index, rank, _, _ in packed.entries})
        staging = packed.buffer.to(self.buffer.device, non_blocking=True)
        for layer, index, rank, off_a, off_b in packed.entries:
            a, bt = self.a[layer][index], self.bt[layer][index]
            a[slot, :rank].copy_(staging[off_a : off_a + rank * a.shape[2]].view(rank, a.shape[2]))
            bt[slot, :rank].copy_(staging[off_b : off_b + rank * bt.shape[2]].view(rank, bt.shape[2]))
        self.module_ranks[slot] = packed.module_ranks

    def clear_slot(self, slot: int) -> None:
        self._zero_rows(slot, {})
        self.module_ranks[slot] = (0,) * len(LINEAR_MODULES)

    def _zero_rows(self, slot: int, kept: dict[tuple[int, int], int]) -> None:
        """Zero the rows the slot's adapter wrote, except the first `kept[layer, module]` (about to be overwritten).

        Rows past an adapter's rank must read as zero (a gathered decode reads up to the step's largest rank). They
        are kept zero, so only rows below the slot's recorded ranks can hold data: zeroing those alone costs a pass
        over what the old adapter wrote instead of over the whole max-rank slot.
        """
        for index, old_rank in enumerate(self.module_ranks[slot]):
            for layer in range(self.model.num_layers):
                rank = kept.get((layer, index), 0)
                if rank < old_rank:
                    self.a[layer][index][slot, rank:old_rank].zero_()
                    self.bt[layer][index][slot, rank:old_rank].zero_()


@dataclass
class LoraGroups:
    """How one module's LoRA is computed in one step."""

    segments: list[tuple[int, int, int, int]] = field(default_factory=list)  # (start, end, slot, rank)
    gathered: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)  # (tokens, slots, rank)


def build_lora_groups(token_slots: list[int], module_ranks: list[tuple[int, ...]], device,
                      min_segment: int | None = None) -> list[LoraGroups] | None:
    """Per module index, the segments and the gather for a step; None when no token has an adapter.

    The gather's token and slot indices are the same tensors for every module (built once per step): a slot's rows
    past its rank are zero, so a token whose adapter does not target a module adds nothing there."""
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
    for index in range(len(LINEAR_MODULES)):
        group = LoraGroups()
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


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, group: LoraGroups) -> None:
    """y += x·Aᵀ·Bᵀ per token's adapter, in place. x: [T, d_in], y: [T, d_out]."""
    for start, end, slot, rank in group.segments:
        y[start:end] += (x[start:end] @ a[slot, :rank].t()) @ bt[slot, :rank]
    for tokens, slots, rank in group.gathered:
        xa = torch.bmm(x[tokens].unsqueeze(1), a[slots, :rank].transpose(1, 2))  # [n, 1, rank]
        y.index_add_(0, tokens, torch.bmm(xa, bt[slots, :rank]).squeeze(1))


def add_lora_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, token_slots: list[int]):
    """The simplest per-token loop; the oracle the batched op is tested against."""
    for t, slot in enumerate(token_slots):
        if slot != EMPTY_SLOT:
            y[t] += (x[t] @ a[slot].t()) @ bt[slot]
