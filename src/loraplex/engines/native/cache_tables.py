"""The native cache's tables: what it holds in which tier, who waits for what, and the reads
over them (from any thread, under the lock).

The mechanism that changes them is `cache.AdapterCache`; `snapshot` is what placement reads.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.cache.budgets import TenantBudgets, charged
from loraplex.cache.disk import DiskTier
from loraplex.cache.key import AdapterKey, AdapterRef
from loraplex.cache.placement import (
    Placement,
    Snapshot,
)
from loraplex.cache.policy import DemandTracker, LRUPolicy
from loraplex.cache.state import adapter_row

THRASH_WINDOW_S = 60.0


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
class Entry:
    ref: AdapterRef
    refcount: int = 0
    last_access: float = 0.0
    loaded_at: float = 0.0
    hits: int = 0
    loads: int = 0
    evictions: int = 0
    nbytes: int = 0
    load_seconds: float = 0.0
    pinned: str | None = None  # "gpu" or "cpu"
    evicted_at: float | None = None
    in_host_since: float = 0.0  # when its host copy last landed
    prewarm_gpu: bool = False
    restored: bool = False  # put back in its slot by placement (gpu warm set), not asked for since
    users: dict[str, int] = field(default_factory=dict)  # tenant -> its requests holding the slot
    last_tenant: str = ""  # the tenant whose request used it last (at first, the ref's)

    def __post_init__(self):
        self.last_tenant = self.last_tenant or self.ref.tenant

    @property
    def charged(self) -> frozenset[str]:
        """The tenants its residency counts for (`budgets.charged`)."""
        return charged(self.users, self.last_tenant)


@dataclass
class Loaded:
    packed: HostCopy
    source: str  # tier the bytes came from: disk or remote
    stages: dict[str, float] = field(default_factory=dict)


class CacheTables:
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
        self.pool = pool
        self.cpu_bytes = cpu_bytes
        self.max_cpu_loras = max_cpu_loras
        self.disk = disk
        self.policy = policy or LRUPolicy()
        self.budgets = budgets or TenantBudgets(pool.num_slots, cpu_bytes)
        # the size of the gpu warm set
        self.max_gpu_warm = max_gpu_warm if max_gpu_warm is not None else pool.num_slots
        self.placement = Placement()
        self.clock = clock
        self.thrash_window_s = thrash_window_s
        self.slots: list[AdapterKey | None] = [None] * pool.num_slots
        # changed only by _put_cpu and _drop_cpu, which keep the total
        self.cpu: dict[AdapterKey, HostCopy] = {}
        self.cpu_bytes_used = 0  # bytes of the host copies in self.cpu
        self.entries: dict[AdapterKey, Entry] = {}
        self.loading: dict[AdapterKey, Future] = {}
        self.demand = DemandTracker()  # requests per adapter
        # slot activations per adapter: what its host copy served
        self.activations = DemandTracker(ranked=False)
        # one key, "gpu": activations that requests asked for
        self.slot_loads = DemandTracker(ranked=False)
        # measured per load stage (download, disk, h2d)
        self.seconds_per_byte: dict[str, float] = {}
        self.recent_evictions: deque[float] = deque(maxlen=1000)
        self.reloads_after_eviction = 0
        self.num_evictions = 0
        self.on_event: Callable[[str, dict], None] = lambda kind, fields: None
        # keys a waiting request asked for and has not got yet -> when it last asked
        self._wanted: dict[AdapterKey, float] = {}
        self._nbytes_version = 0  # moves when an entry's bytes change (the cpu warm set uses them)
        # when a key's waiting requests first asked
        self._waiting_since: dict[AdapterKey, float] = {}
        # key -> (tenant, since): waiting requests that their tenant's budget holds back
        self.budget_waiting: dict[AdapterKey, tuple[str, float]] = {}
        self.budget_waits: dict[str, int] = {}  # per tenant, requests' waits that its budget caused
        # requests waiting for admission, per adapter (add_waiting / drop_waiting)
        self.num_waiting: dict[AdapterKey, int] = {}
        # futures that operator calls wait on: a key's load taken in by `poll`, its last release
        self._on_loaded: dict[AdapterKey, list[Future]] = {}
        self._on_released: dict[AdapterKey, list[Future]] = {}
        # the entries pinned to gpu, and to cpu (kept with `pinned`)
        self._gpu_pins: set[AdapterKey] = set()
        self._cpu_pins: set[AdapterKey] = set()
        # moves when host copies, loads, cpu pins or wanted keys change (placement keeps its sets)
        self._copies_version = 0
        self._lock = threading.RLock()

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

    # -- queries (any thread) --------------------------------------------------------------------
    def slot_of(self, key: AdapterKey) -> int | None:
        return self.slots.index(key) if key in self.slots else None

    def tier_of(self, key: AdapterKey) -> str:
        with self._lock:
            if key in self.slots:
                return "gpu"
            if key in self.cpu:
                return "cpu"
            return "disk" if self._on_disk(key) else "remote"

    def pinned(self, key: AdapterKey) -> str | None:
        """The tier the adapter is pinned to (gpu or cpu), or None."""
        entry = self.entries.get(key)
        return entry.pinned if entry is not None else None

    def nbytes_of(self, key: AdapterKey) -> int:
        entry = self.entries.get(key)
        return entry.nbytes if entry else 0

    def free_slots(self) -> int:
        return self.slots.count(None)

    def state(self) -> dict:
        now = self.clock()
        with self._lock:
            adapters, on_disk = [], []
            snap, in_slots = self.snapshot(), set(self.slots)
            gpu_warm = self.placement.gpu_warm(snap, now)
            cpu_warm = self.placement.cpu_warm(snap, now)
            for key, e in self.entries.items():
                disk = self._on_disk(key)  # a file system look per adapter: once
                if disk:
                    on_disk.append(key)
                tier = (
                    "gpu"
                    if key in in_slots
                    else "cpu"
                    if key in self.cpu
                    else "disk"
                    if disk
                    else "remote"
                )
                # the warm set the demand keeps: "A" the gpu warm set, "B" the cpu warm set (both:
                # "A")
                warm = "A" if key in gpu_warm else "B" if key in cpu_warm else None
                adapters.append(
                    adapter_row(key, e, tier, key in self.loading, warm, self.demand, now)
                )
            copies = {
                "gpu": [k for k in self.slots if k is not None],
                "cpu": list(self.cpu),
                "disk": on_disk,
            }
            return {
                "adapters": adapters,
                # Per tier, the adapters with a copy there (one in a slot has its host copy too)
                # and their bytes.
                "resident": {
                    tier: {"count": len(keys), "bytes": sum(self.entries[k].nbytes for k in keys)}
                    for tier, keys in copies.items()
                },
                "num_slots": len(self.slots),
                "free_slots": self.free_slots(),
                "recent_evictions": sum(
                    1 for t in self.recent_evictions if now - t < self.thrash_window_s
                ),
                "cpu_bytes_used": self.cpu_bytes_used,
                "cpu_bytes_capacity": self.cpu_bytes,
                "thrash_ratio": self.thrash_ratio(),
                "tenants": self.budget_state(),
            }

    def thrash_ratio(self) -> float:
        return self.reloads_after_eviction / self.num_evictions if self.num_evictions else 0.0

    def resident(self, tier: str) -> list[AdapterKey]:
        with self._lock:
            return [k for k in self.slots if k is not None] if tier == "gpu" else list(self.cpu)

    def in_slot(self, key: AdapterKey) -> bool:
        return key in self.slots

    def in_host_memory(self, key: AdapterKey) -> bool:
        return key in self.cpu

    def is_loading(self, key: AdapterKey) -> bool:
        return key in self.loading

    def num_loading(self) -> int:
        return len(self.loading)

    def when_loaded(self, key: AdapterKey) -> Future:
        """Done once no load of `key` is in progress: at once, or when `poll` takes its end in."""
        with self._lock:
            return _watch(self._on_loaded, key, key not in self.loading)

    def when_released(self, key: AdapterKey) -> Future:
        """Done once no request holds `key`: at once, or when `release` drops the last one."""
        with self._lock:
            entry = self.entries.get(key)
            return _watch(self._on_released, key, entry is None or not entry.refcount)

    def loading_keys(self) -> list[AdapterKey]:
        with self._lock:
            return list(self.loading)

    def num_recent_evictions(self, now: float) -> int:
        """Evictions in the last THRASH_WINDOW_S seconds before `now`."""
        times = self.recent_evictions  # oldest first
        return len(times) - bisect.bisect_left(times, True, key=lambda t: now - t < THRASH_WINDOW_S)

    def tenant_usage(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per tier (gpu, cpu), per tenant: {"count", "bytes"} of what is charged to it there."""
        with self._lock:
            entries = self.entries
            out: dict[str, dict[str, dict[str, int]]] = {}
            in_slots = [k for k in self.slots if k is not None]
            for tier, keys in (("gpu", in_slots), ("cpu", list(self.cpu))):
                per = out[tier] = {}
                for key in keys:
                    e = entries[key]
                    for t in e.charged:
                        row = per.setdefault(t, {"count": 0, "bytes": 0})
                        row["count"] += 1
                        row["bytes"] += e.nbytes
            return out

    def budget_state(self) -> dict[str, dict]:
        """Per tenant: slots and host bytes used against its budget, and its budget waits."""
        with self._lock:
            used = self.tenant_usage()
            report = self.budgets.report(
                {
                    "gpu": {t: r["count"] for t, r in used["gpu"].items()},
                    "cpu": {t: r["bytes"] for t, r in used["cpu"].items()},
                }
            )
            for t in self.budget_waits:
                report.setdefault(
                    t,
                    {
                        tier: {"used": 0, "budget": self.budgets.limit(t, tier)}
                        for tier in ("gpu", "cpu")
                    },
                )
            for t, row in report.items():
                row["gpu"] = {
                    "slots": row["gpu"]["used"],
                    "max_slots": row["gpu"]["budget"],
                    "bytes": used["gpu"].get(t, {}).get("bytes", 0),
                }
                row["cpu"] = {
                    "bytes": row["cpu"]["used"],
                    "max_bytes": row["cpu"]["budget"],
                    "count": used["cpu"].get(t, {}).get("count", 0),
                }
                row["budget_waits"] = self.budget_waits.get(t, 0)
            return report

    def _on_disk(self, key: AdapterKey) -> bool:
        entry = self.entries.get(key)
        if entry is not None and entry.ref.path is not None:
            return True
        return self.disk is not None and self.disk.has(key.adapter_digest)


def _watch(watchers: dict[AdapterKey, list[Future]], key: AdapterKey, done: bool) -> Future:
    future: Future = Future()
    if done:
        future.set_result(None)
    else:
        watchers.setdefault(key, []).append(future)
    return future
