"""The adapter cache: gpu slots over host copies over the disk cache over the remote store."""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.artifacts import ArtifactError, DigestMismatch, read_artifact
from loraplex.cache.budgets import TenantBudgets, charged, usage
from loraplex.cache.disk import DiskTier
from loraplex.cache.errors import (
    AdapterInFlight,
    AdapterUnavailable,
    ArtifactCorrupt,
    CapacityExceeded,
)
from loraplex.cache.key import AdapterKey, AdapterRef
from loraplex.cache.policy import Candidate, DemandTracker, LRUPolicy

THRASH_WINDOW_S = 60.0
RATE_SMOOTHING = 0.2  # weight of the newest load in each stage's measured seconds per byte
WANTED_FOR_S = (
    2.0  # a waiting request asks again every step; older asks belong to requests that went away
)


class SlotPool(Protocol):
    num_slots: int

    def set_slot(self, slot: int, packed) -> float | None:
        """Write the host copy into the slot; a pool that models its copies (the simulator's) returns the
        seconds the copy takes, any other None (the cache times it)."""

    def clear_slot(self, slot: int) -> None: ...


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
    prewarm_gpu: bool = False
    restored: bool = False  # put back in its slot by the cache (tier A), not asked for since
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
    packed: object
    source: str  # tier the bytes came from: disk or remote
    stages: dict[str, float] = field(default_factory=dict)


class AdapterCache:
    """Only the engine's step thread calls acquire/release/poll; admin calls and reads may come from any thread.

    Loads run on worker threads (remote download, digest check, disk read); moving a host copy into a device
    slot happens in poll/acquire on the step thread, between forward passes.
    """

    def __init__(
        self,
        pool: SlotPool,
        pack: Callable[
            [dict[str, memoryview], Callable[[str, int], None]], object
        ],  # see read_artifact's `use`
        *,
        cpu_bytes: int,
        max_cpu_loras: int | None = None,
        disk: DiskTier | None = None,
        policy=None,
        budgets: TenantBudgets | None = None,
        max_gpu_preferred: int | None = None,
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
        self.max_gpu_preferred = (
            max_gpu_preferred if max_gpu_preferred is not None else pool.num_slots
        )
        self.clock = clock
        self.thrash_window_s = thrash_window_s
        self.slots: list[AdapterKey | None] = [None] * pool.num_slots
        self.cpu: dict[
            AdapterKey, object
        ] = {}  # changed only by _put_cpu and _drop_cpu, which keep the total
        self.cpu_bytes_used = 0  # bytes of the host copies in self.cpu
        self.entries: dict[AdapterKey, Entry] = {}
        self.loading: dict[AdapterKey, Future] = {}
        self.demand = DemandTracker()  # requests per adapter
        self.activations = DemandTracker(
            ranked=False
        )  # slot activations per adapter: what its host copy served
        self.slot_loads = DemandTracker(
            ranked=False
        )  # one key, "gpu": activations that requests asked for
        self.seconds_per_byte: dict[
            str, float
        ] = {}  # measured per load stage (download, disk, h2d)
        self.recent_evictions: deque[float] = deque(maxlen=1000)
        self.reloads_after_eviction = 0
        self.num_evictions = 0
        self.on_event: Callable[[str, dict], None] = lambda kind, fields: None
        self._wanted: dict[
            AdapterKey, float
        ] = {}  # keys a waiting request asked for and has not got yet
        self._nbytes_version = 0  # moves when an entry's bytes change (tier B depends on them)
        self._preferred_memo: dict[
            str, tuple[tuple, set[AdapterKey]]
        ] = {}  # tier -> (inputs, adapters)
        self._waiting_since: dict[
            AdapterKey, float
        ] = {}  # when a key's waiting requests first asked
        # key -> (tenant, since): waiting requests that their tenant's budget holds back
        self.budget_waiting: dict[AdapterKey, tuple[str, float]] = {}
        self.budget_waits: dict[str, int] = {}  # per tenant, requests' waits that its budget caused
        self.queued: dict[
            AdapterKey, int
        ] = {}  # requests waiting for admission, per adapter (queue / unqueue)
        self._gpu_pins: set[AdapterKey] = (
            set()
        )  # the entries pinned to gpu, and to cpu (kept with `pinned`)
        self._cpu_pins: set[AdapterKey] = set()
        self._copies_version = 0
        """Moves when the host copies, the loads, the cpu pins or which keys waiting requests asked for change: what
        `_room_for` derives from them is kept until it moves."""
        self._copies_memo: (
            tuple[tuple[int, int], float, tuple[set[AdapterKey], int, int]] | None
        ) = None
        # A simulator passes its own executor and loader, to run loads on its simulated clock.
        self._loader = loader or self._load
        self._executor = executor or ThreadPoolExecutor(
            load_threads, thread_name_prefix="lora-load"
        )
        self._lock = threading.RLock()

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
            tier_a, tier_b, in_slots = (
                self._gpu_preferred(now),
                self._cpu_preferred(now),
                set(self.slots),
            )
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
                adapters.append(
                    {
                        "name": key.name,
                        "revision": key.revision,
                        "digest": key.adapter_digest,
                        "base_model_digest": key.base_model_digest,
                        "tenant": e.ref.tenant,
                        "charged_to": sorted(e.charged),
                        "tier": tier,
                        "loading": key in self.loading,
                        "bytes": e.nbytes,
                        "pinned": e.pinned,
                        "in_flight": e.refcount,
                        "hits": e.hits,
                        "loads": e.loads,
                        "evictions": e.evictions,
                        "last_access_s_ago": round(now - e.last_access, 3),
                        "demand_5m": round(self.demand.short(key, now), 3),
                        # the warm set the demand keeps: A preferred on the device, B in host memory (both: A)
                        "warm": "A" if key in tier_a else "B" if key in tier_b else None,
                    }
                )
            copies = {
                "gpu": [k for k in self.slots if k is not None],
                "cpu": list(self.cpu),
                "disk": on_disk,
            }
            return {
                "adapters": adapters,
                # Per tier, the adapters with a copy there (one in a slot has its host copy too) and their bytes.
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
            if slot is None and key in self.cpu and not self._yields(key, now):
                slot = self._activate(key, now, tenant)
                if slot is not None:
                    self.slot_loads.record("gpu", now)
            if slot is None:
                if key not in self.cpu and key not in self.loading and self._room_for(key, now):
                    if self._host_budget_allows(key, tenant):
                        entry.last_tenant = tenant  # its host copy counts for the tenant asking
                        self._start_load(ref)
                    else:
                        self._wait_for_budget(key, tenant, now)
                self.mark_wanted(key, now)
                return None
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
        """Count one request's demand and report the tier it finds its adapter in (as a hit or miss event too,
        when `counted`)."""
        with self._lock:
            self.entries.setdefault(ref.key, Entry(ref))
            self.demand.record(ref.key, self.clock())
            tier = self.tier_of(ref.key)
        if counted:
            self.on_event("hit" if tier == "gpu" or tier == "cpu" else "miss", {"tier": tier})
        return tier

    def mark_wanted(self, key: AdapterKey, now: float) -> None:
        """A waiting request asked for `key` and did not get a slot (acquire; a simulator that skips a call that
        could only fail)."""
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
        """Requests that waited for `keys` asked for them last at `at` (a simulator's steps that it skipped)."""
        for key in keys:
            self.entries[key].last_access = at
            self._wanted[key] = at
        self._copies_version += 1

    def queue(self, key: AdapterKey) -> None:
        """A request for `key` joined the scheduler's waiting queue (new, or preempted)."""
        with self._lock:
            self.queued[key] = self.queued.get(key, 0) + 1

    def unqueue(self, key: AdapterKey) -> None:
        """A request for `key` left the waiting queue (admitted, aborted or failed)."""
        with self._lock:
            left = self.queued[key] - 1
            if left:
                self.queued[key] = left
            else:
                del self.queued[key]

    def release(self, key: AdapterKey, tenant: str | None = None) -> None:
        """Drop a reference `acquire` took for `tenant` (None: for any tenant holding one)."""
        with self._lock:
            entry = self.entries[key]
            assert entry.refcount > 0, f"release of {key} without a reference"
            entry.refcount -= 1
            users = entry.users
            holder = tenant if users.get(tenant) else next((t for t, n in users.items() if n), None)
            if holder is not None:
                users[holder] -= 1
                if not users[holder]:
                    del users[holder]
            if entry.refcount == 0 and self._gpu_pins:
                self._restore_pinned(self.clock())
            if entry.refcount == 0 and getattr(self.policy, "restores_preferred", False):
                self._restore_preferred(self.clock())

    def poll(self) -> list[tuple[AdapterKey, Exception]]:
        """Take finished loads into the cpu tier; return the keys whose load failed, with the error."""
        failed = []
        with self._lock:
            for key, future in list(self.loading.items()):
                if not future.done():
                    continue
                del self.loading[key]
                self._copies_version += 1
                error = future.exception()
                if error is not None:
                    if key in self.entries:
                        self.entries[
                            key
                        ].prewarm_gpu = False  # a later load, for whatever reason, is not it
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
                self._put_cpu(
                    key, loaded.packed
                )  # load first, then evict: a failed load never evicted anything
                if entry.pinned == "cpu" and self._cpu_pinned_bytes() > self.cpu_bytes:
                    # Pinned before its bytes were known: kept as an ordinary host copy rather than overfill the tier.
                    self._set_pin(key, None)
                    self.on_event(
                        "pin_refused",
                        {
                            "key": key,
                            "tier": "cpu",
                            "error": (
                                f"cannot pin {key} to cpu: with its {entry.nbytes} bytes, pinned adapters would exceed "
                                f"cpu_cache_bytes ({self.cpu_bytes}); it stays cached, unpinned"
                            ),
                        },
                    )
                self._shrink_cpu(keep=key)
                if entry.prewarm_gpu and key in self.cpu and self.slot_of(key) is None:
                    self._activate(key, self.clock())
                entry.prewarm_gpu = False
        return failed

    def drain(self, timeout: float = 60.0) -> list[tuple[AdapterKey, Exception]]:
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
        """Keep the adapter resident in `tier` (gpu or cpu) until unpinned; loads it now if needed."""
        if tier not in ("gpu", "cpu"):
            raise ValueError(f"pin tier {tier!r}: use gpu or cpu")
        with self._lock:
            entry = self.entries.setdefault(ref.key, Entry(ref))
            pins = self._gpu_pins if tier == "gpu" else self._cpu_pins
            pinned = [self.entries[k] for k in pins if k != ref.key]
            if tier == "gpu" and len(pinned) + 1 > len(self.slots) - 1:
                raise CapacityExceeded(
                    f"cannot pin {ref.key} to gpu: {len(pinned)} of {len(self.slots)} slots are pinned and one "
                    "must stay free for other adapters"
                )
            if (
                tier == "cpu" and sum(e.nbytes for e in pinned) + entry.nbytes > self.cpu_bytes
            ):  # 0 if never loaded
                raise CapacityExceeded(
                    f"cannot pin {ref.key} to cpu: pinned adapters would exceed cpu_cache_bytes"
                )
            if (
                tier == "cpu"
                and self.max_cpu_loras is not None
                and len(pinned) + 1 > self.max_cpu_loras - 1
            ):
                raise CapacityExceeded(
                    f"cannot pin {ref.key} to cpu: {len(pinned)} of max_cpu_loras {self.max_cpu_loras} are pinned "
                    "and one must stay free for loads"
                )
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
                    self._activate(
                        ref.key, self.clock()
                    )  # no slot free or freeable: it stays in cpu
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
        """Evict and drop all bookkeeping of a key (an unloaded adapter), in one step: the step loop must not take
        the adapter between the two."""
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
        """Worker thread: bytes from disk or the remote store, digest checked, packed into a host buffer."""
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

    def _activate(self, key: AdapterKey, now: float, tenant: str | None = None) -> int | None:
        """Put the host copy in a slot: a free one, else one the policy frees. `tenant`: the tenant
        whose request asks, held to its budget (None: an operator's pin or prewarm, placed as
        asked)."""
        if None not in self.slots:
            slot = self._evict_slot(key, now, tenant)
        elif tenant is not None and self._budget_yields_free_slot(key, tenant, now):
            self._wait_for_budget(key, tenant, now)
            slot = None
        else:
            slot = self.slots.index(None)
        if slot is None:
            return None
        entry = self.entries[key]
        start = time.perf_counter()
        modeled = self.pool.set_slot(slot, self.cpu[key])
        seconds = time.perf_counter() - start if modeled is None else modeled
        self._measure("h2d", seconds, entry.nbytes)
        self.on_event("load_stage", {"stage": "h2d", "seconds": seconds, "key": key})
        self.slots[slot] = key
        entry.loaded_at = now
        entry.restored = False  # _restore_preferred marks its own activations
        self.activations.record(key, now)
        if entry.evicted_at is not None and now - entry.evicted_at < self.thrash_window_s:
            self.reloads_after_eviction += 1
            self.on_event("reload_after_eviction", {})
        self.on_event(
            "load_stage",
            {"stage": "activation", "seconds": time.perf_counter() - start, "key": key},
        )
        return slot

    def _evict_slot(self, incoming: AdapterKey, now: float, tenant: str | None) -> int | None:
        entries = self.entries
        evictable = [
            k
            for k in self.slots
            if k is not None and (e := entries[k]).refcount == 0 and e.pinned != "gpu"
        ]
        if getattr(
            self.policy, "spares_queued", False
        ):  # an adapter whose request is about to be admitted stays
            evictable = [k for k in evictable if k not in self.queued]
        if not evictable:
            return None  # every slot in use, pinned or spared: nothing to weigh (under a backlog, most calls)
        rounds = [evictable]
        if tenant is not None and self.budgets.limits_anyone:
            allowed = self._budget_victims(tenant, evictable)
            if not allowed:
                self._wait_for_budget(incoming, tenant, now)
                return None
            # Within its budget, the excess of tenants beyond theirs goes first; the policy's
            # protections may refuse all of it, and then any adapter may go, as without budgets.
            partial = len(allowed) < len(evictable) and not self._over_budget(tenant, "gpu")
            rounds = [allowed, evictable] if partial else [allowed]
        victim = None
        for keys in rounds:
            candidates = self._slot_candidates([*keys, incoming], now)
            victim = self.policy.choose_victim(candidates[:-1], now, candidates[-1])
            if victim is not None:
                break
        if victim is None:
            return None
        slot = self.slots.index(victim)
        self._clear(slot, now)
        return slot

    # -- budgets (the rule is loraplex.cache.budgets; here, the counts it takes) ----------------
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
        waiting = self.budget_waiting.get(ref.key)
        if waiting is None or waiting[0] != ref.tenant:
            return False
        return self.budgets.defers(self.clock() - waiting[1])

    def _slot_usage(self) -> dict[str, int]:
        entries = self.entries
        return usage((entries[k].charged, 1) for k in self.slots if k is not None)

    def _host_usage(self) -> dict[str, int]:
        entries = self.entries
        return usage((entries[k].charged, entries[k].nbytes) for k in self.cpu)

    def _over_budget(self, tenant: str, tier: str) -> bool:
        """Whether one more slot (gpu) or any more bytes (cpu) puts the tenant beyond its budget."""
        used = self._slot_usage() if tier == "gpu" else self._host_usage()
        return self.budgets.is_over(tenant, tier, used, 1)

    def _budget_yields_free_slot(self, key: AdapterKey, tenant: str, now: float) -> bool:
        """Whether a request of a tenant beyond its budget leaves a free slot to another tenant's
        request that waits for one (its adapter loading, or in host memory): free capacity is
        anyone's only while no one else wants it. It yields for the budgets' `yield_s` at most (then
        it takes the slot: nothing starves)."""
        if not self.budgets.limits_anyone or not self._over_budget(tenant, "gpu"):
            return False
        waiting = self.budget_waiting.get(key)
        if waiting is not None and not self.budgets.defers(now - waiting[1]):
            return False
        entries, slots = self.entries, self.slots
        return any(
            now - asked <= WANTED_FOR_S and k not in slots and entries[k].last_tenant != tenant
            for k, asked in self._wanted.items()
        )

    def _budget_victims(self, tenant: str, keys: list[AdapterKey]) -> list[AdapterKey]:
        """Of the evictable slot holders `keys`, those the tenant's request may take a slot from."""
        entries = self.entries
        candidates = [(k, entries[k].charged) for k in keys]
        return self.budgets.victims("gpu", tenant, self._slot_usage(), 1, candidates)

    def _host_budget_allows(self, key: AdapterKey, tenant: str) -> bool:
        """Whether a load of `key` for `tenant` may start: into free host memory, within its budget,
        or with copies of its own to give up for it (`_shrink_cpu` drops them when it lands)."""
        budgets = self.budgets
        if not budgets.limits_anyone:
            return True
        need = max(self.entries[key].nbytes, 1)  # 0 before its first load: any more bytes
        has_free = self.cpu_bytes_used + need <= self.cpu_bytes and (
            self.max_cpu_loras is None or len(self.cpu) < self.max_cpu_loras
        )
        entries = self.entries
        own = [(k, entries[k].charged) for k in self.cpu if entries[k].pinned != "cpu"]
        return budgets.may_take("cpu", tenant, self._host_usage(), need, has_free, own)

    def _host_budget_victims(self, keep: AdapterKey, keys: list[AdapterKey]) -> list[AdapterKey]:
        """Of the droppable host copies `keys`, those that the landing copy `keep` may push out. Its
        tenant beyond its budget gives up its own, the landing copy included when it has no other
        (its request then waits, and its next load waits for room: `_host_budget_allows`)."""
        entries = self.entries
        tenant, used = entries[keep].last_tenant, self._host_usage()
        candidates = [(k, entries[k].charged) for k in keys]
        allowed = self.budgets.victims("cpu", tenant, used, 0, candidates)
        if (
            not allowed
            and self.budgets.is_over(tenant, "cpu", used, 0)
            and keep in self.cpu
            and entries[keep].pinned != "cpu"
        ):
            return [keep]
        return allowed

    def _wait_for_budget(self, key: AdapterKey, tenant: str, now: float) -> None:
        """A request of `tenant` for `key` waits because of its budget: counted once per wait."""
        if key in self.budget_waiting and now - self._wanted.get(key, -math.inf) <= WANTED_FOR_S:
            return  # the same wait, asked again at this step
        self.budget_waiting[key] = (tenant, now)
        self.budget_waits[tenant] = self.budget_waits.get(tenant, 0) + 1
        self.on_event("budget_wait", {"tenant": tenant, "key": key})

    def _clear(self, slot: int, now: float) -> None:
        key = self.slots[slot]
        self.pool.clear_slot(slot)
        self.slots[slot] = None
        entry = self.entries[key]
        entry.evictions += 1
        entry.evicted_at = now
        self.num_evictions += 1
        self.recent_evictions.append(now)
        self.on_event("eviction", {"tier": "gpu"})

    def _restore_preferred(self, now: float) -> None:
        """Put a tier-A adapter that a one-off pushed out back into a slot once the one-off is done, so that its
        next request finds it on the device (a host-to-device copy, off the request's path).

        Only an adapter expected back before the slots turn over is restored: one whose short-window request
        count, times the number of slots, is at least the count of slot loads over the same window. One expected
        later would most likely be pushed out again before its next request, and its restore would be a copy
        for nothing; it is activated when it is asked for instead.
        """
        for key, asked in list(self._wanted.items()):
            if now - asked > WANTED_FOR_S:
                del self._wanted[key]  # its request went away
                self._copies_version += 1
                self._waiting_since.pop(key, None)
        if self._wanted:
            return  # requests are waiting for a slot: they come first
        preferred = self._gpu_preferred(now)
        out = preferred - set(self.slots)
        if not out:
            return  # the usual case: every tier-A adapter is in a slot
        turnover = self.slot_loads.short("gpu", now) / len(self.slots)
        # the most demanded first; equal demands by key, so the order does not depend on the set's hashing
        for key in sorted(
            out, key=lambda k: (-self.demand.short(k, now), k.name, k.revision, k.adapter_digest)
        ):
            if key not in self.cpu:
                continue
            if self.demand.short(key, now) < turnover:
                return
            holders = [
                k
                for k in self.slots
                if k is not None
                and k not in preferred
                and self.entries[k].refcount == 0
                and self.entries[k].pinned != "gpu"
                and k not in self.loading
                and k not in self.queued
            ]
            if None not in self.slots and holders and self.budgets.limits_anyone:
                holders = self._budget_victims(self.entries[key].last_tenant, holders)
            if None not in self.slots and not holders:
                return
            if None not in self.slots:
                victim = min(holders, key=lambda k: self.demand.short(k, now))
                if self.demand.short(victim, now) >= self.demand.short(key, now):
                    return
                self._clear(self.slots.index(victim), now)
            if self._activate(key, now) is not None:
                self.entries[key].restored = True

    def _room_for(self, key: AdapterKey, now: float) -> bool:
        """Whether a waiting request's load of `key` can land without pushing out the host copy of an adapter that
        another waiting request asked for. When the waiting requests' adapters do not all fit in host memory, each
        load would push out another's copy before its request got a slot, and that one would load again, over and
        over (thrash: tens of loads per request with one slot and a backlog); instead such a request waits until
        earlier ones have taken their slots. The scheduler asks in queue order, so the first ones load first. With
        no other waiting request's copy held, a load always may (there is always a first)."""
        held, count, nbytes = self._wanted_copies(now)
        if not held or len(held) == 1 and key in held:
            return True
        entries = self.entries
        if key in held and key not in self._cpu_pins:  # its own copy is not another's
            count, nbytes = count - 1, nbytes - entries[key].nbytes
        if self.max_cpu_loras is not None and count + 1 > self.max_cpu_loras:
            return False
        return nbytes + entries[key].nbytes <= self.cpu_bytes

    def _wanted_copies(self, now: float) -> tuple[set[AdapterKey], int, int]:
        """The host copies and loads that waiting requests asked for; their count and bytes with the cpu pins' (never
        dropped either). `_room_for` is asked for each waiting request whose adapter is not in host memory, at every
        step, so this is kept while nothing it depends on changes: the copies, loads, pins and asks (versions), and
        time only by the oldest ask leaving the window (the clock only moves forward)."""
        memo = self._copies_memo
        if (
            memo is not None
            and memo[0] == (self._copies_version, self._nbytes_version)
            and now - memo[1] <= WANTED_FOR_S
        ):
            return memo[2]
        wanted, entries = self._wanted, self.entries
        held = {
            k
            for k in itertools.chain(self.cpu, self.loading)
            if now - wanted.get(k, -math.inf) <= WANTED_FOR_S and k in entries
        }
        both = held | self._cpu_pins
        value = (held, len(both), sum(entries[k].nbytes for k in both))
        oldest = min(
            (wanted[k] for k in held), default=math.inf
        )  # later asks only keep the others in longer
        self._copies_memo = ((self._copies_version, self._nbytes_version), oldest, value)
        return value

    def _restore_pinned(self, now: float) -> None:
        """A gpu-pinned adapter that found every slot in use (when it was pinned, or when its load landed) takes a
        slot once one can be had, unless requests wait for one (they come first)."""
        if any(now - asked <= WANTED_FOR_S for asked in self._wanted.values()):
            return
        for key in sorted(self._gpu_pins - set(self.slots), key=str):
            if key in self.cpu and self._activate(key, now) is None:
                return

    def _yields(self, key: AdapterKey, now: float) -> bool:
        """Whether `key` leaves the slot it could take to a tier-A adapter whose request waits too (a policy with
        `yields_for_s`): when one slot frees for several waiting requests, a frequently used adapter gets it before
        a one-off that happened to arrive first; the one-off takes the next. A request yields only during its first
        `yields_for_s` of waiting, so that under sustained load tier A cannot starve the others."""
        limit = getattr(self.policy, "yields_for_s", 0.0)
        if now - self._waiting_since.get(key, now) >= limit:
            return False  # none, or it has waited long enough: it takes its turn
        wanted, slots = self._wanted, set(self.slots)
        waiting = [  # walked from the host copies (tens), not the waiting requests' keys (hundreds under a backlog)
            k
            for k in self.cpu
            if k != key and now - wanted.get(k, -math.inf) <= WANTED_FOR_S and k not in slots
        ]
        if not waiting:
            return False
        preferred = self._gpu_preferred(now)
        return key not in preferred and any(k in preferred for k in waiting)

    def _gpu_preferred(self, now: float) -> set[AdapterKey]:
        """Tier A: the adapters with the most short-window demand, up to the cap. The set is kept until the counts
        or the time change, and shared: callers must not change it."""
        inputs = (
            now,
            self.demand,
            self.demand.version,
            self.max_gpu_preferred,
            getattr(self.policy, "overdue_gaps", None),
        )
        memo = self._preferred_memo.get("gpu")
        if memo is not None and memo[0] == inputs:
            return memo[1]
        chosen = self.demand.top(
            now, 0, 2.0, self.max_gpu_preferred
        )  # in rank order, as one by one
        gaps = getattr(self.policy, "overdue_gaps", None)
        if gaps is not None and self.demand.any_overdue(
            chosen, now, gaps
        ):  # the next ones take their places
            ranked = itertools.takewhile(lambda item: item[1] >= 2.0, self.demand.ranked(now, 0))
            chosen = itertools.islice(
                (k for k, _ in ranked if not self._stopped(k, now)), self.max_gpu_preferred
            )
        chosen = set(chosen)
        self._preferred_memo["gpu"] = (inputs, chosen)
        return chosen

    def _cpu_preferred(self, now: float) -> set[AdapterKey]:
        """Tier B: adapters with demand over the last hour, up to half the cpu budget (kept and shared as tier A)."""
        inputs = (
            now,
            self.demand,
            self.demand.version,
            self._nbytes_version,
            self.cpu_bytes,
            getattr(self.policy, "overdue_gaps", None),
        )
        memo = self._preferred_memo.get("cpu")
        if memo is not None and memo[0] == inputs:
            return memo[1]
        chosen, used, entries, half = set(), 0, self.entries, self.cpu_bytes // 2
        gaps, overdue = getattr(self.policy, "overdue_gaps", None), self.demand.overdue
        for key, count in self.demand.ranked(now, 1):
            if count < 2.0:
                break
            if gaps is not None and overdue(key, now, gaps):
                continue  # it was busy and stopped: the hour's count would keep it for many minutes
            nbytes = entries[key].nbytes
            if used + nbytes > half:
                break
            chosen.add(key)
            used += nbytes
        self._preferred_memo["cpu"] = (inputs, chosen)
        return chosen

    def _put_cpu(self, key: AdapterKey, packed) -> None:
        self._drop_cpu(key)
        self.cpu[key] = packed
        self.cpu_bytes_used += packed.nbytes
        self._copies_version += 1

    def _drop_cpu(self, key: AdapterKey) -> None:
        if key in self.cpu:
            self.cpu_bytes_used -= self.cpu.pop(key).nbytes
            self._copies_version += 1

    def _shrink_cpu(self, keep: AdapterKey) -> None:
        now, candidates, left = self.clock(), [], 0
        by_use = getattr(self.policy, "weighs_host_copies_by_use", False)
        # A policy may give its picks in order (`victims`): the same as asking choose_victim again after each.
        in_order, victims = getattr(self.policy, "victims", None), None
        while self._cpu_over():
            if not left:
                entries = self.entries
                keys = [k for k in self.cpu if k != keep and entries[k].pinned != "cpu"]
                if self.budgets.limits_anyone and keep in entries:
                    keys = self._host_budget_victims(keep, keys)
                # A host copy that a waiting request asked for goes last: dropping it means loading it again.
                keys = [k for k in keys if k not in self._wanted] or keys
                if (
                    not by_use
                ):  # copies of adapters in a slot go last: a slot eviction falls back to them
                    keys = [k for k in keys if k not in self.slots] or keys
                candidates = self._host_candidates(keys, now, by_use)
                left = len(candidates)
                victims = in_order(candidates, now) if in_order is not None else None
            if victims is not None:
                victim, left = (
                    next(victims, None),
                    left - 1,
                )  # the picks come from the candidates, one each
            else:
                victim = self.policy.choose_victim(candidates, now)
                candidates = [c for c in candidates if c.key is not victim]
                left = len(candidates)
            if victim is None:
                return
            self._drop_cpu(victim)
            self.on_event("eviction", {"tier": "cpu"})

    def _cpu_pinned_bytes(self) -> int:
        return sum(self.entries[k].nbytes for k in self._cpu_pins)

    def _cpu_over(self) -> bool:
        return self.cpu_bytes_used > self.cpu_bytes or (
            self.max_cpu_loras is not None and len(self.cpu) > self.max_cpu_loras
        )

    def _slot_candidates(self, keys: list[AdapterKey], now: float) -> list[Candidate]:
        """Adapters as a slot eviction weighs them: losing the slot costs a copy from host memory, or a load
        first when the host copy is gone."""
        preferred, rate = self._gpu_preferred(now), self.seconds_per_byte
        h2d, disk, download = rate.get("h2d", 0.0), rate.get("disk", 0.0), rate.get("download", 0.0)
        # The sums once, in the same order as for each key (so the same floats).
        from_disk, from_remote = h2d + disk + 0.0, h2d + disk + download
        entries, cpu, has = self.entries, self.cpu, self.disk.has if self.disk is not None else None
        out = []
        for key, demand in zip(keys, self._short_demands(keys, now)):
            e = entries[key]
            ref = e.ref
            if key in cpu:
                per_byte = h2d
            else:  # as _on_disk
                on_disk = ref.path is not None or (has is not None and has(key.adapter_digest))
                per_byte = from_disk if on_disk else from_remote
            out.append(
                Candidate(
                    key,
                    e.nbytes,
                    e.last_access,
                    e.loaded_at,
                    demand,
                    ref.tenant,
                    ref.priority,
                    per_byte * e.nbytes,
                    key in preferred,
                    e.restored,
                )
            )
        return out

    def _stopped(self, key: AdapterKey, now: float) -> bool:
        """Whether `key`'s requests stopped, for a policy that sets `overdue_gaps` (never for the others)."""
        gaps = getattr(self.policy, "overdue_gaps", None)
        return gaps is not None and self.demand.overdue(key, now, gaps)

    def _short_demands(self, keys: list[AdapterKey], now: float) -> list[float]:
        """Each key's short-window count, as a policy weighs it: none for an adapter whose requests stopped."""
        gaps = getattr(self.policy, "overdue_gaps", None)
        return (
            self.demand.shorts(keys, now)
            if gaps is None
            else self.demand.shorts_live(keys, now, gaps)
        )

    def _host_candidates(self, keys: list[AdapterKey], now: float, by_use: bool) -> list[Candidate]:
        """Host copies as a policy weighs them. `by_use`: by the use each will have. Outside the slots, that is
        the adapter's next request; for an adapter in a slot, only an activation after it loses the slot, so such
        a copy counts its slot activations and its last one, not the requests the slot served."""
        preferred, rate = self._cpu_preferred(now), self.seconds_per_byte
        # Tier A is the exception: a gpu-preferred adapter pushed out of its slot is restored at once, and that
        # restore is a copy only while its host copy is kept, so that copy counts the adapter's requests.
        in_slots = set(self.slots) - self._gpu_preferred(now) if by_use else set()
        disk, download = rate.get("disk", 0.0), rate.get("download", 0.0)
        from_disk, from_remote = (
            disk + 0.0,
            disk + download,
        )  # the sums once (the same floats as per key)
        entries, activations = self.entries, self.activations
        has = self.disk.has if self.disk is not None else None
        out = []
        for key, demand in zip(keys, self._short_demands(keys, now)):
            e = entries[key]
            ref = e.ref
            if key in in_slots:
                demand, last = activations.count(key, now), e.loaded_at
            else:
                last = e.last_access
            on_disk = ref.path is not None or (
                has is not None and has(key.adapter_digest)
            )  # as _on_disk
            per_byte = from_disk if on_disk else from_remote
            out.append(
                Candidate(
                    key,
                    e.nbytes,
                    last,
                    e.loaded_at,
                    demand,
                    ref.tenant,
                    ref.priority,
                    per_byte * e.nbytes,
                    key in preferred,
                )
            )
        return out

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
