"""Paged KV memory: fixed-size blocks handed to sequences as they grow."""

from __future__ import annotations

from collections import deque

from loraplex.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_for(len(seq)) <= self.num_free

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token the sequence has now (prompt, and output when recomputing)."""
        needed = self.blocks_for(len(seq)) - len(seq.block_table)
        seq.block_table.extend(self.free_blocks.popleft() for _ in range(needed))

    def can_append(self, seq: Sequence) -> bool:
        """Room for the token this step's decode writes (the last one, not yet in the cache)."""
        return len(seq.block_table) * self.block_size >= len(seq) or self.num_free > 0

    def append(self, seq: Sequence) -> None:
        if len(seq.block_table) * self.block_size < len(seq):
            seq.block_table.append(self.free_blocks.popleft())

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        seq.block_table = []

    def position(self, seq: Sequence, index: int) -> int:
        """Flat KV-cache position of the sequence's token `index`."""
        return seq.block_table[index // self.block_size] * self.block_size + index % self.block_size
