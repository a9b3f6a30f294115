"""Turns a scheduled batch into tensors, runs the model, returns each sequence's next-token logits."""

from __future__ import annotations

from typing import NamedTuple

import torch

from loraplex.engine.block_manager import BlockManager
from loraplex.engine.lora import LoRASlotPool, build_lora_groups
from loraplex.engine.model import AttentionMeta, CausalLM
from loraplex.engine.scheduler import ScheduledBatch
from loraplex.engine.sequence import Sequence


class StepLogits(NamedTuple):
    seqs: list[Sequence]
    """The batch's sequences, ordered by adapter slot."""
    logits: torch.Tensor
    """[B, V] next-token logits (with all_tokens, [T, V] of every token of the step)."""
    prompt_logits: dict[int, torch.Tensor]
    """For the prefilled sequences that ask for prompt logprobs (by position in `seqs`): [len(prompt) - 1, V],
    the logits that predict each prompt token after the first."""


def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype) -> int:
    cfg = model.config
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(self, model: CausalLM, pool: LoRASlotPool, blocks: BlockManager, dtype, device):
        self.model = model
        self.pool = pool
        self.blocks = blocks
        self.device = device
        cfg = model.config
        positions = blocks.num_blocks * blocks.block_size
        shape = (positions, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]

    def _kv_positions(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """[len(seqs), width] flat KV-cache positions of each sequence's first `width` tokens (0 past its end)."""
        size = self.blocks.block_size
        num_blocks = -(-width // size)
        table = torch.tensor([s.block_table[:num_blocks] + [0] * (num_blocks - len(s.block_table[:num_blocks]))
                              for s in seqs])
        index = torch.arange(width)
        return table[:, index // size] * size + index % size

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination) in every layer: a forked sequence's own copy of a shared block."""
        size = self.blocks.block_size
        offsets = torch.arange(size)
        src = torch.cat([s * size + offsets for s, _ in pairs]).to(self.device)
        dst = torch.cat([d * size + offsets for _, d in pairs]).to(self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, all_tokens: bool = False) -> StepLogits:
        """The batch's sequences, ordered by adapter slot, and their next-token logits [B, V].

        With all_tokens, the logits of every token of the step instead ([T, V], sequences in the returned order).
        """
        # Tokens of one adapter sit together so the LoRA ops see long segments.
        prefills = sorted(batch.prefills, key=lambda s: s.lora_slot)
        decodes = sorted(batch.decodes, key=lambda s: s.lora_slot)
        ids, positions, slots, token_slots, prefill_spans, last = [], [], [], [], [], []
        for seq in prefills:
            n = len(seq)
            prefill_spans.append((len(ids), n))
            ids += seq.all_ids
            positions += range(n)
            slots.append(self._kv_positions([seq], n)[0])
            token_slots += [seq.lora_slot] * n
            last.append(len(ids) - 1)
        decode_start = len(ids)
        # Decoding rows: one token each, its KV position from the last block of its table.
        lens = [len(s) for s in decodes]
        ids += [s.last_token for s in decodes]
        positions += [n - 1 for n in lens]
        size = self.blocks.block_size
        slots.append(torch.tensor([s.block_table[(n - 1) // size] * size + (n - 1) % size
                                   for s, n in zip(decodes, lens)], dtype=torch.long))
        token_slots += [s.lora_slot for s in decodes]
        last += range(decode_start, len(ids))
        dev = self.device
        attn = AttentionMeta(
            slot_mapping=torch.cat(slots).to(dev),
            positions=torch.tensor(positions, device=dev),
            prefills=prefill_spans,
        )
        if decodes:
            attn.decode_tokens = torch.arange(decode_start, len(ids), device=dev)
            attn.decode_lens = torch.tensor(lens, device=dev)
            attn.decode_kv = self._kv_positions(decodes, max(lens)).to(dev)
        lora = build_lora_groups(token_slots, self.pool.module_ranks, dev)
        hidden = self.model(torch.tensor(ids, device=dev), attn, self.kv_caches, lora)
        logits = self.model.logits(hidden if all_tokens else hidden[torch.tensor(last, device=dev)])
        prompt_logits = {
            i: self.model.logits(hidden[start : start + len(seq.prompt_ids) - 1])
            for i, (seq, (start, _)) in enumerate(zip(prefills, prefill_spans))
            if seq.params.prompt_logprobs is not None and seq.prompt_logprobs is None
        }
        return StepLogits(prefills + decodes, logits, prompt_logits)
