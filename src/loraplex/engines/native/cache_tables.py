"""The native cache's tables: the slots and host copies it holds over the shared ledger
(`loraplex.residency.ledger`), who waits for what (from any thread, under the lock).

The mechanism that changes them is `cache.AdapterCache`; `snapshot` is what placement reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.residency.budgets import TenantBudgets
from loraplex.residency.disk import DiskTier
from loraplex.residency.key import AdapterKey
from loraplex.residency.ledger import THRASH_WINDOW_S, Entry, Ledger
from loraplex.residency.placement import Placement, Snapshot
from loraplex.residency.policy import DemandTracker

__all__ = ["THRASH_WINDOW_S", "CacheTables", "Entry", "HostCopy", "Loaded", "SlotPool"]


class SlotPool(Protocol):
    num_slots: int

    def set_slot(self, slot: int, packed) -> float | None:
        """Write the host copy into the slot; a pool that models its copies (the simulator's)
        returns the seconds the copy takes, any other None (the cache times it)."""

    def clear_slot(self, slot: int) -> None: ...


class HostCopy(Protocol):
    """An adapter's host copy as the cache sees it (the engine's `PackedAdapter`, the simulator's
    `SimPacked`)."""

    @property
    def nbytes(self) -> int: ...


@dataclass
class Loaded:
    packed: HostCopy
    source: str  # tier the bytes came from: disk or remote
    stages: dict[str, float] = field(default_factory=dict)


class CacheTables(Ledger[Entry]):
    """The tables, and the reads the server, the admin API and the metrics make of them."""

    def __init__(
        self,
        pool: SlotPool,
        *,
        cpu_bytes: int,
        max_cpu_loras: int | None = None,
        disk: DiskTier | None = None,
        policy=None,
        budgets: TenantBudgets | None = None,
        max_gpu_warm: int | None = None,
        thrash_window_s: float = THRASH_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(
            policy=policy,
            budgets=budgets or TenantBudgets(pool.num_slots, cpu_bytes),
            disk=disk,
            thrash_window_s=thrash_window_s,
            clock=clock,
        )
        self.pool = pool
        self.cpu_bytes = cpu_bytes
        self.max_cpu_loras = max_cpu_loras
        # the size of the gpu warm set
        self.max_gpu_warm = max_gpu_warm if max_gpu_warm is not None else pool.num_slots
        self.placement = Placement()
        self.slots: list[AdapterKey | None] = [None] * pool.num_slots
        # changed only by _put_cpu and _drop_cpu, which keep the total
        self.cpu: dict[AdapterKey, HostCopy] = {}
        self.cpu_bytes_used = 0  # bytes of the host copies in self.cpu
        self.loading: dict[AdapterKey, Future] = {}
        # slot activations per adapter: what its host copy served
        self.activations = DemandTracker(ranked=False)
        # one key, "gpu": activations that requests asked for
        self.slot_loads = DemandTracker(ranked=False)
        # measured per load stage (download, disk, h2d)
        self.seconds_per_byte: dict[str, float] = {}
        # keys a waiting request asked for and has not got yet -> when it last asked
        self._wanted: dict[AdapterKey, float] = {}
        self._nbytes_version = 0  # moves when an entry's bytes change (the cpu warm set uses them)
        # when a key's waiting requests first asked
        self._waiting_since: dict[AdapterKey, float] = {}
        # key -> (tenant, since): waiting requests that their tenant's budget holds back
        self.budget_waiting: dict[AdapterKey, tuple[str, float]] = {}
        # requests waiting for admission, per adapter (add_waiting / drop_waiting)
        self.num_waiting: dict[AdapterKey, int] = {}
        # the entries pinned to gpu, and to cpu (kept with `pins`)
        self._gpu_pins: set[AdapterKey] = set()
        self._cpu_pins: set[AdapterKey] = set()
        # moves when host copies, loads, cpu pins or wanted keys change (placement keeps its sets)
        self._copies_version = 0

    def snapshot(self) -> Snapshot:
        """What placement reads: this cache's tables as they are now (read, never changed)."""
        return Snapshot(
            self.entries,
            self.slots,
            self.cpu,
            self.cpu_bytes_used,
            self.loading,
            self.disk.has if self.disk is not None else None,
            self._wanted,
            self._waiting_since,
            self.budget_waiting,
            self.num_waiting,
            self._gpu_pins,
            self._cpu_pins,
            self.demand,
            self.activations,
            self.slot_loads,
            self.seconds_per_byte,
            self.cpu_bytes,
            self.max_cpu_loras,
            self.max_gpu_warm,
            self.policy,
            self.budgets,
            self._copies_version,
            self._nbytes_version,
        )

    # -- what the ledger reads (its engine's tiers) ---------------------------------------------
    def in_slot(self, key: AdapterKey) -> bool:
        return key in self.slots

    def in_host_memory(self, key: AdapterKey) -> bool:
        return key in self.cpu

    def in_slots(self) -> list[AdapterKey]:
        return [k for k in self.slots if k is not None]

    def in_host(self) -> list[AdapterKey]:
        return list(self.cpu)

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def free_slots(self) -> int:
        return self.slots.count(None)

    def warm_sets(self, now: float) -> tuple[set[AdapterKey], set[AdapterKey]]:
        snap = self.snapshot()
        return self.placement.gpu_warm(snap, now), self.placement.cpu_warm(snap, now)

    def host_figures(self) -> dict:
        return {"cpu_bytes_used": self.cpu_bytes_used, "cpu_bytes_capacity": self.cpu_bytes}

    def set_pin(self, key: AdapterKey, tier: str | None) -> None:
        super().set_pin(key, tier)
        self._copies_version += 1
        for pinned_to, pins in (("gpu", self._gpu_pins), ("cpu", self._cpu_pins)):
            if tier == pinned_to:
                pins.add(key)
            else:
                pins.discard(key)

    # -- queries (any thread) --------------------------------------------------------------------
    def slot_of(self, key: AdapterKey) -> int | None:
        return self.slots.index(key) if key in self.slots else None

    def resident(self, tier: str) -> list[AdapterKey]:
        with self._lock:
            return self.in_slots() if tier == "gpu" else self.in_host()

    def num_loading(self) -> int:
        return len(self.loading)

    def loading_keys(self) -> list[AdapterKey]:
        with self._lock:
            return list(self.loading)
