"""Eviction policies: pure functions over plain data, testable without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """An evictable resident adapter (not in flight, not pinned) as a policy sees it."""

    key: object
    nbytes: int
    last_access: float
    loaded_at: float
    hits: int
    tenant: str = "default"
    priority: int = 0
    reload_cost: float = 0.0


class LRUPolicy:
    """The runtime baseline (vLLM, TensorRT-LLM): evict the least recently used."""

    name = "lru"

    def choose_victim(self, candidates: list[Candidate], now: float):
        if not candidates:
            return None
        return min(candidates, key=lambda c: c.last_access).key
