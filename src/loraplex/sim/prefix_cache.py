"""Prompt prefixes in the simulation: `simulate --kv-prefix-blocks` and `--system-prompt-tokens`.

A request's prompt is its shared prompt's tokens (a system prompt, the same ids for every request
that names it) followed by its own, cut into blocks and hashed as the router hashes token ids
(`router/prefixes.py`: a chain of 16-token blocks salted with the adapter revision's digest). The
router keeps its approximate index of the blocks it routed to each worker (`PrefixIndex`), which
scores its picks; each worker keeps the blocks it prefilled in its KV cache, least recently used
out first (a `PrefixIndex` of `kv_prefix_blocks`): the leading blocks found there are a prefix
hit, counted as vLLM counts `prefix_cache_queries` and `prefix_cache_hits` (in tokens), and are
not prefilled again.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import replace

from loraplex.residency.key import AdapterKey
from loraplex.router.prefixes import BLOCK_TOKENS, PrefixIndex, block_hashes
from loraplex.sim.workload import Request


def with_system_prompts(trace: list[Request], tokens: int) -> list[Request]:
    """Each request's prompt led by its adapter's system prompt of `tokens` tokens (a base-model
    request: its tenant's), added to the prompt's own tokens; 0: the trace as it is."""
    if not tokens:
        return trace
    return [
        replace(
            r,
            prefix=r.model or f"tenant:{r.tenant}",
            prefix_tokens=tokens,
            prompt_tokens=r.prompt_tokens + tokens,
        )
        for r in trace
    ]


def _token_id(prefix: str) -> int:
    """The id that stands for each token of a shared prompt."""
    return int.from_bytes(hashlib.blake2b(prefix.encode(), digest_size=6).digest(), "big")


class PrefixModel:
    """The router's prefix index and the workers' KV prefix caches of one simulated fleet."""

    def __init__(self, workers: int, kv_blocks: int, index_blocks: int):
        self.router = [PrefixIndex(index_blocks) for _ in range(workers)]
        self.kv = [PrefixIndex(kv_blocks) for _ in range(workers)]
        self.queries = self.hits = 0
        """Prompt tokens prefilled and those found in the KV cache, fleet-wide."""
        self._own = itertools.count(1)

    def blocks(self, req: Request, key: AdapterKey | None) -> tuple[int, ...]:
        """The hash chain of the request's prompt as token ids, its shared prompt's then its own
        (ids no other request has), salted with its adapter revision's digest (as the router's
        `prefix_key`)."""
        salt = key.adapter_digest if key is not None else ""
        shared = min(req.prefix_tokens, req.prompt_tokens) if req.prefix else 0
        own = -next(self._own)
        ids = [_token_id(req.prefix)] * shared if req.prefix else []
        return block_hashes(ids + [own] * (req.prompt_tokens - shared), salt)

    def score(self, worker: int, blocks: tuple[int, ...]) -> float:
        """The router's view: the share of the prompt's blocks routed to `worker` lately."""
        return self.router[worker].match(blocks) if blocks else 0.0

    def sent(self, worker: int, blocks: tuple[int, ...]) -> None:
        self.router[worker].add(blocks)

    def prefill(self, worker: int, req: Request, blocks: tuple[int, ...]) -> int:
        """The prompt's tokens found in the worker's KV cache (at least one token is computed, as
        the engines do); its blocks are the most recently used there after."""
        cache = self.kv[worker]
        hit = min(round(cache.match(blocks) * len(blocks)) * BLOCK_TOKENS, req.prompt_tokens - 1)
        cache.add(blocks)
        self.queries += req.prompt_tokens
        self.hits += max(0, hit)
        return max(0, hit)

    def figures(self) -> dict:
        """The fleet's prefix-cache queries, hits (tokens) and hit rate."""
        rate = self.hits / self.queries if self.queries else 0.0
        return {"queries": self.queries, "hits": self.hits, "hit_rate": rate}
