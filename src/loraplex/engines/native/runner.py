"""Turns a scheduled batch into tensors, runs the model, returns each sequence's next-token
logits."""

from __future__ import annotations

from typing import NamedTuple

import torch

from loraplex.engines.native.block_manager import BlockManager
from loraplex.engines.native.lora import LoRASlotPool, build_lora_groups
from loraplex.engines.native.model import AttentionMeta, CausalLM, GatherBuffers, PrefillSpan
from loraplex.engines.native.scheduler import ScheduledBatch
from loraplex.engines.native.sequence import Sequence


class PromptLogits(NamedTuple):
    """Logits [n, V] of a prefill chunk that predict the prompt's tokens start + 1 .. start + n."""

    seq: Sequence
    start: int
    logits: torch.Tensor


class StepLogits(NamedTuple):
    seqs: list[Sequence]
    """The sequences whose last token the step computed (decodes, prefills done), ordered by adapter
    slot."""
    logits: torch.Tensor
    """[B, V] their next-token logits (with all_tokens, [T, V] of every token of the step)."""
    prompt_logits: list[PromptLogits]
    """For the prefill chunks of the sequences that ask for prompt logprobs."""


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
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(cfg.num_layers)
        ]
        block_numel = blocks.block_size * cfg.num_kv_heads * cfg.head_dim
        self.buffers = GatherBuffers(block_numel, dtype, device)

    def _slots(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """[end - start] flat KV-cache positions of the sequence's tokens start .. end - 1."""
        size = self.blocks.block_size
        index = torch.arange(start, end)
        table = torch.tensor(seq.block_table[: -(-end // size)])
        return table[index // size] * size + index % size

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV blocks (source, destination) in every layer: a forked sequence's own copy of a
        shared block."""
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in (c for kv in self.kv_caches for c in kv):
            by_block = cache.view(self.blocks.num_blocks, -1)  # [num_blocks, block numel]
            by_block[dst] = by_block[src]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, all_tokens: bool = False) -> StepLogits:
        """The batch's sequences, ordered by adapter slot, and their next-token logits [B, V].

        With all_tokens, the logits of every token of the step instead ([T, V], sequences in the
        returned order).
        """
        # Tokens of one adapter sit together so the LoRA ops see long segments.
        prefills = sorted(batch.prefills, key=lambda s: s.lora_slot)
        decodes = sorted(batch.decodes, key=lambda s: s.lora_slot)
        ids, positions, slots, token_slots, prefill_spans, last = [], [], [], [], [], []
        # prefills whose chunk ends the sequence: their logits are sampled
        done: list[Sequence] = []
        dev, size = self.device, self.blocks.block_size
        for seq in prefills:
            start, n = seq.num_computed, seq.num_scheduled
            end = start + n
            context = (
                torch.tensor(seq.block_table[: -(-end // size)], device=dev) if start else None
            )
            prefill_spans.append(PrefillSpan(len(ids), n, start, context))
            ids += seq.all_ids[start:end]
            positions += range(start, end)
            slots.append(self._slots(seq, start, end))
            token_slots += [seq.lora_slot] * n
            if end == len(seq):
                done.append(seq)
                last.append(len(ids) - 1)
        decode_start = len(ids)
        # Decoding rows: one token each, its KV position from the last block of its table.
        lens = [len(s) for s in decodes]
        ids += [s.last_token for s in decodes]
        positions += [n - 1 for n in lens]
        slots.append(_decode_slots(decodes, lens, size))
        token_slots += [s.lora_slot for s in decodes]
        last += range(decode_start, len(ids))
        attn = AttentionMeta(
            slot_mapping=torch.cat(slots).to(dev),
            positions=torch.tensor(positions, device=dev),
            prefills=prefill_spans,
            block_size=size,
            buffers=self.buffers,
            decode_start=decode_start,
            decode_tables=[s.block_table for s in decodes],
            decode_lens=lens,
        )
        dora_rows = self.pool.dora.rows(token_slots, dev)
        lora = build_lora_groups(token_slots, self.pool.module_ranks, dev, dora_rows=dora_rows)
        hidden = self.model(torch.tensor(ids, device=dev), attn, self.kv_caches, lora, token_slots)
        last_rows = torch.tensor(last, dtype=torch.long, device=dev)
        if all_tokens:
            logits = self.model.logits(hidden, token_slots)
        else:
            logits = self.model.logits(hidden[last_rows], [token_slots[i] for i in last])
        prompt_logits = self._prompt_logits(prefills, prefill_spans, hidden)
        return StepLogits((prefills if all_tokens else done) + decodes, logits, prompt_logits)

    def _prompt_logits(self, prefills, spans, hidden) -> list[PromptLogits]:
        """The logits of the prompt rows of the prefills that asked for prompt logprobs."""
        out = []
        for seq, span in zip(prefills, spans):
            # rows predicting prompt
            wanted = min(span.start + span.length, len(seq.prompt_ids) - 1) - span.start
            # not a recompute
            if seq.params.prompt_logprobs is not None and not seq.output_ids and wanted > 0:
                rows = hidden[span.first : span.first + wanted]
                logits = self.model.logits(rows, [seq.lora_slot] * wanted)
                out.append(PromptLogits(seq, span.start, logits))
        return out


def _decode_slots(decodes, lens: list[int], size: int) -> torch.Tensor:
    """The KV cache slot of each decoding row's one token: from the last block of its table."""
    return torch.tensor(
        [s.block_table[(n - 1) // size] * size + (n - 1) % size for s, n in zip(decodes, lens)],
        dtype=torch.long,
    )
