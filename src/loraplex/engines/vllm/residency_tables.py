"""The vLLM residency's tables: which adapters loraplex tracks on vLLM, what vLLM holds of them,
who waits, and the reads and counts over them (any thread, under `_lock`). The mechanism that calls
vLLM is `residency.VllmResidency`."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.residency.budgets import TenantBudgets, charged, tenant_rows, usage
from loraplex.residency.disk import DiskTier
from loraplex.residency.errors import (
    AdapterUnavailable,
)
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.placement import (
    BusyShare,
    cpu_warm_set,
    gpu_warm_set,
    warm_pins,
)
from loraplex.residency.policy import DemandTracker, LRUPolicy
from loraplex.residency.state import adapter_row

if TYPE_CHECKING:
    pass

from loraplex.engines.vllm.staging import StagedCopies

THRASH_WINDOW_S = 60.0
WARM_PIN_LOOK_S = 0.5  # how often a request waiting for a slot looks whether a warm pin may go
# vLLM's host cache is sized in adapters (max_cpu_loras), not bytes: no byte capacity bounds a
# tenant's host-bytes budget.
HOST_BYTES_UNBOUNDED = sys.maxsize


def lora_int_id(key: AdapterKey) -> int:
    """vLLM's integer id for a key: from a hash of the whole key (digest included), so another
    revision or other bytes never get the id of weights vLLM already holds. 62 bits: a positive
    int64, never 0."""
    text = "\0".join(
        (
            key.base_model_digest,
            key.name,
            key.revision,
            key.adapter_digest,
            key.runtime_compat_version,
        )
    )
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 2 or 1


@dataclass
class Resident:
    """One adapter as loraplex tracks it on the vLLM engine."""

    ref: AdapterRef
    lora_id: int
    refcount: int = 0  # requests in flight: never removed from vLLM while above 0
    active: int = (
        0  # of those, the requests handed to vLLM (the others wait for the load or a slot)
    )
    last_access: float = 0.0
    loaded_at: float = 0.0
    hits: int = 0
    loads: int = 0
    evictions: int = 0
    nbytes: int = 0
    pinned: str | None = None  # the operator's pin: "gpu" or "cpu"
    in_vllm: bool = False  # added to vLLM's host cache (or its add sent, for a known adapter)
    adding: bool = False  # an add sent to vLLM whose answer has not come: never removed meanwhile
    vllm_pinned: bool = False  # pin_lora'd (or its pin sent): kept in a device slot by vLLM
    evicted_at: float | None = None
    users: dict[str, int] = field(default_factory=dict)  # tenant -> its requests handed to vLLM
    last_tenant: str = ""  # the tenant whose request used it last (at first, the ref's)
    busy: BusyShare = field(default_factory=BusyShare)  # recent time with requests in vLLM
    restorable: bool = True  # added back ahead of its requests (False from an operator's evict)
    shape: str | None = None  # what vLLM's add checks of it, as a digest (`vllm_shape`)

    def __post_init__(self):
        self.last_tenant = self.last_tenant or self.ref.tenant

    @property
    def in_slot(self) -> bool:
        """Holding one of vLLM's device slots as loraplex counts them: pinned, or running."""
        return self.in_vllm and (self.vllm_pinned or self.active > 0)

    @property
    def charged(self) -> frozenset[str]:
        """The tenants its residency counts for (`budgets.charged`)."""
        return charged(self.users, self.last_tenant)


class ResidencyTables:
    """The tables, the reads the server, the admin API and the metrics make, and the counts and
    warm sets the mechanism decides by."""

    staging: StagedCopies  # set by the engine's residency, after the tables

    def __init__(
        self,
        *,
        max_loras: int,
        max_cpu_loras: int,
        disk: DiskTier | None = None,
        policy=None,
        budgets: TenantBudgets | None = None,
        reserved_slots: int = 0,
        scheduler_counts_pins: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_loras = max_loras
        self.reserved_slots = (
            reserved_slots  # vLLM's slots pinned outside this table (the zero adapter)
        )
        self.max_cpu_loras = max_cpu_loras
        # vLLM's scheduler leaves out of a batch's budget the slots that pinned adapters outside
        # it hold (loraplex's plugin, `patches.py`), so pins hold no request back here
        self.scheduler_counts_pins = scheduler_counts_pins
        # adapters handed to vLLM beyond its slots while none is pinned (`_unpinned_room`): up to
        # half the slots, within half the host cache's places beyond the slots (the others take
        # the loads meanwhile)
        self.queue_ahead = min(max_loras, max(0, max_cpu_loras - max_loras)) // 2
        self.disk = disk
        self.policy = policy or LRUPolicy()
        self.budgets = budgets or TenantBudgets(max_loras, HOST_BYTES_UNBOUNDED)
        self.budget_waits: dict[str, int] = {}  # per tenant, requests' waits that its budget caused
        self._slot_waiting: dict[str, int] = {}  # per tenant, its requests waiting for a slot
        self._host_waiting: set[AdapterKey] = set()  # loads waiting for their tenant's host budget
        self.clock = clock
        self.entries: dict[AdapterKey, Resident] = {}
        # Indexes of `entries` that the request path reads instead of a pass over every adapter:
        # those in vLLM's host cache, those with requests handed to vLLM, the operator's pins (in
        # order), those pinned in vLLM, and the last `_pins_to_hold`.
        self._held: dict[AdapterKey, Resident] = {}
        self._running: set[AdapterKey] = set()
        self._pins: dict[AdapterKey, str] = {}
        self._vllm_pins: set[AdapterKey] = set()
        self._pins_wanted: set[AdapterKey] = set()
        self.loading: dict[AdapterKey, asyncio.Future] = {}
        self.demand = DemandTracker()
        self.host_loads = DemandTracker(ranked=False)  # one key, "cpu": adds that requests caused
        self.recent_evictions: deque[float] = deque(maxlen=1000)
        self.num_evictions = 0
        self.reloads_after_eviction = 0
        self.on_event: Callable[[str, dict], None] = lambda kind, fields: None
        self.loop: asyncio.AbstractEventLoop | None = None  # set by `start`, on the server's loop
        self._lock = threading.RLock()
        self._vllm_lock: asyncio.Lock | None = None  # one add/remove at a time (made by `start`)
        self._room = asyncio.Event()  # set when a release may have made a victim available
        self._ids: dict[int, AdapterKey] = {}
        self._num_adding = 0  # adds sent to vLLM whose answer has not come

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._vllm_lock = asyncio.Lock()

    def tier_of(self, key: AdapterKey) -> str:
        """gpu when pinned or running in vLLM, cpu in vLLM's host cache, else disk or remote."""
        with self._lock:
            entry = self.entries.get(key)
            if entry is not None and entry.in_vllm:
                return "gpu" if entry.vllm_pinned or entry.active else "cpu"
            return "disk" if self._on_disk(key) else "remote"

    def pinned(self, key: AdapterKey) -> str | None:
        entry = self.entries.get(key)
        return entry.pinned if entry is not None else None

    def is_loading(self, key: AdapterKey) -> bool:
        return key in self.loading

    def in_host_memory(self, key: AdapterKey) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.in_vllm

    def thrash_ratio(self) -> float:
        return self.reloads_after_eviction / self.num_evictions if self.num_evictions else 0.0

    def state(self) -> dict:
        now = self.clock()
        with self._lock:
            gpu_warm, cpu_warm = set(self._gpu_warm(now)), set(self._cpu_warm(now))
            adapters: list[dict] = []
            copies: dict[str, list[int]] = {"gpu": [], "cpu": [], "disk": []}
            for key, e in self.entries.items():
                on_disk = self._on_disk(key)  # a file system look per adapter: once
                tier = (
                    ("gpu" if e.vllm_pinned or e.active else "cpu")
                    if e.in_vllm
                    else "disk"
                    if on_disk
                    else "remote"
                )
                for t in ("gpu", "cpu", "disk"):  # an adapter in a slot has its host copy too
                    if t == tier or (t == "cpu" and tier == "gpu") or (t == "disk" and on_disk):
                        copies[t].append(e.nbytes)
                warm = "A" if key in gpu_warm else "B" if key in cpu_warm else None
                row = adapter_row(key, e, tier, key in self.loading, warm, self.demand, now)
                adapters.append({**row, "lora_int_id": e.lora_id})
            in_slots = sum(
                1 for e in self.entries.values() if e.in_vllm and (e.vllm_pinned or e.active)
            )
            in_host = [e for e in self.entries.values() if e.in_vllm]
            return {
                "adapters": adapters,
                "resident": {t: {"count": len(v), "bytes": sum(v)} for t, v in copies.items()},
                "num_slots": self.max_loras,
                "free_slots": max(0, self.max_loras - in_slots),
                "recent_evictions": sum(
                    1 for t in self.recent_evictions if now - t < THRASH_WINDOW_S
                ),
                "cpu_bytes_used": sum(e.nbytes for e in in_host),
                "cpu_loras_used": len(in_host),
                "cpu_loras_capacity": self.max_cpu_loras,
                "thrash_ratio": self.thrash_ratio(),
                "tenants": self.budget_state(),
            }

    def when_loaded(self, key: AdapterKey) -> Future:
        """Done once no load of `key` is in progress."""
        return self._when(self._loaded(key))

    def when_released(self, key: AdapterKey) -> Future:
        """Done once no request holds `key`."""
        return self._when(self._released(key))

    def _when(self, coro: Coroutine) -> Future:
        if self.loop is None:  # not started: nothing loads or holds an adapter
            coro.close()
            future: Future = Future()
            future.set_result(None)
            return future
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _loaded(self, key: AdapterKey) -> None:
        load = self.loading.get(key)
        if load is not None:
            await asyncio.wait([load])  # a failed load is reported by its own request or call

    async def _released(self, key: AdapterKey) -> None:
        while (entry := self.entries.get(key)) is not None and entry.refcount:
            self._room.clear()
            await self._room.wait()  # set by every release

    def tenant_usage(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per tier (gpu: the slots `_has_slot` counts; cpu: vLLM's host cache), per tenant:
        {"count", "bytes"} of what is charged to it there."""
        with self._lock:
            out: dict[str, dict[str, dict[str, int]]] = {"gpu": {}, "cpu": {}}
            for e in self.entries.values():
                tiers = ("gpu", "cpu") if e.in_slot else ("cpu",) if e.in_vllm else ()
                for tier in tiers:
                    for t in e.charged:
                        row = out[tier].setdefault(t, {"count": 0, "bytes": 0})
                        row["count"] += 1
                        row["bytes"] += e.nbytes
            return out

    def budget_state(self) -> dict[str, dict]:
        """Per tenant: slots and host bytes used against its budget, and its budget waits."""
        with self._lock:
            return tenant_rows(self.budgets, self.tenant_usage(), self.budget_waits)

    def _slot_usage(self) -> dict[str, int]:
        return usage((e.charged, 1) for e in self.entries.values() if e.in_slot)

    def _host_usage(self) -> dict[str, int]:
        held = (e for e in self.entries.values() if e.in_vllm or e.adding)
        return usage((e.charged, e.nbytes) for e in held)

    def _yields_slot(self, entry: Resident, tenant: str, deferred_at: float | None) -> bool:
        """Whether a request of `tenant` that needs a slot of its own leaves a free one to another
        tenant's waiting request: its tenant is beyond its gpu budget, the other's is not, and it
        has not yet deferred for the budgets' `yield_s` (`TenantBudgets.defers`). Free capacity is
        anyone's only while no one else wants it."""
        budgets = self.budgets
        if entry.in_slot or not budgets.limits_anyone:
            return False
        others = [t for t, n in self._slot_waiting.items() if n and t != tenant]
        if not others:
            return False
        if deferred_at is not None and not budgets.defers(self.clock() - deferred_at):
            return False
        with self._lock:
            used = self._slot_usage()
        return budgets.is_over(tenant, "gpu", used, 1) and any(
            not budgets.is_over(t, "gpu", used, 1) for t in others
        )

    def _defer_left(self, deferred_at: float | None) -> float | None:
        """Seconds a deferring request still lets others go first (None: it does not)."""
        if deferred_at is None:
            return None
        left = self.budgets.yield_s - (self.clock() - deferred_at)
        return left if left > 0 else None

    def _host_budget_victims(self, incoming: Resident, keys: list[AdapterKey]) -> list[AdapterKey]:
        """Of the removable adapters `keys`, those that the load of `incoming` may push out of
        vLLM's host cache for the tenant whose load it is: beyond its budget, only its own."""
        entries = self.entries
        pairs = [(k, entries[k].charged) for k in keys]
        need = max(incoming.nbytes, 1)
        return self.budgets.victims("cpu", incoming.last_tenant, self._host_usage(), need, pairs)

    def _count_budget_wait(self, tenant: str, key: AdapterKey) -> None:
        self.budget_waits[tenant] = self.budget_waits.get(tenant, 0) + 1
        self.on_event("budget_wait", {"tenant": tenant, "key": key})

    def _entry(self, ref: AdapterRef) -> Resident:
        entry = self.entries.get(ref.key)
        if entry is None:
            lora_id = lora_int_id(ref.key)
            if (
                self._ids.get(lora_id, ref.key) != ref.key
            ):  # a 62-bit collision: refuse rather than mix weights
                raise AdapterUnavailable(
                    f"{ref.key}: its vLLM id collides with {self._ids[lora_id]}"
                )
            self._ids[lora_id] = ref.key
            entry = self.entries[ref.key] = Resident(ref, lora_id)
        return entry

    def _busy_unpinned(self) -> int:
        """The distinct unpinned adapters with requests handed to vLLM."""
        return sum(1 for k in self._running if not self.entries[k].vllm_pinned)

    def _num_in_vllm(self) -> int:
        return len(self._held)

    def _set_in_vllm(self, entry: Resident, held: bool) -> None:
        """`entry` in or out of vLLM's host cache (out of it, not pinned in vLLM either)."""
        with self._lock:
            entry.in_vllm = held
            if held:
                self._held[entry.ref.key] = entry
            else:
                self._set_vllm_pinned(entry, False)
                self._held.pop(entry.ref.key, None)

    def _set_vllm_pinned(self, entry: Resident, pinned: bool) -> None:
        entry.vllm_pinned = pinned
        if pinned:
            self._vllm_pins.add(entry.ref.key)
        else:
            self._vllm_pins.discard(entry.ref.key)

    def _set_pinned(self, entry: Resident, tier: str | None) -> None:
        entry.pinned = tier
        if tier is None:
            self._pins.pop(entry.ref.key, None)
        else:
            self._pins[entry.ref.key] = tier

    def _gpu_warm(self, now: float) -> list[AdapterKey]:
        """The gpu warm set, as placement's rule gives it for one slot fewer than vLLM has."""
        cap, gaps = max(0, self.max_loras - 1), getattr(self.policy, "overdue_gaps", None)
        return gpu_warm_set(self.demand, now, cap, gaps)

    def _cpu_warm(self, now: float) -> list[AdapterKey]:
        """The cpu warm set, as placement's rule gives it for half of vLLM's host cache."""
        taken, half = 0, self.max_cpu_loras // 2

        def fits(key: AdapterKey) -> bool:
            nonlocal taken
            taken += 1
            return taken <= half

        return cpu_warm_set(self.demand, now, fits, getattr(self.policy, "overdue_gaps", None))

    def _waits(self) -> bool:
        """Whether a request or load waits (for a load, a slot, or a place in the host cache)."""
        return bool(self.loading or self._slot_waiting or self._num_adding or self._host_waiting)

    def _pins_to_hold(self, now: float) -> list[AdapterKey]:
        """What vLLM keeps pinned in its device slots: the operator's gpu pins, then, under a policy
        that keeps the gpu warm set in slots (`score`), the busy adapters of that set when all of
        them fit (`warm_pins`). Together they leave a slot for the other adapters (up to
        max_loras - 1), and with the operator's cpu pins a place in the host cache for loads (up to
        max_cpu_loras - 1). A warm adapter whose tenant is at its gpu budget is pinned only once it
        runs."""
        cap = max(0, self.max_loras - 1)
        gpu = [k for k, tier in self._pins.items() if tier == "gpu"][:cap]
        if not getattr(self.policy, "restores_gpu_warm", False):
            return gpu
        room = min(cap - len(gpu), self.max_cpu_loras - 1 - len(self._pins))
        gaps = getattr(self.policy, "overdue_gaps", None)
        entries = self.entries
        warm = warm_pins(
            self.demand,
            now,
            room,
            gaps,
            self._held,
            self._vllm_pins,
            lambda k: entries[k].busy.read(now),
            exclude=gpu,
        )
        if warm and self.budgets.limits_anyone:
            used, budgets = self._slot_usage(), self.budgets
            warm = [
                k
                for k in warm
                if self.entries[k].in_slot
                or not any(budgets.is_over(t, "gpu", used, 1) for t in self.entries[k].charged)
            ]
        return gpu + warm

    def _may_pin(self, entry: Resident) -> bool:
        """Whether pinning `entry` leaves a slot unpinned and keeps the distinct unpinned adapters
        running within the unpinned slots (`_has_slot`): one running already moves from those to
        the pinned."""
        if len(self._vllm_pins) >= self.max_loras - 1:
            return False  # a pin no longer wanted goes first, once its adapter is idle
        unpinned = self._busy_unpinned() - (1 if entry.active else 0)
        return unpinned <= self.max_loras - len(self._vllm_pins) - 1

    def _on_disk(self, key: AdapterKey) -> bool:
        entry = self.entries.get(key)
        if entry is not None and entry.ref.path is not None:
            return True
        if self.staging.path(key).is_dir():
            return True
        return self.disk is not None and self.disk.has(key.adapter_digest)
