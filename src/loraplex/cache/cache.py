"""The adapter cache: gpu slots over host copies over the disk cache over the remote store."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from loraplex.cache.disk import DiskTier
from loraplex.cache.errors import AdapterInFlight, AdapterUnavailable, ArtifactCorrupt, CapacityExceeded
from loraplex.cache.key import AdapterKey, AdapterRef
from loraplex.cache.policy import Candidate, DemandTracker, LRUPolicy
from loraplex.registry.errors import DigestMismatch, RegistryError
from loraplex.registry.store import canonical_digest

THRASH_WINDOW_S = 60.0
WANTED_FOR_S = 2.0  # a waiting request asks again every step; older asks belong to requests that went away


class SlotPool(Protocol):
    num_slots: int

    def set_slot(self, slot: int, packed) -> None: ...
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
        pack: Callable[[Path], object],
        *,
        cpu_bytes: int,
        max_cpu_loras: int | None = None,
        disk: DiskTier | None = None,
        policy=None,
        tenant_share: float = 1.0,
        max_gpu_preferred: int | None = None,
        load_threads: int = 2,
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
        self.tenant_share = tenant_share
        self.max_gpu_preferred = max_gpu_preferred if max_gpu_preferred is not None else pool.num_slots
        self.clock = clock
        self.slots: list[AdapterKey | None] = [None] * pool.num_slots
        self.cpu: dict[AdapterKey, object] = {}
        self.entries: dict[AdapterKey, Entry] = {}
        self.loading: dict[AdapterKey, Future] = {}
        self.demand = DemandTracker()
        self.recent_evictions: deque[float] = deque(maxlen=1000)
        self.reloads_after_eviction = 0
        self.num_evictions = 0
        self.on_event: Callable[[str, dict], None] = lambda kind, fields: None
        self._wanted: dict[AdapterKey, float] = {}  # keys a waiting request asked for and has not got yet
        # A simulator passes its own executor and loader, to run loads on its simulated clock.
        self._loader = loader or self._load
        self._executor = executor or ThreadPoolExecutor(load_threads, thread_name_prefix="lora-load")
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
            entry = self.entries.get(key)
            local = entry is not None and entry.ref.path is not None
            if local or (self.disk is not None and self.disk.has(key.adapter_digest)):
                return "disk"
            return "remote"

    def nbytes_of(self, key: AdapterKey) -> int:
        entry = self.entries.get(key)
        return entry.nbytes if entry else 0

    def free_slots(self) -> int:
        return self.slots.count(None)

    def state(self) -> dict:
        now = self.clock()
        with self._lock:
            adapters = []
            for key, e in self.entries.items():
                adapters.append({
                    "name": key.name, "revision": key.revision, "digest": key.adapter_digest,
                    "base_model_digest": key.base_model_digest, "tenant": e.ref.tenant,
                    "tier": self.tier_of(key), "loading": key in self.loading, "bytes": e.nbytes,
                    "pinned": e.pinned, "in_flight": e.refcount, "hits": e.hits, "loads": e.loads,
                    "evictions": e.evictions, "last_access_s_ago": round(now - e.last_access, 3),
                    "demand_5m": round(self.demand.short(key, now), 3),
                })
            return {
                "adapters": adapters,
                "num_slots": len(self.slots),
                "free_slots": self.free_slots(),
                "recent_evictions": sum(1 for t in self.recent_evictions if now - t < THRASH_WINDOW_S),
                "cpu_bytes_used": sum(p.nbytes for p in self.cpu.values()),
                "cpu_bytes_capacity": self.cpu_bytes,
                "thrash_ratio": self.thrash_ratio(),
            }

    def thrash_ratio(self) -> float:
        return self.reloads_after_eviction / self.num_evictions if self.num_evictions else 0.0

    def resident(self, tier: str) -> list[AdapterKey]:
        with self._lock:
            return [k for k in self.slots if k is not None] if tier == "gpu" else list(self.cpu)

    # -- the step loop's calls -------------------------------------------------------------------
    def acquire(self, ref: AdapterRef) -> int | None:
        """The slot holding the adapter, with a reference taken; None while it loads or no slot can free."""
        with self._lock:
            key, now = ref.key, self.clock()
            entry = self.entries.setdefault(key, Entry(ref))
            entry.last_access = now
            slot = self.slot_of(key)
            if slot is None and key in self.cpu:
                slot = self._activate(key, now)
            if slot is None:
                if key not in self.cpu:
                    self._start_load(ref)
                self._wanted[key] = now
                return None
            self._wanted.pop(key, None)
            entry.refcount += 1
            entry.hits += 1
            return slot

    def record_request(self, ref: AdapterRef) -> str:
        """Count one request's demand and report the tier it finds its adapter in."""
        with self._lock:
            self.entries.setdefault(ref.key, Entry(ref))
            self.demand.record(ref.key, self.clock())
            tier = self.tier_of(ref.key)
        if tier == "gpu" or tier == "cpu":
            self.on_event("hit", {"tier": tier})
        else:
            self.on_event("miss", {"tier": tier})
        return tier

    def release(self, key: AdapterKey) -> None:
        with self._lock:
            entry = self.entries[key]
            assert entry.refcount > 0, f"release of {key} without a reference"
            entry.refcount -= 1
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
                error = future.exception()
                if error is not None:
                    failed.append((key, error))
                    self.on_event("load_failed", {"error": type(error).__name__, "key": key, "exception": error})
                    continue
                loaded: Loaded = future.result()
                entry = self.entries[key]
                entry.nbytes = loaded.packed.nbytes
                entry.loads += 1
                entry.load_seconds = sum(loaded.stages.values())
                self.cpu[key] = loaded.packed  # load first, then evict: a failed load never evicted anything
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
            pinned = [e for e in self.entries.values() if e.pinned == tier and e is not entry]
            if tier == "gpu" and len(pinned) + 1 > len(self.slots) - 1:
                raise CapacityExceeded(
                    f"cannot pin {ref.key} to gpu: {len(pinned)} of {len(self.slots)} slots are pinned and one "
                    "must stay free for other adapters"
                )
            if tier == "cpu" and sum(e.nbytes for e in pinned) + entry.nbytes > self.cpu_bytes:
                raise CapacityExceeded(f"cannot pin {ref.key} to cpu: pinned adapters would exceed cpu_cache_bytes")
            if tier == "cpu" and self.max_cpu_loras is not None and len(pinned) + 1 > self.max_cpu_loras - 1:
                raise CapacityExceeded(
                    f"cannot pin {ref.key} to cpu: {len(pinned)} of max_cpu_loras {self.max_cpu_loras} are pinned "
                    "and one must stay free for loads"
                )
            entry.pinned = tier
        self.prewarm(ref, tier)

    def unpin(self, key: AdapterKey) -> None:
        with self._lock:
            if key in self.entries:
                self.entries[key].pinned = None

    def prewarm(self, ref: AdapterRef, tier: str = "cpu") -> None:
        """Start loading ahead of traffic into cpu, or into a gpu slot when one can be had."""
        with self._lock:
            entry = self.entries.setdefault(ref.key, Entry(ref))
            entry.last_access = self.clock()
            if tier == "gpu":
                entry.prewarm_gpu = True
            if ref.key in self.cpu:
                if tier == "gpu" and self.slot_of(ref.key) is None:
                    self._activate(ref.key, self.clock())
                return
            self._start_load(ref)

    def evict(self, key: AdapterKey) -> None:
        """Drop the adapter from gpu and cpu now; refused while requests use it."""
        with self._lock:
            entry = self.entries.get(key)
            if entry is None:
                return
            if entry.refcount:
                raise AdapterInFlight(f"{key} has {entry.refcount} request(s) in flight; try again when they end")
            slot = self.slot_of(key)
            if slot is not None:
                self._clear(slot, self.clock())
            self.cpu.pop(key, None)
            entry.pinned = None

    def forget(self, key: AdapterKey) -> None:
        """Evict and drop all bookkeeping of a key (an unloaded adapter)."""
        self.evict(key)
        with self._lock:
            self.entries.pop(key, None)

    # -- internals -------------------------------------------------------------------------------
    def _start_load(self, ref: AdapterRef) -> None:
        if ref.key not in self.loading:
            self.loading[ref.key] = self._executor.submit(self._loader, ref)

    def _load(self, ref: AdapterRef) -> Loaded:
        """Worker thread: bytes from disk or the remote store, digest checked, packed into a host buffer."""
        stages = {}
        try:
            if ref.path is not None:
                start = time.perf_counter()
                actual = canonical_digest(ref.path)
                if actual != ref.key.adapter_digest:
                    raise ArtifactCorrupt(
                        f"adapter {ref.key}: digest mismatch ({actual} on disk, {ref.key.adapter_digest} expected)"
                    )
                packed = self._pack(ref.path)
                stages["disk"] = time.perf_counter() - start
                source = "disk"
            elif self.disk is not None and ref.storage_uri:
                start = time.perf_counter()
                with self.disk.use(ref.storage_uri, ref.key.adapter_digest) as (path, downloaded):
                    fetched = time.perf_counter()
                    packed = self._pack(path)
                stages["download" if downloaded else "disk"] = fetched - start
                stages["disk"] = stages.get("disk", 0.0) + time.perf_counter() - fetched
                source = "remote" if downloaded else "disk"
            else:
                raise AdapterUnavailable(f"adapter {ref.key}: no local path and no storage URI to load it from")
        except AdapterUnavailable:
            raise
        except DigestMismatch as exc:
            raise ArtifactCorrupt(f"adapter {ref.key}: {exc}") from exc
        except (RegistryError, OSError, ValueError) as exc:
            raise AdapterUnavailable(f"adapter {ref.key} could not be loaded: {exc}") from exc
        for stage, seconds in stages.items():
            self.on_event("load_stage", {"stage": stage, "seconds": seconds, "key": ref.key})
        return Loaded(packed, source, stages)

    def _activate(self, key: AdapterKey, now: float) -> int | None:
        slot = self.slots.index(None) if None in self.slots else self._evict_slot(key, now)
        if slot is None:
            return None
        entry = self.entries[key]
        start = time.perf_counter()
        self.pool.set_slot(slot, self.cpu[key])
        self.on_event("load_stage", {"stage": "h2d", "seconds": time.perf_counter() - start, "key": key})
        self.slots[slot] = key
        entry.loaded_at = now
        if entry.evicted_at is not None and now - entry.evicted_at < THRASH_WINDOW_S:
            self.reloads_after_eviction += 1
            self.on_event("reload_after_eviction", {})
        self.on_event("load_stage", {"stage": "activation", "seconds": time.perf_counter() - start, "key": key})
        return slot

    def _evict_slot(self, incoming: AdapterKey, now: float) -> int | None:
        evictable = [
            k for k in self.slots
            if k is not None and self.entries[k].refcount == 0 and self.entries[k].pinned != "gpu"
        ]
        tenant = self.entries[incoming].ref.tenant
        quota = max(1, math.floor(len(self.slots) * self.tenant_share))
        held = [k for k in self.slots if k is not None and self.entries[k].ref.tenant == tenant]
        if len(held) >= quota:  # over its share: the tenant makes room from its own adapters
            evictable = [k for k in evictable if self.entries[k].ref.tenant == tenant]
        preferred = self._gpu_preferred(now)
        candidates = [self._candidate(k, now, k in preferred) for k in evictable]
        victim = self.policy.choose_victim(candidates, now, self._candidate(incoming, now, incoming in preferred))
        if victim is None:
            return None
        slot = self.slots.index(victim)
        self._clear(slot, now)
        return slot

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
        """Put tier-A adapters pushed out by one-offs back into a slot as soon as the one-off is done,
        so the next request for a hot adapter finds it on the device (a host-to-device copy, off its path)."""
        for key, asked in list(self._wanted.items()):
            if now - asked > WANTED_FOR_S:
                del self._wanted[key]  # its request went away
        if self._wanted:
            return  # requests are waiting for a slot: they come first
        preferred = self._gpu_preferred(now)
        for key in sorted(preferred - set(self.slots), key=lambda k: -self.demand.short(k, now)):
            if key not in self.cpu:
                continue
            holders = [
                k for k in self.slots
                if k is not None and k not in preferred and self.entries[k].refcount == 0
                and self.entries[k].pinned != "gpu" and k not in self.loading
            ]
            if None not in self.slots and not holders:
                return
            if None not in self.slots:
                victim = min(holders, key=lambda k: self.demand.short(k, now))
                if self.demand.short(victim, now) >= self.demand.short(key, now):
                    return
                self._clear(self.slots.index(victim), now)
            self._activate(key, now)

    def _gpu_preferred(self, now: float) -> set[AdapterKey]:
        """Tier A: the adapters with the most short-window demand, up to the cap."""
        ranked = sorted(self.entries, key=lambda k: self.demand.short(k, now), reverse=True)
        return {k for k in ranked[: self.max_gpu_preferred] if self.demand.short(k, now) >= 2.0}

    def _cpu_preferred(self, now: float) -> set[AdapterKey]:
        """Tier B: adapters with demand over the last hour, up to half the cpu budget."""
        chosen, used = set(), 0
        for key in sorted(self.entries, key=lambda k: self.demand.counts(k, now)[1], reverse=True):
            if self.demand.counts(key, now)[1] < 2.0 or used + self.entries[key].nbytes > self.cpu_bytes // 2:
                break
            chosen.add(key)
            used += self.entries[key].nbytes
        return chosen

    def _shrink_cpu(self, keep: AdapterKey) -> None:
        now = self.clock()
        preferred = self._cpu_preferred(now)
        while self._cpu_over():
            keys = [k for k in self.cpu if k != keep and self.entries[k].pinned != "cpu"]
            # A host copy that a waiting request asked for goes last: dropping it means loading it again.
            keys = [k for k in keys if k not in self._wanted] or keys
            # Copies of adapters in a slot go last: a slot eviction then falls back to host memory.
            outside = [k for k in keys if k not in self.slots] or keys
            victim = self.policy.choose_victim([self._candidate(k, now, k in preferred) for k in outside], now)
            if victim is None:
                return
            del self.cpu[victim]
            self.on_event("eviction", {"tier": "cpu"})

    def _cpu_over(self) -> bool:
        used = sum(p.nbytes for p in self.cpu.values())
        return used > self.cpu_bytes or (self.max_cpu_loras is not None and len(self.cpu) > self.max_cpu_loras)

    def _candidate(self, key: AdapterKey, now: float, preferred: bool = False) -> Candidate:
        e = self.entries[key]
        return Candidate(
            key, e.nbytes, e.last_access, e.loaded_at, self.demand.short(key, now), e.ref.tenant, e.ref.priority,
            e.load_seconds, preferred,
        )

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
