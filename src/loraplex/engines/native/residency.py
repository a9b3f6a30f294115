"""The native engine's residency: gpu slots over host copies over the disk cache over the remote
store.

Which adapter goes where is `loraplex.residency.placement`'s to decide; the residency describes what
it holds (`snapshot`), asks, and carries out the decisions: it moves bytes (`slots.NativeSlots`),
keeps the bookkeeping of entries (the shared ledger), waiting requests and measured costs, and
reports events for the metrics.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor

from loraplex.artifacts import AllowList
from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.slots import HostCopy, Loaded, NativeSlots, SlotPool, load_adapter
from loraplex.residency.budgets import TenantBudgets
from loraplex.residency.disk import DiskTier
from loraplex.residency.errors import CapacityExceeded
from loraplex.residency.events import Eviction, LoadFailed, LoadStage, PinRefused
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.ledger import THRASH_WINDOW_S, Entry, Ledger
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
from loraplex.residency.policy import DemandTracker, make_policy
from loraplex.residency.residency import Residency

__all__ = ["WANTED_FOR_S", "Entry", "HostCopy", "Loaded", "NativeResidency", "SlotPool"]


class NativeResidency(Residency[Entry]):
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
        thrash_window_s: float = THRASH_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        load_threads: int = 2,
        executor: Executor | None = None,
        loader: Callable[[AdapterRef], Loaded] | None = None,
    ):
        """A simulator passes its own executor and loader, to run loads on its simulated clock."""
        ledger: Ledger[Entry] = Ledger(
            policy=policy,
            budgets=budgets or TenantBudgets(pool.num_slots, cpu_bytes),
            disk=disk,
            thrash_window_s=thrash_window_s,
            clock=clock,
        )
        super().__init__(ledger)
        self.tiers = ledger.tiers = NativeSlots(pool, cpu_bytes, max_cpu_loras)
        self.tiers.warm_sets = lambda now: _warm_sets(self.placement, self.snapshot(), now)
        self.pool, self.cpu_bytes, self.max_cpu_loras = pool, cpu_bytes, max_cpu_loras
        self.slots, self.cpu = self.tiers.slots, self.tiers.cpu
        self.seconds_per_byte = self.tiers.seconds_per_byte
        self.budget_waits = ledger.budget_waits
        # the size of the gpu warm set
        self.max_gpu_warm = max_gpu_warm if max_gpu_warm is not None else pool.num_slots
        self.placement = Placement()
        self.loading: dict[AdapterKey, Future] = ledger.loading
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
        # told of each adapter `forget` drops (the engine forgets its prefix-cache blocks)
        self.on_forget: Callable[[AdapterKey], None] = lambda key: None
        self._loader = loader or functools.partial(
            load_adapter, pack=pack, disk=disk, on_event=lambda event: self.on_event(event)
        )
        self._executor = executor or ThreadPoolExecutor(
            load_threads, thread_name_prefix="lora-load"
        )

    def snapshot(self) -> Snapshot:
        """What placement reads: this residency's tables as they are now (read, never changed)."""
        ledger, tiers = self.ledger, self.tiers
        return Snapshot(
            self.entries,
            self.slots,
            self.cpu,
            tiers.cpu_bytes_used,
            self.loading,
            self.disk.has if self.disk is not None else None,
            self._wanted,
            self._waiting_since,
            self.budget_waiting,
            self.num_waiting,
            ledger.pinned_to["gpu"],
            ledger.pinned_to["cpu"],
            self.demand,
            self.activations,
            self.slot_loads,
            self.seconds_per_byte,
            self.cpu_bytes,
            self.max_cpu_loras,
            self.max_gpu_warm,
            self.policy,
            ledger.budgets,
            self._copies_version + tiers.version + ledger.pins_version,
            self._nbytes_version,
        )

    # -- the step loop's calls -------------------------------------------------------------------
    def acquire(self, ref: AdapterRef) -> int | None:
        """The slot holding the adapter, with a reference taken for the ref's tenant; None while it
        loads, no slot can free, or the tenant's budget keeps it waiting."""
        with self._lock:
            key, now, tenant = ref.key, self.clock(), ref.tenant
            entry = self.entries.setdefault(key, Entry(ref))
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

    def record_request(self, ref: AdapterRef, counted: bool = True) -> str:
        """Count one request's demand and report the tier it finds its adapter in (as a hit or miss
        event too, when `counted`)."""
        return self.ledger.count_request(ref, Entry, counted)

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
            if getattr(self.policy, "restores_gpu_warm", False):
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
                self.on_event(LoadFailed(key, type(error).__name__, error))
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
            self.on_event(PinRefused(key, "cpu", refusal))
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
            self.ledger.set_pin(ref.key, tier)
        self.prewarm(ref, tier)

    def prewarm(self, ref: AdapterRef, tier: str = "cpu") -> None:
        """Start loading ahead of traffic into cpu, or into a gpu slot when one can be had."""
        with self._lock:
            entry = self.entries.setdefault(ref.key, Entry(ref))
            entry.last_access = self.clock()
            if tier == "gpu":
                entry.prewarm_gpu = True
            if ref.key in self.cpu:
                if tier == "gpu" and self.tiers.slot_of(ref.key) is None:
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
            if (entry := self.ledger.evictable(key)) is None:
                return
            slot = self.tiers.slot_of(key)
            if slot is not None:
                self._clear(slot, self.clock())
            self.tiers.drop_cpu(key)
            self.ledger.set_pin(key, None)
            entry.prewarm_gpu = False  # a load in progress still lands in cpu, not in a slot

    def forget(self, key: AdapterKey) -> None:
        """Evict and drop all bookkeeping of a key (an unloaded adapter), in one step: the step loop
        must not take the adapter between the two."""
        with self._lock:
            self.evict(key)
            self.ledger.forget_records(key)
            self._wanted.pop(key, None)
            self._waiting_since.pop(key, None)
            self.budget_waiting.pop(key, None)
            self._nbytes_version += 1
            self._copies_version += 1
            self.activations.discard(key)
        self.on_forget(key)

    def defers(self, ref: AdapterRef) -> bool:
        """Whether a waiting request for `ref` lets other tenants' waiting requests go first: its
        tenant's budget keeps it waiting, for at most the budgets' `yield_s`."""
        return self.placement.defers(self.snapshot(), ref, self.clock())

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()

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
                    self.on_event(Eviction("cpu"))
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
        self.on_event(LoadStage("h2d", seconds, key))
        self.ledger.count_load(entry, now)
        self.activations.record(key, now)
        self.on_event(LoadStage("activation", time.perf_counter() - start, key))
        return slot

    def _clear(self, slot: int, now: float) -> None:
        key = self.tiers.clear(slot)
        self.ledger.count_eviction(self.entries[key], now)
        self.on_event(Eviction("gpu"))


def _warm_sets(
    placement: Placement, snap: Snapshot, now: float
) -> tuple[set[AdapterKey], set[AdapterKey]]:
    return placement.gpu_warm(snap, now), placement.cpu_warm(snap, now)


def residency_for(config: EngineConfig, pool: SlotPool, pack, policy=None) -> NativeResidency:
    """The engine's residency over its slot pool, from its configuration (`pack`: the engine's
    packing of an adapter's tensors into a host copy; `policy`: the configured one by default)."""
    disk = None
    if config.disk_cache_dir is not None:
        allowed = AllowList.parse(list(config.allowed_roots))
        disk = DiskTier(config.disk_cache_dir, config.disk_cache_bytes, allowed)
    return NativeResidency(
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
