"""Paged KV memory: fixed-size blocks handed to sequences as they grow, shared by reference counts
between the sequences of one prompt (n > 1) and, through the prefix cache, between requests whose
prompts start alike.

A full prompt block is cached under a hash of every token up to its end and of the adapter's full
key (vLLM salts its block hashes by LoRA the same way), so a block is only ever shared by requests
of the same adapter revision. A cached block nobody holds stays findable until its memory is needed
(least recently freed first), or until its revision leaves the worker (`drop_prefixes`)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

from loraplex.engines.native.sequence import Sequence
from loraplex.residency.key import AdapterKey


def block_hash(parent: bytes, tokens: list[int], salt: str) -> bytes:
    """The hash of a full block: its tokens, the hash of the blocks before it, and the adapter's
    key."""
    return hashlib.sha256(repr((parent, tokens, salt)).encode()).digest()


def salt_of(seq: Sequence) -> str:
    return salt_of_key(seq.adapter.key) if seq.adapter is not None else "base"


def salt_of_key(key: AdapterKey) -> str:
    return repr(key)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> block
        self.hash_of: dict[int, bytes] = {}  # block -> its hash, for cached blocks
        self.salt_of: dict[int, str] = {}  # block -> its adapter's salt, for cached blocks
        self.evictable: OrderedDict[int, None] = (
            OrderedDict()
        )  # cached blocks nobody holds, oldest first
        self.num_hit_tokens = 0
        """Prompt tokens found in the prefix cache (not computed again), since the start."""
        self.num_query_tokens = 0
        """Tokens looked up in the prefix cache (each allocation's), since the start."""

    def prefix_figures(self) -> dict[str, int]:
        """vLLM's prefix-cache counts: tokens looked up, tokens found."""
        return {"queries": self.num_query_tokens, "hits": self.num_hit_tokens}

    @property
    def num_free(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1 - self.num_free / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_for_group(self, num_tokens: int, num_seqs: int) -> int:
        """Blocks a prompt's sequences need once it is prefilled: its blocks, and one of its own for
        each further sequence (the copy of a partly filled last block, or the block its first token
        opens)."""
        return self.blocks_for(num_tokens) + num_seqs - 1

    def prefix_hits(self, seq: Sequence) -> list[int]:
        """The cached blocks that hold the start of the sequence's prompt (at least its last token
        is left to compute, for its logits). None with prompt logprobs, whose every position must be
        computed."""
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hits, parent, salt = [], b"", salt_of(seq)
        size = self.block_size
        for i in range((min(len(seq.prompt_ids), len(seq)) - 1) // size):
            parent = block_hash(parent, seq.prompt_ids[i * size : (i + 1) * size], salt)
            block = self.cached.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: Sequence, hits: list[int] = ()) -> bool:
        """Room for the sequence (and its forks) beside the cached blocks it takes."""
        idle_hits = sum(
            1 for b in hits if b in self.evictable
        )  # taking them leaves less memory free
        needed = self.blocks_for_group(len(seq), seq.num_forks + 1) - len(hits)
        return needed <= self.num_free - idle_hits

    def _take(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:  # the least recently freed cached block gives its memory
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of.pop(block)]
            del self.salt_of[block]
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence, hits: list[int] = ()) -> None:
        """Blocks for every token the sequence has now (prompt, and output when recomputing), the
        cached `hits` first (their tokens are computed), and the copies of a partly filled last
        block that its forks take once its prefill is done (kept aside until then)."""
        for block in hits:
            self.evictable.pop(block, None)
            self.ref_counts[block] += 1
        seq.block_table = list(hits)
        seq.num_computed = len(hits) * self.block_size
        seq.num_hashed, seq.prefix_hash = len(hits), self.hash_of[hits[-1]] if hits else b""
        self.num_hit_tokens += seq.num_computed
        if self.prefix_caching:
            self.num_query_tokens += len(seq)
        needed = self.blocks_for(len(seq)) - len(seq.block_table)
        seq.block_table.extend(self._take() for _ in range(needed))
        if len(seq) % self.block_size:
            seq.fork_blocks = [self._take() for _ in range(seq.num_forks)]

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """The child shares the parent's full blocks; a partly filled last block is copied, since
        both write their next tokens into it. Returns that (source, destination) block pair, for the
        runner to copy."""
        table = parent.block_table
        for block in table:
            self.ref_counts[block] += 1
        child.block_table = list(table)
        if len(parent) % self.block_size == 0:
            return None
        last = table[-1]
        self.ref_counts[last] -= 1
        child.block_table[-1] = parent.fork_blocks.pop()
        return last, child.block_table[-1]

    def can_append(self, seq: Sequence) -> bool:
        """Room for the token this step's decode writes (the last one, not yet in the cache)."""
        return len(seq.block_table) * self.block_size >= len(seq) or self.num_free > 0

    def append(self, seq: Sequence) -> None:
        if len(seq.block_table) * self.block_size < len(seq):
            seq.block_table.append(self._take())

    def cache_computed(self, seq: Sequence) -> None:
        """Cache the sequence's prompt blocks that are full and computed, under their hashes."""
        if not self.prefix_caching:
            return
        size, salt = self.block_size, salt_of(seq)
        done = min(seq.num_computed, len(seq.prompt_ids)) // size
        parent = seq.prefix_hash
        for i in range(seq.num_hashed, done):
            parent = block_hash(parent, seq.prompt_ids[i * size : (i + 1) * size], salt)
            block = seq.block_table[i]
            if (
                parent not in self.cached and block not in self.hash_of
            ):  # else an equal block is cached already
                self.cached[parent], self.hash_of[block] = block, parent
                self.salt_of[block] = salt
        if done > seq.num_hashed:
            seq.num_hashed, seq.prefix_hash = done, parent

    def free(self, seq: Sequence) -> None:
        # The last blocks first among the cached ones to lose their memory: a prefix outlives its
        # continuations.
        for block in reversed(seq.block_table + seq.fork_blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if block in self.hash_of:
                    self.evictable[block] = None
                else:
                    self.free_blocks.append(block)
        seq.block_table, seq.fork_blocks = [], []

    def drop_prefixes(self, salt: str) -> int:
        """Forget the cached blocks of one adapter revision (`salt_of`), which left the worker:
        those nobody holds give their memory back now, the others when their sequences end. The
        number of blocks forgotten."""
        mine = [block for block, s in self.salt_of.items() if s == salt]
        for block in mine:
            del self.cached[self.hash_of.pop(block)], self.salt_of[block]
            if block in self.evictable:
                del self.evictable[block]
                self.free_blocks.append(block)
        return len(mine)

    def position(self, seq: Sequence, index: int) -> int:
        """Flat KV-cache position of the sequence's token `index`."""
        return seq.block_table[index // self.block_size] * self.block_size + index % self.block_size
