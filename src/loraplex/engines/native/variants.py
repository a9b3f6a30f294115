"""The LoRA variants on the device, per slot: the head modules' tensors (LoRA on lm_head and
embed_tokens, full weights, trainable tokens) and DoRA's scales, applied per token's adapter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from loraplex.lora_format import AdapterSpec
from loraplex.model_config import ALL_LINEAR_MODULES, ModelConfig

EMPTY_SLOT = -1


class HostCopy(Protocol):
    """What the variants read of an adapter's packed host copy (`lora.PackedAdapter`)."""

    @property
    def spec(self) -> AdapterSpec: ...

    def tensor(self, key: str, shape: tuple[int, ...]) -> torch.Tensor: ...


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, slot) of each run of equal slots, the empty slot's left out."""
    runs, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            if slots[start] != EMPTY_SLOT:
                runs.append((start, i, slots[start]))
            start = i
    return runs


@dataclass
class HeadTensors:
    """One slot's own tensors for the embedding and lm_head (None: the base's alone)."""

    # lm_head: A [r, hidden], scaled Bᵀ [r, vocab]; embed_tokens: A [r, vocab], Bᵀ [r, hidden]
    lm_lora: tuple[torch.Tensor, torch.Tensor] | None = None
    embed_lora: tuple[torch.Tensor, torch.Tensor] | None = None
    lm_full: torch.Tensor | None = None  # [vocab, hidden]
    embed_full: torch.Tensor | None = None  # [vocab, hidden]
    token_ids: torch.Tensor | None = None  # [n] the trainable tokens
    token_rows: torch.Tensor | None = None  # [n, hidden] their embedding rows
    tied: bool = False  # the token rows replace lm_head's rows too

    @property
    def on_embedding(self) -> bool:
        return self.embed_lora is not None or self.embed_full is not None or self.has_tokens

    @property
    def on_lm_head(self) -> bool:
        tied_tokens = self.has_tokens and self.tied
        return self.lm_lora is not None or self.lm_full is not None or tied_tokens

    @property
    def has_tokens(self) -> bool:
        return self.token_ids is not None


def head_tensors(packed: HostCopy, model: ModelConfig, device) -> HeadTensors | None:
    """The adapter's head tensors on `device` (views of its host copy where that is the device)."""
    variants = packed.spec.variants
    if variants.empty:
        return None

    def on_device(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        return packed.tensor(key, shape).to(device, non_blocking=True)

    vocab, hidden = model.vocab_size, model.hidden_size
    heads = HeadTensors()
    for h in variants.head_loras:
        d_in, d_out = (hidden, vocab) if h.module == "lm_head" else (vocab, hidden)
        pair = (on_device(h.key_a, (h.rank, d_in)), on_device(h.key_b, (h.rank, d_out)))
        if h.module == "lm_head":
            heads.lm_lora = pair
        else:
            heads.embed_lora = pair
    for f in variants.full:
        weight = on_device(f.key, (vocab, hidden))
        if f.module == "lm_head":
            heads.lm_full = weight
        else:
            heads.embed_full = weight
    if variants.tokens is not None:
        tokens = variants.tokens
        heads.token_ids = torch.tensor(tokens.indices, device=device)
        heads.token_rows = on_device(tokens.key, (len(tokens.indices), hidden))
        heads.tied = tokens.tied
    return heads


class SlotHeads:
    """Per slot, the adapter's head tensors on the device. They live outside the slot pool's
    buffer: each is as large as the vocabulary, and few adapters carry them."""

    def __init__(self, num_slots: int):
        self.slots: list[HeadTensors | None] = [None] * num_slots

    def any_in(self, slots: list[int]) -> bool:
        if all(heads is None for heads in self.slots):  # the plain adapters' steps stop here
            return False
        return any(s != EMPTY_SLOT and self.slots[s] is not None for s in set(slots))

    def embed(self, ids: torch.Tensor, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """x: [T, hidden], the base's embeddings of ids [T], with each token's adapter's
        embedding changes made (in place)."""
        for start, end, slot in slot_runs(slots):
            heads = self.slots[slot]
            if heads is None or not heads.on_embedding:
                continue
            rows = ids[start:end]
            if heads.embed_full is not None:
                x[start:end] = heads.embed_full[rows]
            if heads.embed_lora is not None:
                a, bt = heads.embed_lora
                x[start:end] += a[:, rows].t() @ bt  # [L, r] @ [r, hidden]
            if heads.token_ids is not None and heads.token_rows is not None:
                hits = rows[:, None] == heads.token_ids[None, :]  # [L, n]
                hit, which = hits.any(1), hits.int().argmax(1)
                x[start:end][hit] = heads.token_rows[which[hit]]
        return x

    def logits(self, hidden: torch.Tensor, logits: torch.Tensor, slots: list[int]) -> None:
        """logits: [N, vocab], the base's of hidden [N, hidden], made each row's adapter's (in
        place)."""
        for start, end, slot in slot_runs(slots):
            heads = self.slots[slot]
            if heads is None or not heads.on_lm_head:
                continue
            h = hidden[start:end]
            if heads.lm_full is not None:
                logits[start:end] = h @ heads.lm_full.t()
            if heads.lm_lora is not None:
                a, bt = heads.lm_lora
                logits[start:end] += (h @ a.t()) @ bt
            if heads.tied and heads.token_ids is not None and heads.token_rows is not None:
                logits[start:end, heads.token_ids] = h @ heads.token_rows.t()


# (layer, module index, A [r, d_in], scaled Bᵀ [r, d_out]) -> ||W + s·B·A|| of each output row
NormOf = Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]


class DoraScales:
    """DoRA's per-slot scale m / ||W + s·B·A|| of every module's output rows. The last row of each
    table is the ones of the empty slot; a slot without DoRA holds ones too, so in a mixed step its
    rows come out as a plain LoRA's."""

    def __init__(self, model: ModelConfig, num_slots: int, dtype: torch.dtype, device):
        self.num_slots = num_slots
        # scales[layer][module]: [num_slots + 1, d_out]
        self.scales = [
            [
                torch.ones(num_slots + 1, model.slot_shape(name)[1], dtype=dtype, device=device)
                for name in ALL_LINEAR_MODULES
            ]
            for _ in range(model.num_layers)
        ]
        self.modules: list[tuple[bool, ...]] = [(False,) * len(ALL_LINEAR_MODULES)] * num_slots
        self.norm_of: NormOf | None = None  # the model's, given by `attach_lora`

    def set_slot(self, slot: int, packed: HostCopy, a_rows, bt_rows) -> None:
        """The slot's scales, from the A and Bᵀ rows just written to the slot (a_rows[layer][index]
        [slot, :rank]) and the adapter's magnitudes."""
        self.clear_slot(slot)
        has = [False] * len(ALL_LINEAR_MODULES)
        for m in packed.spec.modules:
            if m.key_magnitude is None:
                continue
            assert self.norm_of is not None, "DoRA needs the model attached to the slot pool"
            index = ALL_LINEAR_MODULES.index(m.module)
            a, bt = a_rows[m.layer][index][slot, : m.rank], bt_rows[m.layer][index][slot, : m.rank]
            norm = self.norm_of(m.layer, index, a, bt)
            table = self.scales[m.layer][index]
            magnitude = packed.tensor(m.key_magnitude, (table.shape[1],)).to(table.device)
            table[slot] = (magnitude.float() / norm).to(table.dtype)
            has[index] = True
        self.modules[slot] = tuple(has)

    def clear_slot(self, slot: int) -> None:
        for row in self.scales:
            for index, table in enumerate(row):
                if self.modules[slot][index]:
                    table[slot] = 1
        self.modules[slot] = (False,) * len(ALL_LINEAR_MODULES)

    def rows(self, slots: list[int], device) -> list[torch.Tensor | None]:
        """Per module index, each token's row of the scale tables when some token's adapter has
        DoRA there (None: none has)."""
        if not any(any(modules) for modules in self.modules):  # no DoRA adapter in a slot
            return [None] * len(ALL_LINEAR_MODULES)
        present = {s for s in slots if s != EMPTY_SLOT}
        wanted = [any(self.modules[s][i] for s in present) for i in range(len(ALL_LINEAR_MODULES))]
        if not any(wanted):
            return [None] * len(ALL_LINEAR_MODULES)
        rows = [self.num_slots if s == EMPTY_SLOT else s for s in slots]
        table_rows = torch.tensor(rows, device=device)
        return [table_rows if w else None for w in wanted]
