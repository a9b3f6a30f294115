"""The native mechanism: gpu slots over host copies over the disk cache over the remote store.

Which adapter goes where is `loraplex.residency.placement`'s to decide; the cache describes what it
holds (`snapshot`), asks, and carries out the decisions: it moves bytes, keeps the bookkeeping of
entries, waiting requests and measured costs, and reports events for the metrics.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor

from loraplex.artifacts import ArtifactError, DigestMismatch, read_artifact
from loraplex.engines.contract import AdapterResidency
from loraplex.engines.native.cache_tables import (
    CacheTables,
    Entry,
    HostCopy,
    Loaded,
    SlotPool,
)
from loraplex.residency.errors import (
    AdapterUnavailable,
    ArtifactCorrupt,
    CapacityExceeded,
)
from loraplex.residency.events import Eviction, LoadFailed, LoadStage, PinRefused
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.placement import (
    WANTED_FOR_S,
    Activate,
    Decision,
    Evict,
    Load,
    Snapshot,
    Wait,
)

__all__ = ["WANTED_FOR_S", "AdapterCache", "Entry", "HostCopy", "Loaded", "SlotPool"]

RATE_SMOOTHING = 0.2  # weight of the newest load in each stage's measured seconds per byte


class AdapterCache(CacheTables, AdapterResidency):
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
        load_threads: int = 2,
        executor: Executor | None = None,
        loader: Callable[[AdapterRef], Loaded] | None = None,
        **tables,
    ):
        """`tables`: `CacheTables`' capacities, policy, budgets, disk tier and clock."""
        super().__init__(pool, **tables)
        self._pack = pack
        # A simulator passes its own executor and loader, to run loads on its simulated clock.
        self._loader = loader or self._load
        self._executor = executor or ThreadPoolExecutor(
            load_threads, thread_name_prefix="lora-load"
        )

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
            entry.take_user(tenant)
            entry.hits += 1
            return slot

    def record_request(self, ref: AdapterRef, counted: bool = True) -> str:
        """Count one request's demand and report the tier it finds its adapter in (as a hit or miss
        event too, when `counted`)."""
        return self.count_request(ref, Entry, counted)

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
            if entry.refcount == 0:
                self.released(key)
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
                    self.on_event(LoadFailed(key, type(error).__name__, error))
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
                    self.set_pin(key, None)
                    refusal = (
                        f"cannot pin {key} to cpu: with its {entry.nbytes} bytes, pinned adapters "
                        f"would exceed cpu_cache_bytes ({self.cpu_bytes}); it stays cached, "
                        "unpinned"
                    )
                    self.on_event(PinRefused(key, "cpu", refusal))
                now = self.clock()
                self._carry_out(self.placement.shrink_host(self.snapshot(), key, now), now)
                if entry.prewarm_gpu and key in self.cpu and self.slot_of(key) is None:
                    now = self.clock()
                    self._carry_out(self.placement.activate(self.snapshot(), key, now, None), now)
                entry.prewarm_gpu = False
            for key in ended:
                self.load_ended(key)
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
            self.set_pin(ref.key, tier)
        self.prewarm(ref, tier)

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
            if (entry := self.evictable(key)) is None:
                return
            slot = self.slot_of(key)
            if slot is not None:
                self._clear(slot, self.clock())
            self._drop_cpu(key)
            self.set_pin(key, None)
            entry.prewarm_gpu = False  # a load in progress still lands in cpu, not in a slot

    def forget(self, key: AdapterKey) -> None:
        """Evict and drop all bookkeeping of a key (an unloaded adapter), in one step: the step loop
        must not take the adapter between the two."""
        with self._lock:
            self.evict(key)
            self.forget_records(key)
            self._wanted.pop(key, None)
            self._waiting_since.pop(key, None)
            self.budget_waiting.pop(key, None)
            self._nbytes_version += 1
            self._copies_version += 1
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
            self.on_event(LoadStage(stage, seconds, ref.key))
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
                    self.on_event(Eviction("cpu"))
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
        self.on_event(LoadStage("h2d", seconds, key))
        self.slots[slot] = key
        self.count_load(entry, now)
        self.activations.record(key, now)
        self.on_event(LoadStage("activation", time.perf_counter() - start, key))
        return slot

    # -- budgets (placement applies the rule; the ledger counts) ---------------------------------
    def defers(self, ref: AdapterRef) -> bool:
        """Whether a waiting request for `ref` lets other tenants' waiting requests go first: its
        tenant's budget keeps it waiting, for at most the budgets' `yield_s`."""
        return self.placement.defers(self.snapshot(), ref, self.clock())

    def _wait_for_budget(self, key: AdapterKey, tenant: str, now: float) -> None:
        """A request of `tenant` for `key` waits because of its budget: counted once per wait."""
        if key in self.budget_waiting and now - self._wanted.get(key, -math.inf) <= WANTED_FOR_S:
            return  # the same wait, asked again at this step
        self.budget_waiting[key] = (tenant, now)
        self.count_budget_wait(tenant, key)

    def _clear(self, slot: int, now: float) -> None:
        key = self.slots[slot]
        assert key is not None, f"clear of the empty slot {slot}"
        self.pool.clear_slot(slot)
        self.slots[slot] = None
        self.count_eviction(self.entries[key], now)
        self.on_event(Eviction("gpu"))

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

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()
