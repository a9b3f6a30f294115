"""The residency's moves over a slot pool with host copies (`Backend` of `residency.py`): an
engine's device slots (the native engine's slot pool, `SlotPool`: write a host copy into a slot,
clear one) over host copies (packed, in host memory), and the moves between them.

Which adapter goes where is `placement.py`'s to decide; the backend describes what it holds
(`snapshot`), asks, and carries out the decisions: it moves bytes (`PoolTiers`), loads host copies
on its load threads (the engine's loader: `loraplex.engines.native.adapter_load.load_adapter`, or
a simulator's), keeps the waiting requests and the measured costs, and reports events for the
metrics. Only the engine's step thread calls acquire, release and poll; operator calls come
through the residency, from any thread. Moving a host copy into a device slot happens in poll and
acquire, on the step thread, between forward passes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Protocol

from loraplex.host_memory import release_freed
from loraplex.residency.events import Eviction, LoadFailed, LoadStage, PinRefused
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.ledger import Entry, Ledger
from loraplex.residency.placement import (
    WANTED_FOR_S,
    Activate,
    Decision,
    Evict,
    Load,
    Placement,
    Snapshot,
    Wait,
)
from loraplex.residency.policy import DemandTracker

__all__ = ["WANTED_FOR_S", "PoolTiers", "SlotPool", "SlotPoolBackend"]

HostCopy = Any  # the engine's packed copy of an adapter, written into a slot (`nbytes` read here)
Loaded = Any  # a finished load: its host copy (`packed`) and each stage's seconds (`stages`)

RATE_SMOOTHING = 0.2  # weight of the newest load in each stage's measured seconds per byte


class SlotPool(Protocol):
    num_slots: int

    def set_slot(self, slot: int, packed) -> float | None:
        """Write the host copy into the slot; a pool that models its copies (the simulator's)
        returns the seconds the copy takes, any other None (the residency times it)."""

    def clear_slot(self, slot: int) -> None: ...


class PoolTiers:
    """Which adapter holds each slot, the host copies and their bytes, and the measured cost of
    each load stage: the ledger's `Tiers`. `warm_sets` is the backend's (placement reads all of
    it)."""

    def __init__(self, pool: SlotPool, cpu_bytes: int, max_cpu_loras: int | None):
        self.pool = pool
        self.cpu_bytes = cpu_bytes
        self.max_cpu_loras = max_cpu_loras
        self.slots: list[AdapterKey | None] = [None] * pool.num_slots
        # changed only by put_cpu and drop_cpu, which keep the total and move `version`
        self.cpu: dict[AdapterKey, HostCopy] = {}
        self.cpu_bytes_used = 0
        self.version = 0
        # measured per load stage (download, disk, h2d)
        self.seconds_per_byte: dict[str, float] = {}
        self.warm_sets: Callable[[float], tuple[set[AdapterKey], set[AdapterKey]]]

    # -- the ledger's view (`Tiers`) ---------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def in_slot(self, key: AdapterKey) -> bool:
        return key in self.slots

    def in_host_memory(self, key: AdapterKey) -> bool:
        return key in self.cpu

    def in_slots(self) -> list[AdapterKey]:
        return [k for k in self.slots if k is not None]

    def in_host(self) -> list[AdapterKey]:
        return list(self.cpu)

    def free_slots(self) -> int:
        return self.slots.count(None)

    def staged(self, key: AdapterKey) -> bool:
        return False

    def adapter_row(self, entry: Entry, row: dict) -> dict:
        return row

    def host_figures(self) -> dict:
        return {"cpu_bytes_used": self.cpu_bytes_used, "cpu_bytes_capacity": self.cpu_bytes}

    # -- moves -------------------------------------------------------------------------------------
    def slot_of(self, key: AdapterKey) -> int | None:
        return self.slots.index(key) if key in self.slots else None

    def fill(self, key: AdapterKey, slot: int) -> float:
        """Copy the key's host copy into `slot`, which is free; the seconds the copy took."""
        start = time.perf_counter()
        modeled = self.pool.set_slot(slot, self.cpu[key])
        seconds = time.perf_counter() - start if modeled is None else modeled
        self.slots[slot] = key
        return seconds

    def clear(self, slot: int) -> AdapterKey:
        """Empty `slot`; the key that held it."""
        key = self.slots[slot]
        assert key is not None, f"clear of the empty slot {slot}"
        self.pool.clear_slot(slot)
        self.slots[slot] = None
        return key

    def put_cpu(self, key: AdapterKey, packed: HostCopy) -> None:
        self.drop_cpu(key)
        self.cpu[key] = packed
        self.cpu_bytes_used += packed.nbytes
        self.version += 1

    def drop_cpu(self, key: AdapterKey) -> None:
        if key in self.cpu:
            self.cpu_bytes_used -= self.cpu.pop(key).nbytes
            self.version += 1

    def measure(self, stage: str, seconds: float, nbytes: int) -> None:
        if nbytes > 0:
            old = self.seconds_per_byte.get(stage)
            new = seconds / nbytes
            self.seconds_per_byte[stage] = (
                new if old is None else old + RATE_SMOOTHING * (new - old)
            )


class SlotPoolBackend:
    """The moves of a slot pool's adapters (the native engine's), decided by placement over
    `snapshot`."""

    def __init__(
        self,
        ledger: Ledger[Entry],
        pool: SlotPool,
        loader: Callable[[AdapterRef], Loaded],
        *,
        cpu_bytes: int,
        max_cpu_loras: int | None = None,
        max_gpu_warm: int | None = None,
        load_threads: int = 2,
        executor: Executor | None = None,
    ):
        """`loader`: a load's host copy from the adapter's ref, run on the load threads (the
        engine's `load_adapter`; a simulator's, with its own executor, to run loads on its
        simulated clock)."""
        self.ledger = ledger
        self.entries, self.loading, self._lock = ledger.entries, ledger.loading, ledger._lock
        self.tiers = PoolTiers(pool, cpu_bytes, max_cpu_loras)
        self.tiers.warm_sets = lambda now: _warm_sets(self.placement, self.snapshot(), now)
        self.pool, self.cpu_bytes, self.max_cpu_loras = pool, cpu_bytes, max_cpu_loras
        self.slots, self.cpu = self.tiers.slots, self.tiers.cpu
        self.seconds_per_byte = self.tiers.seconds_per_byte
        # the size of the gpu warm set
        self.max_gpu_warm = max_gpu_warm if max_gpu_warm is not None else pool.num_slots
        self.placement = Placement()
        # slot activations per adapter: what its host copy served
        self.activations = DemandTracker(ranked=False)
        # one key, "gpu": activations that requests asked for
        self.slot_loads = DemandTracker(ranked=False)
        # keys a waiting request asked for and has not got yet -> when it last asked
        self._wanted: dict[AdapterKey, float] = {}
        self._nbytes_version = 0  # moves when an entry's bytes change (the cpu warm set uses them)
        # when a key's waiting requests first asked
        self._waiting_since: dict[AdapterKey, float] = {}
        # key -> (tenant, since): waiting requests that their tenant's budget holds back
        self.budget_waiting: dict[AdapterKey, tuple[str, float]] = {}
        # requests waiting for admission, per adapter (add_waiting / drop_waiting)
        self.num_waiting: dict[AdapterKey, int] = {}
        # moves when loads or wanted keys change (with the host copies' and the pins' versions)
        self._copies_version = 0
        self._loader = loader
        self._executor = executor or ThreadPoolExecutor(
            load_threads, thread_name_prefix="lora-load"
        )

    @property
    def clock(self) -> Callable[[], float]:
        return self.ledger.clock

    def snapshot(self) -> Snapshot:
        """What placement reads: these tables as they are now (read, never changed)."""
        ledger, tiers = self.ledger, self.tiers
        return Snapshot(
            self.entries,
            self.slots,
            self.cpu,
            tiers.cpu_bytes_used,
            self.loading,
            ledger.disk.has if ledger.disk is not None else None,
            self._wanted,
            self._waiting_since,
            self.budget_waiting,
            self.num_waiting,
            ledger.pinned_to["gpu"],
            ledger.pinned_to["cpu"],
            ledger.demand,
            self.activations,
            self.slot_loads,
            self.seconds_per_byte,
            self.cpu_bytes,
            self.max_cpu_loras,
            self.max_gpu_warm,
            ledger.policy,
            ledger.budgets,
            self._copies_version + tiers.version + ledger.pins_version,
            self._nbytes_version,
        )

    def new_entry(self, ref: AdapterRef) -> Entry:
        return Entry(ref)

    # -- the step loop's calls -------------------------------------------------------------------
    def acquire(self, ref: AdapterRef) -> int | None:
        """The slot holding the adapter, with a reference taken for the ref's tenant; None while it
        loads, no slot can free, or the tenant's budget keeps it waiting."""
        with self._lock:
            key, now, tenant = ref.key, self.clock(), ref.tenant
            entry = self.entries.get(key) or self.entries.setdefault(key, Entry(ref))
            entry.last_access = now
            slot = self.tiers.slot_of(key)
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
            entry.take_user(tenant)
            entry.hits += 1
            return slot

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
            entry.drop_user(tenant)
            if entry.refcount:
                return
            self.ledger.released(key)
            if self.ledger.pinned_to["gpu"]:
                self._restore(self.placement.restore_pinned, self.clock())
            if getattr(self.ledger.policy, "restores_gpu_warm", False):
                now = self.clock()
                # drop the asks of waiting requests that went away (none asked in WANTED_FOR_S)
                for stale, asked in list(self._wanted.items()):
                    if now - asked > WANTED_FOR_S:
                        del self._wanted[stale]
                        self._copies_version += 1
                        self._waiting_since.pop(stale, None)
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
                if error is None:
                    self._take_in(key, future.result())
                    continue
                if key in self.entries:  # a later load, for whatever reason, is not it
                    self.entries[key].prewarm_gpu = False
                failed.append((key, error))
                self.ledger.on_event(LoadFailed(key, type(error).__name__, error))
            for key in ended:
                self.ledger.load_ended(key)
        return failed

    def _take_in(self, key: AdapterKey, loaded: Loaded) -> None:
        """A finished load's host copy joins the cpu tier (and a slot, for a gpu prewarm)."""
        entry = self.entries.get(key)
        if entry is None:
            return  # forgotten while it loaded: the result is dropped
        entry.nbytes = loaded.packed.nbytes
        self._nbytes_version += 1
        entry.loads += 1
        entry.load_seconds = sum(loaded.stages.values())
        for stage, seconds in loaded.stages.items():
            self.tiers.measure(stage, seconds, entry.nbytes)
        # load first, then evict: a failed load never evicted anything
        self.tiers.put_cpu(key, loaded.packed)
        entry.in_host_since = self.clock()
        if entry.pinned == "cpu" and not self.placement.cpu_pins_fit(self.snapshot()):
            # Pinned before its bytes were known: kept as an ordinary host copy rather than
            # overfill the tier.
            self.ledger.set_pin(key, None)
            refusal = (
                f"cannot pin {key} to cpu: with its {entry.nbytes} bytes, pinned adapters would "
                f"exceed cpu_cache_bytes ({self.cpu_bytes}); it stays cached, unpinned"
            )
            self.ledger.on_event(PinRefused(key, "cpu", refusal))
        now = self.clock()
        self._carry_out(self.placement.shrink_host(self.snapshot(), key, now), now)
        if entry.prewarm_gpu and key in self.cpu and self.tiers.slot_of(key) is None:
            now = self.clock()
            self._carry_out(self.placement.activate(self.snapshot(), key, now, None), now)
        entry.prewarm_gpu = False

    def drain(self, timeout: float = 60.0) -> list[tuple[AdapterKey, BaseException]]:
        """Wait for every load in progress and take it in (prewarm, tests, shutdown)."""
        deadline = time.monotonic() + timeout
        failed = []
        while self.loading and time.monotonic() < deadline:
            for future in list(self.loading.values()):
                future.exception(timeout=max(0.0, deadline - time.monotonic()))
            failed += self.poll()
        return failed

    def defers(self, ref: AdapterRef) -> bool:
        """Whether a waiting request for `ref` lets other tenants' waiting requests go first: its
        tenant's budget keeps it waiting, for at most the budgets' `yield_s`."""
        return self.placement.defers(self.snapshot(), ref, self.clock())

    # -- the residency's operator calls (under its lock) -----------------------------------------
    def pin_refusal(self, key: AdapterKey, tier: str) -> str | None:
        return self.placement.pin_refusal(self.snapshot(), key, tier)

    def prewarm(self, ref: AdapterRef, tier: str) -> None:
        entry = self.entries[ref.key]
        if tier == "gpu":
            entry.prewarm_gpu = True
        if ref.key in self.cpu:
            if tier == "gpu" and self.tiers.slot_of(ref.key) is None:
                # no slot free or freeable: it stays in cpu
                now = self.clock()
                self._carry_out(self.placement.activate(self.snapshot(), ref.key, now, None), now)
            entry.prewarm_gpu = False
            return
        self._start_load(ref)

    def drop(self, key: AdapterKey, entry: Entry) -> None:
        slot = self.tiers.slot_of(key)
        if slot is not None:
            self._clear(slot, self.clock())
        self.tiers.drop_cpu(key)
        entry.prewarm_gpu = False  # a load in progress still lands in cpu, not in a slot

    def forget(self, key: AdapterKey, entry: Entry | None) -> None:
        self._wanted.pop(key, None)
        self._waiting_since.pop(key, None)
        self.budget_waiting.pop(key, None)
        self._nbytes_version += 1
        self._copies_version += 1
        self.activations.discard(key)
        release_freed()  # its host copy's memory goes back to the system

    def budgets_changed(self) -> None:
        """Nothing moves for new budgets: the next placement reads them."""

    def when_loaded(self, key: AdapterKey) -> Future:
        return self.ledger.when_loaded(key)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- internals -------------------------------------------------------------------------------
    def _start_load(self, ref: AdapterRef) -> None:
        if ref.key not in self.loading:
            self.loading[ref.key] = self._executor.submit(self._loader, ref)
            self._copies_version += 1

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
                    self.tiers.drop_cpu(key)
                    self.ledger.on_event(Eviction("cpu"))
                case Activate(key, into, restored):
                    slot = self._activate(key, into, now)
                    self.entries[key].restored = restored
                case Load(key, tenant):
                    self.entries[key].last_tenant = tenant  # its host copy counts for the asker
                    self._start_load(ref if ref is not None else self.entries[key].ref)
                case Wait(key, _, tenant):
                    # a request of `tenant` waits because of its budget: counted once per wait
                    asked = self._wanted.get(key, -math.inf)
                    if key not in self.budget_waiting or now - asked > WANTED_FOR_S:
                        self.budget_waiting[key] = (tenant, now)
                        self.ledger.count_budget_wait(tenant, key)
        return slot

    def _restore(self, rule: Callable[[Snapshot, float], list[Decision]], now: float) -> None:
        """Carry out a restore rule's decisions, one adapter at a time, until it has none."""
        while decisions := rule(self.snapshot(), now):
            self._carry_out(decisions, now)

    def _activate(self, key: AdapterKey, slot: int, now: float) -> int:
        """Copy the host copy into `slot`, which is free."""
        entry = self.entries[key]
        start = time.perf_counter()
        seconds = self.tiers.fill(key, slot)
        self.tiers.measure("h2d", seconds, entry.nbytes)
        self.ledger.on_event(LoadStage("h2d", seconds, key))
        self.ledger.count_load(entry, now)
        self.activations.record(key, now)
        self.ledger.on_event(LoadStage("activation", time.perf_counter() - start, key))
        return slot

    def _clear(self, slot: int, now: float) -> None:
        key = self.tiers.clear(slot)
        self.ledger.count_eviction(self.entries[key], now)
        self.ledger.on_event(Eviction("gpu"))


def _warm_sets(
    placement: Placement, snap: Snapshot, now: float
) -> tuple[set[AdapterKey], set[AdapterKey]]:
    return placement.gpu_warm(snap, now), placement.cpu_warm(snap, now)
