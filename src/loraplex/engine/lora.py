"""LoRA on the device: packed host copies, the slot pool, per-step batch metadata and the batched ops."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file

from loraplex.lora_format import WEIGHTS_FILE, AdapterSpec
from loraplex.model_config import LINEAR_MODULES, ModelConfig

EMPTY_SLOT = -1
MODULE_INDEX = {name: i for i, name in enumerate(LINEAR_MODULES)}
# On CUDA a run of at least this many consecutive tokens of one adapter is computed as a segment (two plain
# matmuls reading the adapter once); shorter runs are gathered per token and batched by rank bucket, which
# saves kernel launches. On CPU there are no launches to save and the gather's weight copies cost more than
# they save (bench/lora_ops.py), so every run is a segment there.
MIN_SEGMENT_TOKENS = {"cuda": 8, "cpu": 1}


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


def pack_adapter(spec: AdapterSpec, model: ModelConfig, dtype: torch.dtype, pin: bool = False) -> PackedAdapter:
    """Read the adapter's safetensors (never pickle) into one buffer; the scaling is folded into Bᵀ."""
    tensors = load_file(str(spec.path / WEIGHTS_FILE))
    parts, entries, offset = [], [], 0
    ranks = [0] * len(LINEAR_MODULES)
    for m in spec.modules:
        a = tensors[m.key_a].to(torch.float32)  # [r, d_in]
        bt = (tensors[m.key_b].to(torch.float32) * m.scaling).t()  # [r, d_out]
        index = MODULE_INDEX[m.module]
        entries.append((m.layer, index, m.rank, offset, offset + a.numel()))
        parts += [a.reshape(-1), bt.reshape(-1)]
        offset += a.numel() + bt.numel()
        ranks[index] = max(ranks[index], m.rank)
    buffer = torch.cat(parts).to(dtype)
    if pin:
        buffer = buffer.pin_memory()
    return PackedAdapter(buffer, tuple(entries), tuple(ranks), spec)


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
        self.clear_slot(slot)
        staging = packed.buffer.to(self.buffer.device, non_blocking=True)
        for layer, index, rank, off_a, off_b in packed.entries:
            a, bt = self.a[layer][index], self.bt[layer][index]
            a[slot, :rank].copy_(staging[off_a : off_a + rank * a.shape[2]].view(rank, a.shape[2]))
            bt[slot, :rank].copy_(staging[off_b : off_b + rank * bt.shape[2]].view(rank, bt.shape[2]))
        self.module_ranks[slot] = packed.module_ranks

    def clear_slot(self, slot: int) -> None:
        self.buffer[slot].zero_()
        self.module_ranks[slot] = (0,) * len(LINEAR_MODULES)


@dataclass
class LoraGroups:
    """How one module's LoRA is computed in one step."""

    segments: list[tuple[int, int, int, int]] = field(default_factory=list)  # (start, end, slot, rank)
    gathered: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)  # (tokens, slots, rank)


def _rank_bucket(rank: int) -> int:
    return max(8, 1 << (rank - 1).bit_length())


def build_lora_groups(token_slots: list[int], module_ranks: list[tuple[int, ...]], device,
                      min_segment: int | None = None) -> list[LoraGroups] | None:
    """Per module index, the segments and rank-bucketed gathers for a step; None when no token has an adapter."""
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
    groups = []
    for index in range(len(LINEAR_MODULES)):
        group = LoraGroups()
        buckets: dict[int, tuple[list[int], list[int]]] = {}
        for begin, end, slot in runs:
            rank = module_ranks[slot][index]
            if rank == 0:
                continue
            if end - begin >= min_segment:
                group.segments.append((begin, end, slot, rank))
            else:
                tokens, slots = buckets.setdefault(_rank_bucket(rank), ([], []))
                tokens.extend(range(begin, end))
                slots.extend([slot] * (end - begin))
        for bucket, (tokens, slots) in sorted(buckets.items()):
            rank = min(bucket, max(module_ranks[s][index] for s in set(slots)))
            group.gathered.append(
                (torch.tensor(tokens, device=device), torch.tensor(slots, device=device), rank)
            )
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
