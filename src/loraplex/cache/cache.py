"""The adapter cache: which adapter is in which device slot and which are ready in host memory, and moving them."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

from loraplex.cache.key import AdapterKey, AdapterRef
from loraplex.cache.policy import Candidate, LRUPolicy


class SlotPool(Protocol):
    num_slots: int

    def set_slot(self, slot: int, packed) -> None: ...
    def clear_slot(self, slot: int) -> None: ...


class AdapterUnavailable(RuntimeError):
    """The adapter could not be made resident (bad file, digest mismatch, store down); the message says why."""


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


class AdapterCache:
    """Device slots (gpu tier) over host copies (cpu tier); loads run on worker threads, off the step loop.

    Only the engine's step thread calls acquire/release/poll; locks guard the views other threads read.
    """

    def __init__(
        self,
        pool: SlotPool,
        load: Callable[[AdapterRef], object],
        *,
        cpu_bytes: int,
        max_cpu_loras: int | None = None,
        policy=None,
        load_threads: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pool = pool
        self._load = load
        self.cpu_bytes = cpu_bytes
        self.max_cpu_loras = max_cpu_loras
        self.policy = policy or LRUPolicy()
        self.clock = clock
        self.slots: list[AdapterKey | None] = [None] * pool.num_slots
        self.cpu: dict[AdapterKey, object] = {}
        self.entries: dict[AdapterKey, Entry] = {}
        self.loading: dict[AdapterKey, Future] = {}
        self._executor = ThreadPoolExecutor(load_threads, thread_name_prefix="lora-load")
        self._lock = threading.RLock()

    # -- queries ---------------------------------------------------------------------------------
    def slot_of(self, key: AdapterKey) -> int | None:
        return self.slots.index(key) if key in self.slots else None

    def tier_of(self, key: AdapterKey) -> str:
        if key in self.slots:
            return "gpu"
        if key in self.cpu:
            return "cpu"
        return "disk"

    def nbytes_of(self, key: AdapterKey) -> int:
        entry = self.entries.get(key)
        return entry.nbytes if entry else 0

    def free_slots(self) -> int:
        return self.slots.count(None)

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
                self._start_load(ref)
                return None
            entry.refcount += 1
            entry.hits += 1
            return slot

    def release(self, key: AdapterKey) -> None:
        with self._lock:
            entry = self.entries[key]
            assert entry.refcount > 0, f"release of {key} without a reference"
            entry.refcount -= 1

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
                    continue
                packed = future.result()
                self.entries[key].nbytes = packed.nbytes
                self.entries[key].loads += 1
                self.cpu[key] = packed  # load first, then evict: a failed load never evicted anything
                self._shrink_cpu(keep=key)
        return failed

    def is_loading(self, key: AdapterKey) -> bool:
        return key in self.loading

    # -- internals -------------------------------------------------------------------------------
    def _start_load(self, ref: AdapterRef) -> None:
        if ref.key not in self.loading:
            self.loading[ref.key] = self._executor.submit(self._load, ref)

    def _activate(self, key: AdapterKey, now: float) -> int | None:
        slot = self.slots.index(None) if None in self.slots else self._evict_slot(now)
        if slot is None:
            return None
        self.pool.set_slot(slot, self.cpu[key])
        self.slots[slot] = key
        self.entries[key].loaded_at = now
        return slot

    def _evict_slot(self, now: float) -> int | None:
        candidates = [self._candidate(k) for k in self.slots if k is not None and self.entries[k].refcount == 0]
        victim = self.policy.choose_victim(candidates, now)
        if victim is None:
            return None
        slot = self.slots.index(victim)
        self.pool.clear_slot(slot)
        self.slots[slot] = None
        self.entries[victim].evictions += 1
        return slot

    def _shrink_cpu(self, keep: AdapterKey) -> None:
        def over() -> bool:
            used = sum(p.nbytes for p in self.cpu.values())
            return used > self.cpu_bytes or (self.max_cpu_loras is not None and len(self.cpu) > self.max_cpu_loras)

        while over():
            candidates = [self._candidate(k) for k in self.cpu if k != keep]
            victim = self.policy.choose_victim(candidates, self.clock())
            if victim is None:
                return
            del self.cpu[victim]

    def _candidate(self, key: AdapterKey) -> Candidate:
        e = self.entries[key]
        return Candidate(key, e.nbytes, e.last_access, e.loaded_at, e.hits, e.ref.tenant, e.ref.priority)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
