"""The bookkeeping of a worker's adapters, one for both engines' residencies: an entry per adapter
(its references and the tenants holding them, its pin, its costs), the demand, evictions and
their thrash, the tenants' budgets and budget waits, and the futures operator calls wait on.

The residency holds a ledger, and its engine's backend says, through its `Tiers`, which adapters are
where; everything a reader asks of the adapters (`tier_of`, `state`, `budget_state`, ...) is
answered here from that. Every change happens under `_lock`, from any thread: no event loop is
assumed.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from loraplex.residency.budgets import TenantBudgets, charged, tenant_rows
from loraplex.residency.disk import DiskTier
from loraplex.residency.errors import AdapterInFlight
from loraplex.residency.events import BudgetWait, Event, Lookup, ReloadAfterEviction
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.policy import DemandTracker, LRUPolicy
from loraplex.residency.state import adapter_row

THRASH_WINDOW_S = 60.0
"""An adapter loaded again this soon after its eviction counts as thrash."""


@dataclass
class Entry:
    """One adapter as a residency tracks it, whatever its engine."""

    ref: AdapterRef
    refcount: int = 0  # requests holding it: never evicted while above 0
    last_access: float = 0.0
    loaded_at: float = 0.0  # its last activation into a slot (vLLM: into its host cache)
    hits: int = 0
    loads: int = 0
    evictions: int = 0
    nbytes: int = 0
    load_seconds: float = 0.0  # its last load, all stages
    pinned: str | None = None  # the operator's pin: "gpu" or "cpu"
    evicted_at: float | None = None
    in_host_since: float = 0.0  # when its host copy last landed
    prewarm_gpu: bool = False  # a prewarm asked for a slot once its host copy lands
    restored: bool = False  # put back in its slot by placement (gpu warm set), not asked for since
    users: dict[str, int] = field(default_factory=dict)  # tenant -> its requests holding it
    last_tenant: str = ""  # the tenant whose request used it last (at first, the ref's)

    def __post_init__(self):
        self.last_tenant = self.last_tenant or self.ref.tenant

    @property
    def charged(self) -> frozenset[str]:
        """The tenants its residency counts for (`budgets.charged`)."""
        return charged(self.users, self.last_tenant)

    def take_user(self, tenant: str) -> None:
        """A request of `tenant` holds it now."""
        self.users[tenant] = self.users.get(tenant, 0) + 1
        self.last_tenant = tenant

    def drop_user(self, tenant: str | None) -> None:
        """A request of `tenant` (None: of any tenant holding it) lets it go."""
        holder = tenant if tenant is not None and self.users.get(tenant) else None
        holder = holder or next((t for t, n in self.users.items() if n), None)
        if holder is None:
            return
        if self.users[holder] > 1:
            self.users[holder] -= 1
        else:
            del self.users[holder]


E = TypeVar("E", bound=Entry)


class Tiers(Protocol):
    """What a residency's engine holds: which adapters are in a device slot and in host memory,
    the slots it counts, its warm sets and what it adds to `state`. The native engine's slots
    (`slot_pool.PoolTiers`) and the vLLM engine's tables (`runtime.VllmTables`)."""

    @property
    def num_slots(self) -> int: ...

    def in_slot(self, key: AdapterKey) -> bool: ...
    def in_host_memory(self, key: AdapterKey) -> bool: ...
    def in_slots(self) -> Iterable[AdapterKey]:
        """The adapters holding a device slot."""
        ...

    def in_host(self) -> Iterable[AdapterKey]:
        """The adapters with a host copy (those in a slot have one too)."""
        ...

    def free_slots(self) -> int: ...
    def warm_sets(self, now: float) -> tuple[set[AdapterKey], set[AdapterKey]]:
        """The gpu warm set and the cpu warm set."""
        ...

    def staged(self, key: AdapterKey) -> bool:
        """Whether a local copy of the key's bytes exists outside the disk tier."""
        ...

    def adapter_row(self, entry: Any, row: dict) -> dict:
        """An adapter's row of `state`, with what the engine adds to it."""
        ...

    def host_figures(self) -> dict:
        """What `state` says of the host cache's use and capacity."""
        ...


class Ledger(Generic[E]):
    """The adapters' records and the reads over them, a member of each engine's residency. What
    its engine holds is `tiers`' to say; `on_pins_changed` is called after the operator's pins
    change (outside the lock)."""

    tiers: Tiers  # set by the residency that holds the ledger

    def __init__(
        self,
        *,
        policy=None,
        budgets: TenantBudgets,
        disk: DiskTier | None = None,
        thrash_window_s: float = THRASH_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.policy = policy or LRUPolicy()
        self.budgets = budgets
        self.disk = disk
        self.thrash_window_s = thrash_window_s
        self.clock = clock
        self.entries: dict[AdapterKey, E] = {}
        self.loading: dict[AdapterKey, Any] = {}  # key -> its load in progress (a future)
        self.demand = DemandTracker()  # requests per adapter
        self.budget_waits: dict[str, int] = {}  # per tenant, requests' waits that its budget caused
        self.recent_evictions: deque[float] = deque(maxlen=1000)
        self.num_evictions = 0
        self.reloads_after_eviction = 0
        self.on_event: Callable[[Event], None] = lambda event: None
        self.on_pins_changed: Callable[[], None] = lambda: None
        # the operator's pins, in the order they were made: key -> "gpu" or "cpu"
        self.pins: dict[AdapterKey, str] = {}
        self.pinned_to: dict[str, set[AdapterKey]] = {
            "gpu": set(),
            "cpu": set(),
        }  # the same, per tier
        self.pins_version = 0  # moves with every pin set or dropped
        # futures operator calls wait on: a key's load ended, its last release
        self._on_loaded: dict[AdapterKey, list[Future]] = {}
        self._on_released: dict[AdapterKey, list[Future]] = {}
        self._lock = threading.RLock()

    # -- reads (any thread) ------------------------------------------------------------------------
    def tier_of(self, key: AdapterKey) -> str:
        with self._lock:
            if self.tiers.in_slot(key):
                return "gpu"
            if self.tiers.in_host_memory(key):
                return "cpu"
            return "disk" if self.on_disk(key) else "remote"

    def pinned(self, key: AdapterKey) -> str | None:
        """The tier the adapter is pinned to (gpu or cpu), or None."""
        entry = self.entries.get(key)
        return entry.pinned if entry is not None else None

    def nbytes_of(self, key: AdapterKey) -> int:
        entry = self.entries.get(key)
        return entry.nbytes if entry else 0

    def is_loading(self, key: AdapterKey) -> bool:
        return key in self.loading

    def on_disk(self, key: AdapterKey) -> bool:
        entry = self.entries.get(key)
        if entry is not None and entry.ref.path is not None:
            return True
        if self.tiers.staged(key):
            return True
        return self.disk is not None and self.disk.has(key.adapter_digest)

    def thrash_ratio(self) -> float:
        return self.reloads_after_eviction / self.num_evictions if self.num_evictions else 0.0

    def num_recent_evictions(self, now: float) -> int:
        """Evictions in the thrash window before `now`."""
        times, window = self.recent_evictions, self.thrash_window_s  # oldest first
        return len(times) - bisect.bisect_left(times, True, key=lambda t: now - t < window)

    def state(self) -> dict:
        """`/admin/state`'s residency: every adapter, the copies per tier, the slots, the thrash
        and the tenants' budgets."""
        now = self.clock()
        with self._lock:
            gpu_warm, cpu_warm = self.tiers.warm_sets(now)
            in_slots, in_host = set(self.tiers.in_slots()), set(self.tiers.in_host())
            adapters: list[dict] = []
            copies: dict[str, list[int]] = {"gpu": [], "cpu": [], "disk": []}
            for key, e in self.entries.items():
                disk = self.on_disk(key)  # a file system look per adapter: once
                tier = (
                    "gpu"
                    if key in in_slots
                    else "cpu"
                    if key in in_host
                    else "disk"
                    if disk
                    else "remote"
                )
                for t, held in (("gpu", key in in_slots), ("cpu", key in in_host), ("disk", disk)):
                    if held:
                        copies[t].append(e.nbytes)
                # "A" in the gpu warm set, "B" in the cpu warm set (both: "A")
                warm = "A" if key in gpu_warm else "B" if key in cpu_warm else None
                row = adapter_row(key, e, tier, key in self.loading, warm, self.demand, now)
                adapters.append(self.tiers.adapter_row(e, row))
            return {
                "adapters": adapters,
                "resident": {t: {"count": len(v), "bytes": sum(v)} for t, v in copies.items()},
                "num_slots": self.tiers.num_slots,
                "free_slots": self.tiers.free_slots(),
                "recent_evictions": self.num_recent_evictions(now),
                **self.tiers.host_figures(),
                "thrash_ratio": self.thrash_ratio(),
                "tenants": self.budget_state(),
            }

    def tenant_usage(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per tier (gpu, cpu), per tenant: {"count", "bytes"} of what is charged to it there."""
        with self._lock:
            out: dict[str, dict[str, dict[str, int]]] = {}
            for tier, keys in (("gpu", self.tiers.in_slots()), ("cpu", self.tiers.in_host())):
                per = out[tier] = {}
                for key in keys:
                    e = self.entries[key]
                    for t in e.charged:
                        row = per.setdefault(t, {"count": 0, "bytes": 0})
                        row["count"] += 1
                        row["bytes"] += e.nbytes
            return out

    def budget_state(self) -> dict[str, dict]:
        """Per tenant: slots and host bytes used against its budget, and its budget waits."""
        with self._lock:
            return tenant_rows(self.budgets, self.tenant_usage(), self.budget_waits)

    def when_loaded(self, key: AdapterKey) -> Future:
        """Done once no load of `key` is in progress: at once, or when its load ends."""
        with self._lock:
            return _watch(self._on_loaded, key, key not in self.loading)

    def when_released(self, key: AdapterKey) -> Future:
        """Done once no request holds `key`: at once, or when its last reference is dropped."""
        with self._lock:
            entry = self.entries.get(key)
            return _watch(self._on_released, key, entry is None or not entry.refcount)

    # -- changes (any thread) ----------------------------------------------------------------------
    def set_budgets(self, budgets: TenantBudgets) -> None:
        """New budgets (from the registry): they apply from the next placement on; nothing is
        evicted for them."""
        with self._lock:
            self.budgets = budgets

    def restore_pin(self, key: AdapterKey, pinned: str | None) -> None:
        """Put back the pin an entry had (an operator call that failed undoes its own pins)."""
        with self._lock:
            if key in self.entries:
                self.set_pin(key, pinned)
        self.on_pins_changed()

    def set_pin(self, key: AdapterKey, tier: str | None) -> None:
        self.entries[key].pinned = tier
        if tier is None:
            self.pins.pop(key, None)
        else:
            self.pins[key] = tier
        for pinned_to, keys in self.pinned_to.items():
            if tier == pinned_to:
                keys.add(key)
            else:
                keys.discard(key)
        self.pins_version += 1

    def evictable(self, key: AdapterKey) -> E | None:
        """The entry an operator's evict acts on (None: an adapter never seen); AdapterInFlight
        while requests hold it."""
        entry = self.entries.get(key)
        if entry is not None and entry.refcount:
            raise AdapterInFlight(
                f"{key} has {entry.refcount} request(s) in flight; try again when they end"
            )
        return entry

    def count_request(
        self, ref: AdapterRef, make: Callable[[AdapterRef], E], counted: bool = True
    ) -> str:
        """Count one request's demand; the tier it finds its adapter in, reported as a hit (a slot
        or host memory) or a miss when `counted`."""
        with self._lock:
            if ref.key not in self.entries:
                self.entries[ref.key] = make(ref)
            self.demand.record(ref.key, self.clock())
            tier = self.tier_of(ref.key)
        if counted:
            self.on_event(Lookup(tier))
        return tier

    def count_budget_wait(self, tenant: str, key: AdapterKey) -> None:
        """A request of `tenant` for `key` waits because of its tenant's budget."""
        self.budget_waits[tenant] = self.budget_waits.get(tenant, 0) + 1
        self.on_event(BudgetWait(tenant, key))

    def count_eviction(self, entry: E, now: float) -> None:
        entry.evictions += 1
        entry.evicted_at = now
        self.num_evictions += 1
        self.recent_evictions.append(now)

    def count_load(self, entry: E, now: float) -> None:
        """The adapter came back (into a slot, or vLLM's host cache): thrash when it had left within
        the thrash window."""
        entry.loaded_at = now
        if entry.evicted_at is not None and now - entry.evicted_at < self.thrash_window_s:
            self.reloads_after_eviction += 1
            self.on_event(ReloadAfterEviction(entry.ref.key))

    def forget_records(self, key: AdapterKey) -> E | None:
        """Drop every record of `key` (an unloaded adapter); its entry, if it had one."""
        if key in self.entries:
            self.set_pin(key, None)
        self.demand.discard(key)
        return self.entries.pop(key, None)

    def load_ended(self, key: AdapterKey) -> None:
        """The operator calls waiting for the key's load go on."""
        _notify(self._on_loaded, key)

    def released(self, key: AdapterKey) -> None:
        """The operator calls waiting for the key's last release go on."""
        _notify(self._on_released, key)


def _watch(watchers: dict[AdapterKey, list[Future]], key: AdapterKey, done: bool) -> Future:
    future: Future = Future()
    if done:
        future.set_result(None)
    else:
        watchers.setdefault(key, []).append(future)
    return future


def _notify(watchers: dict[AdapterKey, list[Future]], key: AdapterKey) -> None:
    for future in watchers.pop(key, ()):
        future.set_result(None)
