"""The native mechanism: gpu slots over host copies over the disk cache over the remote store.

Which adapter goes where is `loraplex.cache.placement`'s to decide; the cache describes what it
holds (`snapshot`), asks, and carries out the decisions: it moves bytes, keeps the bookkeeping of
entries, waiting requests and measured costs, and reports events for the metrics.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.artifacts import ArtifactError, DigestMismatch, read_artifact
from loraplex.cache.budgets import TenantBudgets, charged
from loraplex.cache.disk import DiskTier
from loraplex.cache.errors import (
    AdapterInFlight,
    AdapterUnavailable,
    ArtifactCorrupt,
    CapacityExceeded,
)
from loraplex.cache.key import AdapterKey, AdapterRef
from loraplex.cache.placement import (
    WANTED_FOR_S,
    Activate,
    Decision,
    Evict,
    Load,
    Placement,
    Snapshot,
    Wait,
)
from loraplex.cache.policy import DemandTracker, LRUPolicy
from loraplex.cache.state import adapter_row
from loraplex.engines.contract import AdapterResidency

THRASH_WINDOW_S = 60.0
RATE_SMOOTHING = 0.2  # weight of the newest load in each stage's measured seconds per byte


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


class AdapterCache(AdapterResidency):
    """Only the engine's step thread calls acquire/release/poll; admin calls and reads may come
    from any thread.

    Loads run on worker threads (remote download, digest check, disk read); moving a host copy into
    a device slot happens in poll/acquire on the step thread, between forward passes.
    """

    def __init__(
        self,
        pool: SlotPool,
        # see read_artifact's `use`
        pack: Callable[[dict[str, memoryview], Callable[[str, int], None]], object],
        *,
        cpu_bytes: int,
        max_cpu_loras: int | None = None,
        disk: DiskTier | None = None,
        policy=None,
        budgets: TenantBudgets | None = None,
        max_gpu_warm: int | None = None,
        load_threads: int = 2,
        thrash_window_s: float = THRASH_WINDOW_S,
        executor: Executor | None = None,
        loader: Callable[[AdapterRef], Loaded] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pool = pool
        self._pack = pack
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
        self._copies_version = 0
        """Moves when the host copies, the loads, the cpu pins or which keys waiting requests asked
        for change: what placement derives from them is kept until it moves."""
        # A simulator passes its own executor and loader, to run loads on its simulated clock.
        self._loader = loader or self._load
        self._executor = executor or ThreadPoolExecutor(
            load_threads, thread_name_prefix="lora-load"
        )
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

    # -- the step loop's calls -------------------------------------------------------------------
    def acquire(self, ref: AdapterRef) -> int | None:
        """The slot holding the adapter, with a reference taken for the ref's tenant; None while it
        loads, no slot can free, or the tenant's budget keeps it waiting."""
        with self._lock:
            key, now, tenant = ref.key, self.clock(), ref.tenant
            entry = self.entries.setdefault(key, Entry(ref))
            entry.last_access = now
            slot = self.slot_of(key)
            if slot is None:
                decisions = self.placement.admit(self.snapshot(), key, tenant, now)
                slot = self._carry_out(decisions, now, ref)
                if slot is None:
                    self.mark_wanted(key, now)
                    return None
                self.slot_loads.record("gpu", now)
            if self._wanted.pop(key, None) is not None:
                self._copies_version += 1
            self._waiting_since.pop(key, None)
            self.budget_waiting.pop(key, None)
            entry.restored = False
            entry.refcount += 1
            entry.users[tenant] = entry.users.get(tenant, 0) + 1
            entry.last_tenant = tenant
            entry.hits += 1
            return slot

    def record_request(self, ref: AdapterRef, counted: bool = True) -> str:
        """Count one request's demand and report the tier it finds its adapter in (as a hit or miss
        event too, when `counted`)."""
        with self._lock:
            self.entries.setdefault(ref.key, Entry(ref))
            self.demand.record(ref.key, self.clock())
            tier = self.tier_of(ref.key)
        if counted:
            self.on_event("hit" if tier == "gpu" or tier == "cpu" else "miss", {"tier": tier})
        return tier

    def mark_wanted(self, key: AdapterKey, now: float) -> None:
        """A waiting request asked for `key` and did not get a slot (acquire; a simulator that skips
        a call that could only fail)."""
        if now - self._wanted.get(key, -math.inf) > WANTED_FOR_S:
            self._waiting_since[key] = now  # a new wait (an older one went away)
            self._copies_version += 1
        self._wanted[key] = now

    def record_wait(self, key: AdapterKey, now: float) -> None:
        """What a failed acquire records: the access and the wait (for a caller that skips an
        acquire that can only fail)."""
        self.entries[key].last_access = now
        self.mark_wanted(key, now)

    def touch_waiting(self, keys, at: float) -> None:
        """Requests that waited for `keys` asked for them last at `at` (a simulator's steps that it
        skipped)."""
        for key in keys:
            self.entries[key].last_access = at
            self._wanted[key] = at
        self._copies_version += 1

    def add_waiting(self, key: AdapterKey) -> None:
        """A request for `key` starts waiting for admission (new, or preempted)."""
        with self._lock:
            self.num_waiting[key] = self.num_waiting.get(key, 0) + 1

    def drop_waiting(self, key: AdapterKey) -> None:
        """A request for `key` stops waiting (admitted, aborted or failed)."""
        with self._lock:
            left = self.num_waiting[key] - 1
            if left:
                self.num_waiting[key] = left
            else:
                del self.num_waiting[key]

    def release(self, key: AdapterKey, tenant: str | None = None) -> None:
        """Drop a reference `acquire` took for `tenant` (None: for any tenant holding one)."""
        with self._lock:
            entry = self.entries[key]
            assert entry.refcount > 0, f"release of {key} without a reference"
            entry.refcount -= 1
            users = entry.users
            held = tenant is not None and users.get(tenant)
            holder = tenant if held else next((t for t, n in users.items() if n), None)
            if holder is not None:
                users[holder] -= 1
                if not users[holder]:
                    del users[holder]
            if entry.refcount == 0:
                _notify(self._on_released, key)
            if entry.refcount == 0 and self._gpu_pins:
                self._restore(self.placement.restore_pinned, self.clock())
            if entry.refcount == 0 and getattr(self.policy, "restores_gpu_warm", False):
                now = self.clock()
                self._forget_stale_asks(now)
                self._restore(self.placement.restore_warm, now)

    def poll(self) -> list[tuple[AdapterKey, BaseException]]:
        """Take finished loads into the cpu tier; return the keys whose load failed, with the
        error."""
        failed, ended = [], []
        with self._lock:
            for key, future in list(self.loading.items()):
                if not future.done():
                    continue
                del self.loading[key]
                ended.append(key)
                self._copies_version += 1
                error = future.exception()
                if error is not None:
                    if key in self.entries:  # a later load, for whatever reason, is not it
                        self.entries[key].prewarm_gpu = False
                    failed.append((key, error))
                    self.on_event(
                        "load_failed",
                        {"error": type(error).__name__, "key": key, "exception": error},
                    )
                    continue
                loaded: Loaded = future.result()
                entry = self.entries.get(key)
                if entry is None:
                    continue  # forgotten while it loaded: the result is dropped
                entry.nbytes = loaded.packed.nbytes
                self._nbytes_version += 1
                entry.loads += 1
                entry.load_seconds = sum(loaded.stages.values())
                for stage, seconds in loaded.stages.items():
                    self._measure(stage, seconds, entry.nbytes)
                # load first, then evict: a failed load never evicted anything
                self._put_cpu(key, loaded.packed)
                if entry.pinned == "cpu" and not self.placement.cpu_pins_fit(self.snapshot()):
                    # Pinned before its bytes were known: kept as an ordinary host copy rather than
                    # overfill the tier.
                    self._set_pin(key, None)
                    self.on_event(
                        "pin_refused",
                        {
                            "key": key,
                            "tier": "cpu",
                            "error": (
                                f"cannot pin {key} to cpu: with its {entry.nbytes} bytes, pinned "
                                f"adapters would exceed cpu_cache_bytes ({self.cpu_bytes}); it "
                                "stays cached, unpinned"
                            ),
                        },
                    )
                now = self.clock()
                self._carry_out(self.placement.shrink_host(self.snapshot(), key, now), now)
                if entry.prewarm_gpu and key in self.cpu and self.slot_of(key) is None:
                    now = self.clock()
                    self._carry_out(self.placement.activate(self.snapshot(), key, now, None), now)
                entry.prewarm_gpu = False
            for key in ended:
                _notify(self._on_loaded, key)
        return failed

    def drain(self, timeout: float = 60.0) -> list[tuple[AdapterKey, BaseException]]:
        """Wait for every load in progress and take it in (prewarm, tests, shutdown)."""
        deadline = time.monotonic() + timeout
        failed = []
        while self.loading and time.monotonic() < deadline:
            for future in list(self.loading.values()):
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
            failed += self.poll()
        return failed

    # -- operator calls (any thread) -------------------------------------------------------------
    def pin(self, ref: AdapterRef, tier: str) -> None:
        """Keep the adapter resident in `tier` (gpu or cpu) until unpinned; loads it now if
        needed."""
        if tier not in ("gpu", "cpu"):
            raise ValueError(f"pin tier {tier!r}: use gpu or cpu")
        with self._lock:
            self.entries.setdefault(ref.key, Entry(ref))
            refusal = self.placement.pin_refusal(self.snapshot(), ref.key, tier)
            if refusal is not None:
                raise CapacityExceeded(refusal)
            self._set_pin(ref.key, tier)
        self.prewarm(ref, tier)

    def restore_pin(self, key: AdapterKey, pinned: str | None) -> None:
        """Put back the pin an entry had (an operator call that failed undoes its own pins)."""
        with self._lock:
            if key in self.entries:
                self._set_pin(key, pinned)

    def _set_pin(self, key: AdapterKey, pinned: str | None) -> None:
        self.entries[key].pinned = pinned
        self._copies_version += 1
        for tier, pins in (("gpu", self._gpu_pins), ("cpu", self._cpu_pins)):
            if pinned == tier:
                pins.add(key)
            else:
                pins.discard(key)

    def unpin(self, key: AdapterKey) -> None:
        with self._lock:
            if key in self.entries:
                self._set_pin(key, None)

    def prewarm(self, ref: AdapterRef, tier: str = "cpu") -> None:
        """Start loading ahead of traffic into cpu, or into a gpu slot when one can be had."""
        with self._lock:
            entry = self.entries.setdefault(ref.key, Entry(ref))
            entry.last_access = self.clock()
            if tier == "gpu":
                entry.prewarm_gpu = True
            if ref.key in self.cpu:
                if tier == "gpu" and self.slot_of(ref.key) is None:
                    # no slot free or freeable: it stays in cpu
                    now = self.clock()
                    decisions = self.placement.activate(self.snapshot(), ref.key, now, None)
                    self._carry_out(decisions, now)
                entry.prewarm_gpu = False
                return
            self._start_load(ref)

    def evict(self, key: AdapterKey) -> None:
        """Drop the adapter from gpu and cpu now; refused while requests use it."""
        with self._lock:
            entry = self.entries.get(key)
            if entry is None:
                return
            if entry.refcount:
                raise AdapterInFlight(
                    f"{key} has {entry.refcount} request(s) in flight; try again when they end"
                )
            slot = self.slot_of(key)
            if slot is not None:
                self._clear(slot, self.clock())
            self._drop_cpu(key)
            self._set_pin(key, None)
            entry.prewarm_gpu = False  # a load in progress still lands in cpu, not in a slot

    def forget(self, key: AdapterKey) -> None:
        """Evict and drop all bookkeeping of a key (an unloaded adapter), in one step: the step loop
        must not take the adapter between the two."""
        with self._lock:
            self.evict(key)
            self.entries.pop(key, None)
            self._wanted.pop(key, None)
            self._waiting_since.pop(key, None)
            self.budget_waiting.pop(key, None)
            self._nbytes_version += 1
            self._copies_version += 1
            self.demand.discard(key)
            self.activations.discard(key)

    # -- internals -------------------------------------------------------------------------------
    def _start_load(self, ref: AdapterRef) -> None:
        if ref.key not in self.loading:
            self.loading[ref.key] = self._executor.submit(self._loader, ref)
            self._copies_version += 1

    def _load(self, ref: AdapterRef) -> Loaded:
        """Worker thread: bytes from disk or the remote store, digest checked, packed into a host
        buffer."""
        stages = {}
        try:
            if ref.path is not None:
                start = time.perf_counter()
                # one read; packed while the digest check runs, kept only if it matches
                packed = read_artifact(
                    ref.path, ref.key.adapter_digest, use=self._pack, pieces=ref.pieces
                )
                stages["disk"] = time.perf_counter() - start
                source = "disk"
            elif self.disk is not None and ref.storage_uri:
                start = time.perf_counter()
                packed, download_s = self.disk.read(
                    ref.storage_uri, ref.key.adapter_digest, use=self._pack, pieces=ref.pieces
                )
                stages["disk"] = time.perf_counter() - start - (download_s or 0.0)
                if download_s is not None:
                    stages["download"] = download_s
                source = "disk" if download_s is None else "remote"
            else:
                raise AdapterUnavailable(
                    f"adapter {ref.key}: no local path and no storage URI to load it from"
                )
        except AdapterUnavailable:
            raise
        except DigestMismatch as exc:
            raise ArtifactCorrupt(
                f"adapter {ref.key}: {exc}",
                f"adapter {ref.key} failed its digest check and is not served",
            ) from exc
        except (ArtifactError, OSError, ValueError) as exc:
            raise AdapterUnavailable(
                f"adapter {ref.key} could not be loaded: {exc}",
                f"adapter {ref.key} could not be loaded; try again later",
            ) from exc
        for stage, seconds in stages.items():
            self.on_event("load_stage", {"stage": stage, "seconds": seconds, "key": ref.key})
        return Loaded(packed, source, stages)

    def _carry_out(
        self, decisions: Sequence[Decision], now: float, ref: AdapterRef | None = None
    ) -> int | None:
        """Do what placement decided, in order; the slot an activation filled, or None. `ref`: the
        request's, which a load starts from."""
        slot = None
        for d in decisions:
            match d:
                case Evict(key, "gpu"):
                    self._clear(self.slots.index(key), now)
                case Evict(key, _):
                    self._drop_cpu(key)
                    self.on_event("eviction", {"tier": "cpu"})
                case Activate(key, into, restored):
                    slot = self._activate(key, into, now)
                    self.entries[key].restored = restored
                case Load(key, tenant):
                    self.entries[key].last_tenant = tenant  # its host copy counts for the asker
                    self._start_load(ref if ref is not None else self.entries[key].ref)
                case Wait(key, _, tenant):
                    self._wait_for_budget(key, tenant, now)
        return slot

    def _restore(self, rule: Callable[[Snapshot, float], list[Decision]], now: float) -> None:
        """Carry out a restore rule's decisions, one adapter at a time, until it has none."""
        while decisions := rule(self.snapshot(), now):
            self._carry_out(decisions, now)

    def _forget_stale_asks(self, now: float) -> None:
        """Drop the asks of waiting requests that went away (none asked again in WANTED_FOR_S)."""
        for key, asked in list(self._wanted.items()):
            if now - asked > WANTED_FOR_S:
                del self._wanted[key]
                self._copies_version += 1
                self._waiting_since.pop(key, None)

    def _activate(self, key: AdapterKey, slot: int, now: float) -> int:
        """Copy the host copy into `slot`, which is free."""
        entry = self.entries[key]
        start = time.perf_counter()
        modeled = self.pool.set_slot(slot, self.cpu[key])
        seconds = time.perf_counter() - start if modeled is None else modeled
        self._measure("h2d", seconds, entry.nbytes)
        self.on_event("load_stage", {"stage": "h2d", "seconds": seconds, "key": key})
        self.slots[slot] = key
        entry.loaded_at = now
        self.activations.record(key, now)
        if entry.evicted_at is not None and now - entry.evicted_at < self.thrash_window_s:
            self.reloads_after_eviction += 1
            self.on_event("reload_after_eviction", {})
        self.on_event(
            "load_stage",
            {"stage": "activation", "seconds": time.perf_counter() - start, "key": key},
        )
        return slot

    # -- budgets (placement applies the rule; here, the counts it reports) ----------------------
    def set_budgets(self, budgets: TenantBudgets) -> None:
        """New budgets (from the registry): they apply from the next placement on; nothing is
        evicted for them."""
        with self._lock:
            self.budgets = budgets

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

    def defers(self, ref: AdapterRef) -> bool:
        """Whether a waiting request for `ref` lets other tenants' waiting requests go first: its
        tenant's budget keeps it waiting, for at most the budgets' `yield_s`."""
        return self.placement.defers(self.snapshot(), ref, self.clock())

    def _wait_for_budget(self, key: AdapterKey, tenant: str, now: float) -> None:
        """A request of `tenant` for `key` waits because of its budget: counted once per wait."""
        if key in self.budget_waiting and now - self._wanted.get(key, -math.inf) <= WANTED_FOR_S:
            return  # the same wait, asked again at this step
        self.budget_waiting[key] = (tenant, now)
        self.budget_waits[tenant] = self.budget_waits.get(tenant, 0) + 1
        self.on_event("budget_wait", {"tenant": tenant, "key": key})

    def _clear(self, slot: int, now: float) -> None:
        key = self.slots[slot]
        assert key is not None, f"clear of the empty slot {slot}"
        self.pool.clear_slot(slot)
        self.slots[slot] = None
        entry = self.entries[key]
        entry.evictions += 1
        entry.evicted_at = now
        self.num_evictions += 1
        self.recent_evictions.append(now)
        self.on_event("eviction", {"tier": "gpu"})

    def _put_cpu(self, key: AdapterKey, packed: HostCopy) -> None:
        self._drop_cpu(key)
        self.cpu[key] = packed
        self.cpu_bytes_used += packed.nbytes
        self._copies_version += 1
        if key in self.entries:
            self.entries[key].in_host_since = self.clock()

    def _drop_cpu(self, key: AdapterKey) -> None:
        if key in self.cpu:
            self.cpu_bytes_used -= self.cpu.pop(key).nbytes
            self._copies_version += 1

    def _measure(self, stage: str, seconds: float, nbytes: int) -> None:
        if nbytes > 0:
            old = self.seconds_per_byte.get(stage)
            new = seconds / nbytes
            self.seconds_per_byte[stage] = (
                new if old is None else old + RATE_SMOOTHING * (new - old)
            )

    def _on_disk(self, key: AdapterKey) -> bool:
        entry = self.entries.get(key)
        if entry is not None and entry.ref.path is not None:
            return True
        return self.disk is not None and self.disk.has(key.adapter_digest)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()


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
