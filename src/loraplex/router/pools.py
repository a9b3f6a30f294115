"""Pools: the router's fleet as groups of workers, each declared with its base model, its max LoRA
rank and the tenants it is dedicated to (none: shared); which workers a request may go to.

Pure functions over plain data: a worker's reported facts against its pool's declaration, and a
request's needs (a base model, the rank of its adapter) against both.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from loraplex.settings.pools import DEFAULT_POOL, PoolSpec

__all__ = ["DEFAULT_POOL", "PoolSpec", "Need", "Reported", "misconfigured", "serves", "tiers"]


@dataclass(frozen=True)
class Reported:
    """What a worker says of itself in its state (None: it does not say, e.g. a vLLM server)."""

    base_model: str | None = None
    base_model_digest: str | None = None
    max_lora_rank: int | None = None


def misconfigured(pool: PoolSpec, reported: Reported) -> str | None:
    """Why a worker cannot stand in its pool (None: it can, or it says nothing to check)."""
    r = reported
    if pool.base_model and r.base_model and r.base_model != pool.base_model:
        return f"serves base model {r.base_model}, pool {pool.name} is for {pool.base_model}"
    if (
        pool.base_model_digest
        and r.base_model_digest
        and r.base_model_digest != (pool.base_model_digest)
    ):
        return (
            f"serves base model digest {r.base_model_digest}, pool {pool.name} is for "
            f"{pool.base_model_digest}"
        )
    if pool.max_rank and r.max_lora_rank is not None and r.max_lora_rank < pool.max_rank:
        return f"has max LoRA rank {r.max_lora_rank}, pool {pool.name} serves rank {pool.max_rank}"
    return None


@dataclass(frozen=True)
class Need:
    """What a request needs of a worker: its base model by served name (a bare base-model request)
    or by digest (an adapter's revision), and its adapter's rank (0: none)."""

    base_model: str | None = None
    base_digests: frozenset[str] = frozenset()
    rank: int = 0
    label: str = ""
    """How an error names the request's base: `llama (the base of ad01@r1)`."""


def serves(pool: PoolSpec, reported: Reported, need: Need) -> bool:
    """Whether a worker of `pool` that reports `reported` can serve the request; what the worker
    does not report, its pool's declaration stands for, and what neither says is not held
    against it."""
    base = reported.base_model or pool.base_model
    digest = reported.base_model_digest or pool.base_model_digest
    if need.base_model is not None and base is not None and base != need.base_model:
        return False
    if need.base_digests and digest is not None and digest not in need.base_digests:
        return False
    ranks = [r for r in (reported.max_lora_rank, pool.max_rank) if r is not None]
    return not (need.rank and ranks and min(ranks) < need.rank)


def tiers(pools: Iterable[PoolSpec], tenant: str | None) -> tuple[list[PoolSpec], list[PoolSpec]]:
    """(the tenant's dedicated pools, the shared pools): the order a request tries them in."""
    pools = list(pools)
    dedicated = [p for p in pools if tenant is not None and tenant in p.tenants]
    return dedicated, [p for p in pools if p.shared]
