"""The residency's moves over a runtime that keeps its own host cache and device slots, vLLM
(`Backend` of `residency.py`): which adapters the runtime holds, decided by loraplex as
membership of its host cache and its pinned set, and carried out through the runtime's adapter
calls (`runtime.RuntimeSlots`, over a running vLLM's, `loraplex.engines.vllm.slots`, or the
simulator's modelled vLLM).

vLLM keeps up to `max_cpu_loras` adapters in host memory and `max_loras` in device slots, and evicts
the least recently used unpinned one when it must. Here loraplex makes those choices first: it
stages each artifact into a private, digest-verified directory (the bytes vLLM reads), adds it
ahead of traffic (prewarm, warm policies, the cpu warm set), removes its own policy's victim before
vLLM's LRU would pick one, never removes an adapter with requests in flight, pins (`pin_lora`) the
operator's gpu pins and (under `score`) the busy adapters of the gpu warm set, and hands vLLM the
requests of a few more distinct unpinned adapters than it has unpinned slots, which vLLM's scheduler
starts as slots free (its count of pinned slots is loraplex's fix, in the engine's `patches.py`;
without it, while a slot is pinned, no more than the unpinned slots). vLLM still orders the unpinned
adapters in its device slots.

Tenant residency budgets (`budgets.py`) hold here as on a slot pool (`slot_pool.py`): the slots
counted are those of adapters pinned or with requests handed to vLLM, the host bytes those of the
adapters in vLLM's host cache. A tenant beyond its gpu budget leaves a free slot to other tenants'
waiting requests (for a bounded time); one beyond its host budget pushes out only its own adapters.

The bookkeeping is shared by the event loop (requests) and other threads (admin calls, the registry
watcher): every change of it happens under the ledger's lock; the runtime's calls are coroutines,
run on the server's loop. The tables are `runtime.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from loraplex.artifacts import ArtifactError
from loraplex.residency import host_cache as rules
from loraplex.residency.decisions import Evict, Load, Pin, Unpin, Wait
from loraplex.residency.errors import AdapterUnavailable
from loraplex.residency.events import Event, Eviction, LoadFailed, LoadStage
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.ledger import Ledger
from loraplex.residency.runtime import (
    WARM_PIN_LOOK_S,
    Resident,
    Runtime,
    RuntimeSlots,
    VllmTables,
)

log = logging.getLogger(__name__)

__all__ = ["RuntimeCacheBackend"]


class RuntimeCacheBackend:
    """The moves of a vLLM engine's adapters: adds, removes and pins in vLLM, decided by
    `host_cache.py`'s rules over the tables' `snapshot`."""

    def __init__(
        self,
        ledger: Ledger[Resident],
        runtime: Runtime,
        *,
        max_loras: int,
        max_cpu_loras: int,
        reserved_slots: int = 0,
        scheduler_counts_pins: bool = False,
    ):
        """`runtime`: what it runs over (`EngineRuntime`: a vLLM engine and its staged copies; the
        simulator's); `reserved_slots`, `scheduler_counts_pins`: `VllmTables`'."""
        self.ledger = ledger
        self.entries, self.pins, self._lock = ledger.entries, ledger.pins, ledger._lock
        self.tiers = self.tables = VllmTables(
            ledger,
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            reserved_slots=reserved_slots,
            scheduler_counts_pins=scheduler_counts_pins,
        )
        self.staging = self.tables.staging = runtime.staging(ledger.disk, self.tables.in_use)
        self.slots = RuntimeSlots(runtime, self.staging)
        ledger.on_pins_changed = lambda: self._schedule(self._follow_demand())
        self.loading: dict[AdapterKey, asyncio.Future] = ledger.loading
        self.loop: asyncio.AbstractEventLoop | None = None  # set by `start`, on the server's loop
        self._room = asyncio.Event()  # set when a release may have made a victim available

    @property
    def clock(self) -> Callable[[], float]:
        return self.ledger.clock

    def on_event(self, event: Event) -> None:
        self.ledger.on_event(event)

    def new_entry(self, ref: AdapterRef) -> Resident:
        return self.tables.entry(ref)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.slots.start()

    def when_loaded(self, key: AdapterKey) -> Future:
        """Done once no load of `key` is in progress, looked at on the server's loop after the calls
        scheduled there before it (a prewarm's load starts on the loop)."""
        if self.loop is None:  # not started: nothing loads
            return self.ledger.when_loaded(key)

        async def loaded() -> None:
            await asyncio.wrap_future(self.ledger.when_loaded(key))

        return asyncio.run_coroutine_threadsafe(loaded(), self.loop)

    # -- the request path (event loop) -------------------------------------------------------------
    async def acquire(self, ref: AdapterRef) -> Any:
        """The adapter in vLLM's host cache with a reference taken (it stays until `release`); loads
        it first when needed. Raises AdapterUnavailable when its bytes cannot be had."""
        tenant = ref.tenant
        with self._lock:
            entry = self.tables.entry(ref)
            entry.refcount += 1
            entry.last_access = self.clock()
            entry.restorable = True
            if not entry.in_vllm and ref.key not in self.loading:
                entry.last_tenant = tenant  # its host copy counts for the tenant whose load it is
        try:
            while not entry.in_vllm:
                await self._load(ref)
            self.tables.host_waiting.discard(ref.key)
            await self._follow_demand()
            await self._wait_for_slot(entry, tenant)
        except BaseException:
            self._unref(entry, None)
            raise
        with self._lock:
            entry.hits += 1
            if not entry.active:
                entry.busy.set(True, self.clock())
            entry.active += 1
            self.tables.running.add(ref.key)
            entry.take_user(tenant)
        self._room.set()  # a request that yielded to this one may find a slot still free
        return self.slots.request(entry.ref.key, entry.lora_id)

    def release(self, key: AdapterKey, tenant: str | None = None) -> None:
        """A request of `tenant` handed to vLLM by `acquire` ended (None: any tenant's)."""
        entry = self.entries.get(key)
        if entry is not None:
            held = tenant is not None and entry.users.get(tenant)
            holder = tenant if held else next(iter(entry.users), "")
            self._unref(entry, holder)

    async def _wait_for_slot(self, entry: Resident, tenant: str) -> None:
        """Until a request of `tenant` for `entry` may go to vLLM: as loads land and requests end, a
        slot frees (`has_slot`). A request outside the gpu warm set leaves a free slot to the set's
        waiting adapters (`yields_to_warm`); a tenant beyond its gpu budget leaves one to other
        tenants' waiting requests for up to the budgets' `yield_s` (`yields_slot`)."""
        deferred_at = None
        self.tables.slot_waiting[tenant] = self.tables.slot_waiting.get(tenant, 0) + 1
        try:
            while True:
                with self._lock:
                    snap, now = self.tables.snapshot(), self.clock()
                    waited_s = now - deferred_at if deferred_at is not None else None
                    free = rules.has_slot(snap, entry)
                    free = free and not rules.yields_to_warm(snap, entry, now)
                    if free and not rules.yields_slot(snap, entry, tenant, waited_s):
                        return
                    if free and deferred_at is None:
                        deferred_at, waited_s = now, 0.0
                        self.ledger.count_budget_wait(tenant, entry.ref.key)
                    timeout = rules.defer_left(snap, waited_s)
                    pin_goes = any(k not in self.pins for k in snap.runtime_pins)
                    pin_goes = pin_goes and not rules.has_slot(snap, entry)
                self._room.clear()
                if pin_goes:
                    # a warm pin whose adapter went idle goes (`_follow_demand`); its busy share
                    # falls with time, so look again soon
                    await self._follow_demand()
                    timeout = min(timeout or WARM_PIN_LOOK_S, WARM_PIN_LOOK_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), timeout)
        finally:
            self.tables.slot_waiting[tenant] -= 1
            if not self.tables.slot_waiting[tenant]:
                del self.tables.slot_waiting[tenant]

    def _may_add(self, entry: Resident) -> bool:
        """Whether a waiting request's adapter may take a place in vLLM's host cache now: its
        request may go to vLLM, or a place is spare (`host_cache.spare_room`). A request that cannot
        run yet would hold its host copy while it waits for a slot: it waits without one rather
        than push out an adapter of the gpu warm set for it."""
        with self._lock:
            snap = self.tables.snapshot()
            return rules.has_slot(snap, entry) or rules.spare_room(snap, self.clock())

    def _unref(self, entry: Resident, holder: str | None) -> None:
        """Drop a request's reference; `holder`: the tenant whose request vLLM ran (None: one that
        never reached vLLM)."""
        with self._lock:
            entry.refcount = max(0, entry.refcount - 1)
            if holder is not None:
                entry.active = max(0, entry.active - 1)
                if not entry.active:
                    self.tables.running.discard(entry.ref.key)
                    entry.busy.set(False, self.clock())
                entry.drop_user(holder)
            entry.last_access = self.clock()
            if not entry.refcount:
                self.ledger.released(entry.ref.key)
            # a pin no longer wanted goes once its adapter is idle
            unpin = entry.vllm_pinned and not entry.refcount
            unpin = unpin and entry.ref.key not in self.tables.pins_wanted
            restore = not (entry.refcount or rules.waits(self.tables.snapshot()))
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._room.set)
            if unpin:
                self._schedule(self._follow_demand())
            if restore:
                self._schedule(self._restore_warm())

    # -- the residency's operator calls (under its lock) -------------------------------------------
    def pin_refusal(self, key: AdapterKey, tier: str) -> str | None:
        return rules.pin_refusal(self.tables.snapshot(), key, tier)

    def prewarm(self, ref: AdapterRef, tier: str) -> None:
        """Add the adapter to vLLM ahead of traffic (and pin it in a slot when its tier is gpu and
        it is pinned)."""
        self._schedule(self._prewarm(ref))

    def drop(self, key: AdapterKey, entry: Resident) -> None:
        """Remove the adapter from vLLM now, out until its next request."""
        entry.restorable = False
        self._schedule(self._remove(key))

    def forget(self, key: AdapterKey, entry: Resident | None) -> None:
        if entry is not None:
            self.tables.ids.pop(entry.lora_id, None)
        self.tables.held.pop(key, None)
        self.tables.running.discard(key)
        self.tables.vllm_pins.discard(key)

    def budgets_changed(self) -> None:
        """Waiting requests look again."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._room.set)

    def close(self) -> None:
        self.staging.close()

    # -- internals -------------------------------------------------------------------------------

    def _schedule(self, coro: Coroutine) -> None:
        """Run `coro` on the server's loop, from that loop or any other thread; errors are
        logged."""
        if self.loop is None:
            coro.close()
            return
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        future.add_done_callback(_log_failure)

    async def _prewarm(self, ref: AdapterRef) -> None:
        entry = self.entries.get(ref.key)
        if entry is None:
            return
        if not entry.in_vllm:
            await self._load(ref)
        await self._follow_demand()

    async def _load(self, ref: AdapterRef) -> None:
        """Stage (verify) and add to vLLM; one load per key at a time, shared by its waiting
        requests."""
        future = self.loading.get(ref.key)
        if future is None:
            future = self.loading[ref.key] = asyncio.ensure_future(self._stage_and_add(ref))
            future.add_done_callback(lambda _: self._load_ended(ref.key))
        await asyncio.shield(future)

    def _load_ended(self, key: AdapterKey) -> None:
        with self._lock:
            self.loading.pop(key, None)
            self.ledger.load_ended(key)

    async def _stage_and_add(self, ref: AdapterRef) -> None:
        loop = asyncio.get_running_loop()
        try:
            nbytes, stages, shape = await loop.run_in_executor(
                self.staging.executor, self.staging.stage, ref
            )
        except AdapterUnavailable as exc:  # the fetch's (`loraplex.residency.fetch`)
            self.on_event(LoadFailed(ref.key, type(exc).__name__, exc))
            raise
        except (ArtifactError, OSError) as exc:  # writing the staged copy
            self.on_event(LoadFailed(ref.key, type(exc).__name__, exc))
            raise AdapterUnavailable(
                f"adapter {ref.key} could not be loaded: {exc}",
                f"adapter {ref.key} could not be loaded",
            ) from None
        self.staging.reuse(ref.key)
        entry = self.entries.get(ref.key)
        if entry is None:
            return  # forgotten while it loaded
        entry.nbytes, entry.shape = nbytes, shape
        while entry.refcount and not self._may_add(entry):
            self._room.clear()
            await self._room.wait()
        start = time.perf_counter()
        added = await self._send_add(entry)
        if added is None:
            return  # in vLLM already
        if self.slots.takes(entry.lora_id, entry.shape):
            # vLLM added these bytes before, or an adapter of the same shape, so it takes them: its
            # engine core runs the add before any request sent after it (one input queue), and the
            # requests need not wait for the answer's round trip. The answer still ends the add
            # (`_added`).
            self.tables.num_adding -= 1  # counted from here on as in vLLM
            added.add_done_callback(lambda task: self._added(entry, task, counted=False))
        else:  # a first add may be refused (a module or rank vLLM cannot serve): wait for it
            try:  # awaited outside the lock: vLLM takes every add sent meanwhile between two steps
                await added
            finally:
                self._added(entry, added)
        with self._lock:
            self.tables.set_in_vllm(entry, True)
            entry.loads += 1
            self.ledger.count_load(entry, self.clock())
        stages["activation"] = time.perf_counter() - start
        for stage, seconds in stages.items():
            self.on_event(LoadStage(stage, seconds, ref.key))

    async def _send_add(self, entry: Resident) -> asyncio.Task | None:
        """Make room in vLLM's host cache and send the add (None: the adapter is there already)."""
        lock = self.slots.lock
        assert lock is not None  # made by `start`
        async with lock:  # room made and the add sent in the order vLLM takes them
            if entry.in_vllm:
                return None
            while len(self.tables.held) + self.tables.num_adding >= self.tables.max_cpu_loras:
                if await self._make_room(entry):
                    continue
                self._room.clear()
                lock.release()  # wait for a release without holding up other adds
                try:
                    await self._room.wait()
                finally:
                    await lock.acquire()
            self.tables.num_adding += 1
            entry.adding = True
            if entry.refcount:
                self.tables.host_loads.record("cpu", self.clock())
            return await self.slots.send(self.slots.add(entry.ref.key, entry.lora_id))

    def _added(self, entry: Resident, task: asyncio.Task, counted: bool = True) -> None:
        """The end of an add sent to vLLM (`counted`: still in `_num_adding`). A known adapter's
        add that failed takes it out of the bookkeeping: its requests fail in vLLM alone."""
        if counted:
            self.tables.num_adding -= 1
        entry.adding = False
        error = None if task.cancelled() else task.exception()
        failed = task.cancelled() or error is not None
        self.slots.took(entry.lora_id, entry.shape, not failed)
        if error is not None:
            self.on_event(LoadFailed(entry.ref.key, "AdapterRejected", error))
        if failed and not counted:  # counted in vLLM already (`_stage_and_add`)
            self.tables.set_in_vllm(entry, False)
        self._room.set()  # a refused add leaves its room to the loads that wait

    async def _make_room(self, incoming: Resident) -> bool:
        """Carry out `host_cache.make_room` for the load of `incoming`; False when nothing can go
        now."""
        key = incoming.ref.key
        with self._lock:
            decisions = rules.make_room(self.tables.snapshot(), incoming, self.clock())
            for d in decisions:
                if isinstance(d, Wait) and key not in self.tables.host_waiting:
                    self.tables.host_waiting.add(key)  # counted once per wait
                    self.ledger.count_budget_wait(d.tenant, key)
        victims = [d.key for d in decisions if isinstance(d, Evict)]
        if not victims:
            return False
        self.tables.host_waiting.discard(key)
        await self._remove(victims[0], locked=True)
        return True

    async def _remove(self, key: AdapterKey, locked: bool = False) -> None:
        if not locked:
            assert self.slots.lock is not None  # made by `start`
            async with self.slots.lock:
                return await self._remove(key, locked=True)
        entry = self.entries.get(key)
        if entry is None or not entry.in_vllm or entry.refcount or entry.adding:
            return
        with self._lock:  # before the send yields: no request goes to vLLM with it from now
            self.tables.set_in_vllm(entry, False)
            self.ledger.count_eviction(entry, self.clock())
        self.staging.unstage(key, entry.nbytes)
        removed = await self.slots.remove(entry.lora_id)
        removed.add_done_callback(_log_failure)
        self.on_event(Eviction("cpu"))

    async def _restore_warm(self) -> None:
        """Carry out `host_cache.restore`: one adapter of the cpu warm set back into vLLM's host
        cache ahead of its requests, for a place that is free or that its victim leaves. Every
        release that leaves nothing waiting makes one call."""
        with self._lock:
            decisions = rules.restore(self.tables.snapshot(), self.clock())
        for d in decisions:
            if isinstance(d, Evict):
                await self._remove(d.key)
            elif isinstance(d, Load):
                entry = self.entries.get(d.key)
                waits = rules.waits(self.tables.snapshot())
                if entry is not None and not entry.in_vllm and not waits:
                    await self._load(entry.ref)

    async def _follow_demand(self) -> None:
        """Pin in vLLM's device slots what `pins_to_hold` gives, and unpin what it no longer gives
        once idle: vLLM has no unpin, so the adapter is removed and added again, from its staged
        copy. An adapter that `may_pin` refuses now is pinned by a later call (every request,
        pin and prewarm makes one)."""
        with self._lock:
            wanted = rules.pins_to_hold(self.tables.snapshot(), self.clock())
            self.tables.pins_wanted = set(wanted)
            changes = rules.pin_changes(self.tables.snapshot(), wanted)
        to_unpin = [d.key for d in changes if isinstance(d, Unpin)]
        to_pin = [d.key for d in changes if isinstance(d, Pin)]
        if not changes:
            return
        assert self.slots.lock is not None  # made by `start`
        async with self.slots.lock:
            for key in to_unpin:
                with self._lock:  # before the send yields: no request goes to vLLM with it now
                    entry = self.entries.get(key)
                    if entry is None or entry.refcount or not entry.vllm_pinned:
                        continue
                    if key in self.tables.pins_wanted:
                        continue
                    self.tables.set_in_vllm(entry, False)
                # a copy changed since it was verified waits for the next load, which stages again
                if await self.slots.add_again(key, entry.lora_id):
                    self.tables.set_in_vllm(entry, True)
                self._room.set()
            for key in to_pin:
                with self._lock:  # counted as pinned from here (`has_slot`), before the send
                    entry = self.entries.get(key)
                    if entry is None or not entry.in_vllm or entry.vllm_pinned:
                        continue
                    may = rules.may_pin(self.tables.snapshot(), entry)
                    if key not in self.tables.pins_wanted or not may:
                        continue
                    self.tables.set_vllm_pinned(entry, True)
                pinned = False
                try:
                    pinned = await self.slots.pin(entry.lora_id)
                finally:
                    if not pinned:
                        self.tables.set_vllm_pinned(entry, False)
                        self._room.set()


def _log_failure(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        error = future.exception()
        log.warning("adapter operation on the vLLM engine failed: %s", error)
