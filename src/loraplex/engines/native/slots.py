"""The native engine's backend of the residency: its slot pool (`lora.py`'s, a `SlotPool`: a host
copy written into a device slot, a slot cleared) and its loads (`adapter_load.load_adapter`: the
fetched bytes packed into a host copy). Which adapter goes where, and when it moves, is the
residency's (`loraplex.residency.slot_pool`, by `loraplex.residency.placement`'s rules);
`native_residency` and `residency_for` build it over the engine's pool and packing.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Executor

from loraplex.artifacts import AllowList
from loraplex.engines.native.adapter_load import HostCopy, Loaded, load_adapter
from loraplex.engines.native.config import EngineConfig
from loraplex.residency.budgets import TenantBudgets
from loraplex.residency.disk import DiskTier
from loraplex.residency.key import AdapterRef
from loraplex.residency.ledger import THRASH_WINDOW_S, Entry, Ledger
from loraplex.residency.policy import make_policy
from loraplex.residency.residency import Residency
from loraplex.residency.slot_pool import WANTED_FOR_S, SlotPool, SlotPoolBackend

__all__ = [
    "WANTED_FOR_S",
    "Entry",
    "HostCopy",
    "Loaded",
    "SlotPool",
    "native_residency",
    "residency_for",
]


def native_residency(
    pool: SlotPool,
    pack: Callable[[dict[str, memoryview], Callable[[str, int], None]], object],
    *,
    cpu_bytes: int,
    max_cpu_loras: int | None = None,
    disk: DiskTier | None = None,
    policy=None,
    budgets: TenantBudgets | None = None,
    max_gpu_warm: int | None = None,
    thrash_window_s: float = THRASH_WINDOW_S,
    clock: Callable[[], float] = time.monotonic,
    load_threads: int = 2,
    executor: Executor | None = None,
    loader: Callable[[AdapterRef], Loaded] | None = None,
) -> Residency[Entry, SlotPoolBackend]:
    """The residency over a slot pool (`pack`: the engine's packing of an adapter's tensors into a
    host copy; `executor`, `loader`: a simulator's, to run loads on its clock)."""
    ledger: Ledger[Entry] = Ledger(
        policy=policy,
        budgets=budgets or TenantBudgets(pool.num_slots, cpu_bytes),
        disk=disk,
        thrash_window_s=thrash_window_s,
        clock=clock,
    )
    load = loader or functools.partial(
        load_adapter, pack=pack, disk=disk, on_event=lambda event: ledger.on_event(event)
    )
    backend = SlotPoolBackend(
        ledger,
        pool,
        load,
        cpu_bytes=cpu_bytes,
        max_cpu_loras=max_cpu_loras,
        max_gpu_warm=max_gpu_warm,
        load_threads=load_threads,
        executor=executor,
    )
    return Residency(ledger, backend)


def residency_for(
    config: EngineConfig, pool: SlotPool, pack, policy=None
) -> Residency[Entry, SlotPoolBackend]:
    """The engine's residency over its slot pool, from its configuration (`policy`: the configured
    one by default)."""
    disk = None
    if config.disk_cache_dir is not None:
        allowed = AllowList.parse(list(config.allowed_roots))
        disk = DiskTier(config.disk_cache_dir, config.disk_cache_bytes, allowed)
    return native_residency(
        pool,
        pack,
        cpu_bytes=config.cpu_cache_bytes,
        max_cpu_loras=config.max_cpu_loras,
        disk=disk,
        policy=policy or make_policy(config.eviction_policy),
        budgets=TenantBudgets(
            config.max_loras,
            config.cpu_cache_bytes,
            gpu_share=config.tenant_gpu_share,
            cpu_share=config.tenant_cpu_share,
        ),
        max_gpu_warm=config.max_gpu_preferred,
        load_threads=config.load_threads,
        thrash_window_s=config.thrash_window_s,
    )
