"""Paged KV memory: fixed-size blocks handed to sequences as they grow, shared between the sequences of one
prompt (n > 1) by reference counts."""

from __future__ import annotations

from collections import deque

from loraplex.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_for_group(self, num_tokens: int, num_seqs: int) -> int:
        """Blocks a prompt's sequences need once it is prefilled: its blocks, and one of its own for each further
        sequence (the copy of a partly filled last block, or the block its first token opens)."""
        return self.blocks_for(num_tokens) + num_seqs - 1

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_for_group(len(seq), seq.num_forks + 1) <= self.num_free

    def _take(self) -> int:
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token the sequence has now (prompt, and output when recomputing)."""
        needed = self.blocks_for(len(seq)) - len(seq.block_table)
        seq.block_table.extend(self._take() for _ in range(needed))

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """The child shares the parent's full blocks; a partly filled last block is copied, since both write
        their next tokens into it. Returns that (source, destination) block pair, for the runner to copy."""
        table = parent.block_table
        for block in table:
            self.ref_counts[block] += 1
        child.block_table = list(table)
        if len(parent) % self.block_size == 0:
            return None
        last = table[-1]
        self.ref_counts[last] -= 1
        child.block_table[-1] = self._take()
        return last, child.block_table[-1]

    def can_append(self, seq: Sequence) -> bool:
        """Room for the token this step's decode writes (the last one, not yet in the cache)."""
        return len(seq.block_table) * self.block_size >= len(seq) or self.num_free > 0

    def append(self, seq: Sequence) -> None:
        if len(seq.block_table) * self.block_size < len(seq):
            seq.block_table.append(self._take())

    def free(self, seq: Sequence) -> None:
        for block in seq.block_table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []

    def position(self, seq: Sequence, index: int) -> int:
        """Flat KV-cache position of the sequence's token `index`."""
        return seq.block_table[index // self.block_size] * self.block_size + index % self.block_size
