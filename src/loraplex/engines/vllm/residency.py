"""Which adapters vLLM holds, decided by loraplex: membership of vLLM's host cache and its pinned
set.

vLLM keeps up to `max_cpu_loras` adapters in host memory and `max_loras` in device slots, and evicts
the least recently used unpinned one when it must. Here loraplex makes those choices first: it
stages each artifact into a private, digest-verified directory (the bytes vLLM reads), adds it
ahead of traffic (prewarm, warm policies, the cpu warm set), removes its own policy's victim before
vLLM's LRU would pick one, never removes an adapter with requests in flight, pins (`pin_lora`) the
operator's gpu pins and (under `score`) the busy adapters of the gpu warm set, and hands vLLM the
requests of a few more distinct unpinned adapters than it has unpinned slots, which vLLM's scheduler
starts as slots free (its count of pinned slots is loraplex's fix, `patches.py`; without it, while a
slot is pinned, no more than the unpinned slots). vLLM still orders the unpinned adapters in its
device slots.

Tenant residency budgets (`loraplex.cache.budgets`) hold here as on the native engine: the slots
counted are those of adapters pinned or with requests handed to vLLM, the host bytes those of the
adapters in vLLM's host cache. A tenant beyond its gpu budget leaves a free slot to other tenants'
waiting requests (for a bounded time); one beyond its host budget pushes out only its own adapters.

The bookkeeping is shared by the event loop (requests) and other threads (admin calls, the registry
watcher): every change of it happens under `_lock`; vLLM's own calls are coroutines, run on the
server's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from loraplex.artifacts import ArtifactError, ArtifactUnavailable, DigestMismatch, read_artifact
from loraplex.cache.budgets import TenantBudgets, charged, tenant_rows, usage
from loraplex.cache.disk import DiskTier
from loraplex.cache.errors import (
    AdapterInFlight,
    AdapterUnavailable,
    ArtifactCorrupt,
    CapacityExceeded,
)
from loraplex.cache.key import AdapterKey, AdapterRef
from loraplex.cache.placement import (
    BusyShare,
    cpu_warm_set,
    gpu_warm_set,
    host_cache_restore,
    host_cache_victim,
    warm_pins,
)
from loraplex.cache.policy import DemandTracker, LRUPolicy
from loraplex.cache.state import adapter_row
from loraplex.engines.contract import AdapterResidency
from loraplex.lora_format import CONFIG_FILE, WEIGHTS_FILE, parse_safetensors_header

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

log = logging.getLogger(__name__)
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


class Fingerprint(NamedTuple):
    """What the file system says of a staged copy: the directory's and each entry's inode, size,
    mtime and ctime. Writing a file, adding, removing or renaming an entry, or changing a mode
    changes a ctime, and no process can set a ctime back, so an equal fingerprint is the same
    bytes as when it was taken (`VllmResidency._verified_files` takes it around each hash)."""

    directory: tuple[int, int, int]
    files: tuple[tuple[str, int, int, int, int], ...]


def fingerprint(directory: Path) -> Fingerprint:
    d = os.stat(directory)
    files = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        st = entry.stat(follow_symlinks=False)
        files.append((entry.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return Fingerprint((d.st_ino, d.st_mtime_ns, d.st_ctime_ns), tuple(files))


def vllm_shape(files: Mapping[str, bytes | memoryview]) -> str | None:
    """What vLLM's add checks of an adapter, as one digest: its files' names, the fields of its
    config that vLLM reads, and its tensors' names, dtypes and shapes. vLLM refuses an adapter for
    its rank, features, modules or sizes, never for its values: it takes an adapter of a shape it
    has taken. None: not an adapter it would read."""
    try:
        config = json.loads(bytes(files[CONFIG_FILE]))
        tensors = parse_safetensors_header(files[WEIGHTS_FILE]).tensors
    except (KeyError, ValueError):  # AdapterRejected is a ValueError
        return None
    read = _config_fields_vllm_reads()
    if isinstance(config, dict) and read is not None:  # not a name or a revision, say
        config = {k: v for k, v in config.items() if k in read}
    layout = sorted((name, t["dtype"], t["shape"]) for name, t in tensors.items())
    text = json.dumps([sorted(files), config, layout], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def _config_fields_vllm_reads() -> frozenset[str] | None:
    """The `adapter_config.json` fields vLLM's adapter load reads (its `PEFTHelper`'s)."""
    try:
        from vllm.lora.peft_helper import PEFTHelper
    except ImportError:  # every field counts
        return None
    return frozenset(f.name for f in dataclasses.fields(PEFTHelper))


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


class VllmResidency(AdapterResidency):
    """The adapter operations of the vLLM engine; the same calls as the native `AdapterCache` where
    they mean the same (tier_of, state, pin, unpin, prewarm, evict, forget, pinned, is_loading)."""

    def __init__(
        self,
        engine,
        stage_dir: Path,
        *,
        max_loras: int,
        max_cpu_loras: int,
        disk: DiskTier | None = None,
        policy=None,
        budgets: TenantBudgets | None = None,
        load_threads: int = 2,
        reserved_slots: int = 0,
        scheduler_counts_pins: bool = False,
        kept_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.engine = engine  # vLLM's AsyncLLM (add_lora, remove_lora, pin_lora)
        self.stage_dir = Path(stage_dir)
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
        self._vllm_lock: asyncio.Lock | None = None  # one add/remove sequence at a time
        self._room = asyncio.Event()  # set when a release may have made a victim available
        self._executor = ThreadPoolExecutor(load_threads, thread_name_prefix="vllm-stage")
        self._ids: dict[int, AdapterKey] = {}
        self._num_adding = 0  # adds sent to vLLM whose answer has not come
        self._accepted: set[int] = set()  # ids vLLM has added once (an id means the same bytes)
        self._accepted_shapes: set[str] = set()  # the `vllm_shape`s of those
        # Staged copies of adapters vLLM no longer holds, kept for a re-add up to `kept_bytes`
        # (name -> bytes, least recently removed first), and every staged copy's fingerprint as
        # verified: the re-add after an unpin checks it (`_is_unchanged`); a load hashes the copy.
        self.kept_bytes = kept_bytes
        self._kept: OrderedDict[str, int] = OrderedDict()
        self._kept_total = 0
        self._verified: dict[str, Fingerprint] = {}
        self._adopt_leftovers()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._vllm_lock = asyncio.Lock()

    # -- queries (any thread) ----------------------------------------------------------------------
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

    # -- the request path (event loop) -------------------------------------------------------------
    def record_request(self, ref: AdapterRef) -> str:
        """Count one request's demand; the tier it finds its adapter in (also a hit or miss)."""
        with self._lock:
            self._entry(ref)
            self.demand.record(ref.key, self.clock())
            tier = self.tier_of(ref.key)
        self.on_event("hit" if tier in ("gpu", "cpu") else "miss", {"tier": tier})
        return tier

    async def acquire(self, ref: AdapterRef) -> LoRARequest:
        """The adapter in vLLM's host cache with a reference taken (it stays until `release`); loads
        it first when needed. Raises AdapterUnavailable when its bytes cannot be had."""
        tenant = ref.tenant
        with self._lock:
            entry = self._entry(ref)
            entry.refcount += 1
            entry.last_access = self.clock()
            entry.restorable = True
            if not entry.in_vllm and ref.key not in self.loading:
                entry.last_tenant = tenant  # its host copy counts for the tenant whose load it is
        try:
            while not entry.in_vllm:
                await self._load(ref)
            self._host_waiting.discard(ref.key)
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
            self._running.add(ref.key)
            entry.users[tenant] = entry.users.get(tenant, 0) + 1
            entry.last_tenant = tenant
        self._room.set()  # a request that yielded to this one may find a slot still free
        return self._request(entry)

    def _yields_to_warm(self, entry: Resident) -> bool:
        """Whether a request outside the gpu warm set leaves a free slot to an adapter of that set
        whose requests wait for one. The wait is short: an adapter with requests running takes
        more of them without a slot of its own, so the set's adapters wait only to start."""
        if entry.vllm_pinned or entry.active:
            return False
        with self._lock:
            warm = set(self._gpu_warm(self.clock()))
            if entry.ref.key in warm:
                return False
            return any(
                (e := self.entries.get(k)) is not None and e.in_vllm and not e.active and e.refcount
                for k in warm
            )

    def release(self, key: AdapterKey, tenant: str | None = None) -> None:
        """A request of `tenant` handed to vLLM by `acquire` ended (None: any tenant's)."""
        entry = self.entries.get(key)
        if entry is not None:
            held = tenant is not None and entry.users.get(tenant)
            holder = tenant if held else next(iter(entry.users), "")
            self._unref(entry, holder)

    async def _wait_for_slot(self, entry: Resident, tenant: str) -> None:
        """Until a request of `tenant` for `entry` may go to vLLM: as loads land and requests end, a
        slot frees (`_has_slot`). A request outside the gpu warm set leaves a free slot to the set's
        waiting adapters (`_yields_to_warm`); a tenant beyond its gpu budget leaves one to other
        tenants' waiting requests for up to the budgets' `yield_s` (`_yields_slot`)."""
        deferred_at = None
        self._slot_waiting[tenant] = self._slot_waiting.get(tenant, 0) + 1
        try:
            while True:
                if self._has_slot(entry) and not self._yields_to_warm(entry):
                    if not self._yields_slot(entry, tenant, deferred_at):
                        return
                    if deferred_at is None:
                        deferred_at = self.clock()
                        self._count_budget_wait(tenant, entry.ref.key)
                self._room.clear()
                timeout = self._defer_left(deferred_at)
                if self._vllm_pins.difference(self._pins) and not self._has_slot(entry):
                    # a warm pin whose adapter went idle goes (`_follow_demand`); its busy share
                    # falls with time, so look again soon
                    await self._follow_demand()
                    timeout = min(timeout or WARM_PIN_LOOK_S, WARM_PIN_LOOK_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), timeout)
        finally:
            self._slot_waiting[tenant] -= 1
            if not self._slot_waiting[tenant]:
                del self._slot_waiting[tenant]

    def _has_slot(self, entry: Resident) -> bool:
        """Whether a request for `entry` may go to vLLM now: the distinct unpinned adapters with
        requests in vLLM stay within `_unpinned_room`."""
        if entry.vllm_pinned or entry.active:
            return True
        with self._lock:
            return self._busy_unpinned() < self._unpinned_room()

    def _unpinned_room(self) -> int:
        """How many distinct unpinned adapters may have requests handed to vLLM at once: the
        unpinned slots, and `queue_ahead` adapters more, whose requests vLLM's scheduler starts in
        the step a slot frees, not a round trip through this process later. The slots alone
        - while a pin waits for the adapters running to fit beside it (`_may_pin`), so that they
          drain;
        - under tenant budgets, which count a tenant's slots by its requests handed to vLLM;
        - while a slot is pinned, when vLLM's scheduler does not count pinned slots (a vLLM without
          loraplex's fix): it then takes up to its slot count of distinct adapters into a batch,
          and a batch with more unpinned adapters than unpinned slots fails in its worker."""
        room = self.max_loras - len(self._vllm_pins)
        pin_waits = bool(self._pins_wanted - self._vllm_pins)
        pinned = self._vllm_pins or self._pins_wanted or self.reserved_slots
        if pin_waits or self.budgets.limits_anyone:
            return room
        if pinned and not self.scheduler_counts_pins:
            return room
        return room + self.queue_ahead

    def _busy_unpinned(self) -> int:
        """The distinct unpinned adapters with requests handed to vLLM."""
        return sum(1 for k in self._running if not self.entries[k].vllm_pinned)

    def _unref(self, entry: Resident, holder: str | None) -> None:
        """Drop a request's reference; `holder`: the tenant whose request vLLM ran (None: one that
        never reached vLLM)."""
        with self._lock:
            entry.refcount = max(0, entry.refcount - 1)
            if holder is not None:
                entry.active = max(0, entry.active - 1)
                if not entry.active:
                    self._running.discard(entry.ref.key)
                    entry.busy.set(False, self.clock())
                if entry.users.get(holder, 0) > 1:
                    entry.users[holder] -= 1
                else:
                    entry.users.pop(holder, None)
            entry.last_access = self.clock()
            # a pin no longer wanted goes once its adapter is idle
            unpin = entry.vllm_pinned and not entry.refcount
            unpin = unpin and entry.ref.key not in self._pins_wanted
            restore = not (entry.refcount or self._waits())
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._room.set)
            if unpin:
                self._schedule(self._follow_demand())
            if restore:
                self._schedule(self._restore_warm())

    # -- operator calls (any thread) ---------------------------------------------------------------
    def pin(self, ref: AdapterRef, tier: str) -> None:
        """Keep the adapter in vLLM (gpu: pinned in a device slot; cpu: in its host cache) until
        unpinned."""
        if tier not in ("gpu", "cpu"):
            raise ValueError(f"pin tier {tier!r}: use gpu or cpu")
        with self._lock:
            others = [e for k, e in self.entries.items() if e.pinned and k != ref.key]
            if tier == "gpu" and sum(e.pinned == "gpu" for e in others) + 1 > self.max_loras - 1:
                raise CapacityExceeded(
                    f"cannot pin {ref.key} to gpu: one of {self.max_loras} slots must stay "
                    "free for other adapters"
                )
            if len(others) + 1 > self.max_cpu_loras - 1:
                raise CapacityExceeded(
                    f"cannot pin {ref.key}: one of max_cpu_loras {self.max_cpu_loras} must "
                    "stay free for loads"
                )
            self._set_pinned(self._entry(ref), tier)
        self.prewarm(ref, tier)

    def restore_pin(self, key: AdapterKey, pinned: str | None) -> None:
        with self._lock:
            if key in self.entries:
                self._set_pinned(self.entries[key], pinned)
        self._schedule(self._follow_demand())

    def unpin(self, key: AdapterKey) -> None:
        with self._lock:
            if key in self.entries:
                self._set_pinned(self.entries[key], None)
        self._schedule(self._follow_demand())

    def prewarm(self, ref: AdapterRef, tier: str = "cpu") -> None:
        """Add the adapter to vLLM ahead of traffic (and pin it in a slot when its tier is gpu and
        it is pinned)."""
        with self._lock:
            self._entry(ref).last_access = self.clock()
        self._schedule(self._prewarm(ref))

    def evict(self, key: AdapterKey) -> None:
        """Remove the adapter from vLLM now; refused while requests use it."""
        with self._lock:
            entry = self.entries.get(key)
            if entry is None:
                return
            if entry.refcount:
                raise AdapterInFlight(
                    f"{key} has {entry.refcount} request(s) in flight; try again when they end"
                )
            self._set_pinned(entry, None)
            entry.restorable = False  # out until its next request
        self._schedule(self._remove(key))

    def forget(self, key: AdapterKey) -> None:
        """Evict and drop every record of the key (an unloaded adapter)."""
        self.evict(key)
        with self._lock:
            entry = self.entries.pop(key, None)
            if entry is not None:
                self._ids.pop(entry.lora_id, None)
            self._held.pop(key, None)
            self._running.discard(key)
            self._pins.pop(key, None)
            self._vllm_pins.discard(key)
            self.demand.discard(key)

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

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.disk is not None:
            self.disk.close()

    # -- budgets (the rule is loraplex.cache.budgets; here, the counts it takes) ------------------
    def set_budgets(self, budgets: TenantBudgets) -> None:
        """New budgets (from the registry): they apply from the next placement on; nothing is
        removed for them. Waiting requests look again."""
        with self._lock:
            self.budgets = budgets
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._room.set)

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

    # -- internals -------------------------------------------------------------------------------
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

    def _request(self, entry: Resident) -> LoRARequest:
        from vllm.lora.request import LoRARequest

        return LoRARequest(str(entry.ref.key), entry.lora_id, str(self._staged(entry.ref.key)))

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
            future.add_done_callback(lambda _: self.loading.pop(ref.key, None))
        await asyncio.shield(future)

    async def _stage_and_add(self, ref: AdapterRef) -> None:
        loop = asyncio.get_running_loop()
        try:
            nbytes, stages, shape = await loop.run_in_executor(self._executor, self._stage, ref)
        except (DigestMismatch, ArtifactError, OSError) as exc:
            error = exc if not isinstance(exc, DigestMismatch) else ArtifactCorrupt(str(exc))
            self.on_event(
                "load_failed", {"error": type(error).__name__, "key": ref.key, "exception": error}
            )
            raise AdapterUnavailable(
                f"adapter {ref.key} could not be loaded: {error}",
                f"adapter {ref.key} could not be loaded",
            ) from None
        self._reuse_kept(ref.key)
        entry = self.entries.get(ref.key)
        if entry is None:
            return  # forgotten while it loaded
        entry.nbytes, entry.shape = nbytes, shape
        # A request that cannot run yet would hold its host copy while it waits for a slot: it
        # waits without one rather than push out an adapter of the gpu warm set for it.
        while entry.refcount and not self._has_slot(entry) and not self._spare_room():
            self._room.clear()
            await self._room.wait()
        start = time.perf_counter()
        lock = self._vllm_lock
        assert lock is not None  # made by `start`
        async with lock:  # room made and the add sent in the order vLLM takes them
            if entry.in_vllm:
                return
            while self._num_in_vllm() + self._num_adding >= self.max_cpu_loras:
                if await self._make_room(entry):
                    continue
                self._room.clear()
                lock.release()  # wait for a release without holding up other adds
                try:
                    await self._room.wait()
                finally:
                    await lock.acquire()
            self._num_adding += 1
            entry.adding = True
            if entry.refcount:
                self.host_loads.record("cpu", self.clock())
            added = await self._send(self._add(entry))
        if entry.lora_id in self._accepted or entry.shape in self._accepted_shapes:
            # vLLM added these bytes before, or an adapter of the same shape, so it takes them: its
            # engine core runs the add before any request sent after it (one input queue), and the
            # requests need not wait for the answer's round trip. The answer still ends the add
            # (`_added`).
            self._num_adding -= 1  # counted from here on as in vLLM
            added.add_done_callback(lambda task: self._added(entry, task, counted=False))
        else:  # a first add may be refused (a module or rank vLLM cannot serve): wait for it
            try:  # awaited outside the lock: vLLM takes every add sent meanwhile between two steps
                await added
            finally:
                self._added(entry, added)
        with self._lock:
            self._set_in_vllm(entry, True)
            entry.loaded_at, entry.loads = self.clock(), entry.loads + 1
            if entry.evicted_at is not None:
                self.reloads_after_eviction += 1
                self.on_event("reload_after_eviction", {"key": ref.key})
        stages["activation"] = time.perf_counter() - start
        for stage, seconds in stages.items():
            self.on_event("load_stage", {"stage": stage, "seconds": seconds, "key": ref.key})

    def _added(self, entry: Resident, task: asyncio.Task, counted: bool = True) -> None:
        """The end of an add sent to vLLM (`counted`: still in `_num_adding`). A known adapter's
        add that failed takes it out of the bookkeeping: its requests fail in vLLM alone."""
        if counted:
            self._num_adding -= 1
        entry.adding = False
        failed = task.cancelled() or task.exception() is not None
        if not failed:
            self._accepted.add(entry.lora_id)
            if entry.shape is not None:
                self._accepted_shapes.add(entry.shape)
        elif not counted:  # counted in vLLM already (`_stage_and_add`)
            self._set_in_vllm(entry, False)
            self._accepted.discard(entry.lora_id)
            self._accepted_shapes.discard(entry.shape)  # the next of its shape waits again
        self._room.set()  # a refused add leaves its room to the loads that wait

    def _spare_room(self) -> bool:
        """Whether vLLM's host cache takes one more adapter without removing one of the gpu warm
        set: a free place, or an idle adapter outside that set."""
        with self._lock:
            if self._num_in_vllm() + self._num_adding < self.max_cpu_loras:
                return True
            warm = set(self._gpu_warm(self.clock()))
            return any(
                not (e.refcount or e.pinned or e.vllm_pinned) and k not in warm
                for k, e in self._held.items()
            )

    async def _send(self, call: Coroutine) -> asyncio.Task:
        """`call` (one of vLLM's adapter calls) started, returned once its message is sent. vLLM's
        engine core runs the calls in the order they were sent, so a call started under
        `_vllm_lock` keeps its place and its result may be awaited after the lock is released."""
        task = asyncio.ensure_future(call)
        await asyncio.sleep(0)  # the task's first step sends the message
        return task

    async def _add(self, entry: Resident) -> None:
        """vLLM's add; an adapter it refuses (a module it cannot serve, a rank over its limit) fails
        alone."""
        try:
            added = await self.engine.add_lora(self._request(entry))
        except Exception as exc:  # vLLM raises several kinds for an adapter it cannot take
            added, reason = (
                False,
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
            )
        else:
            reason = "add_lora returned False"
        if not added:
            error = AdapterUnavailable(
                f"vLLM refused adapter {entry.ref.key}: {reason}",
                f"adapter {entry.ref.key} could not be loaded by the engine",
            )
            self.on_event(
                "load_failed",
                {"error": "AdapterRejected", "key": entry.ref.key, "exception": error},
            )
            raise error

    def _stage(self, ref: AdapterRef) -> tuple[int, dict[str, float], str | None]:
        """Worker thread: the artifact's digest-checked bytes written to its staging directory (what
        vLLM reads), read-only; a staged copy is checked again before each add
        (`_verified_files`), so a file changed there is never served. Returns its size, the
        stages' seconds and its `vllm_shape`."""
        stages, target = {}, self._staged(ref.key)
        start = time.perf_counter()
        if target.is_dir():
            verified = self._verified_files(target, ref.key.adapter_digest)
            if verified is not None:
                stages["disk"] = time.perf_counter() - start
                return sum(len(v) for v in verified.values()), stages, vllm_shape(verified)
            shutil.rmtree(target, ignore_errors=True)  # changed: staged again from the source
        if ref.path is not None:
            files = read_artifact(ref.path, ref.key.adapter_digest, pieces=ref.pieces)
            stages["disk"] = time.perf_counter() - start
        elif self.disk is not None and ref.storage_uri:
            files, download_s = self.disk.read(
                ref.storage_uri, ref.key.adapter_digest, pieces=ref.pieces
            )
            # disk first: the server starts a load's record at its disk stage
            stages["disk"] = time.perf_counter() - start - (download_s or 0.0)
            if download_s is not None:
                stages["download"] = download_s
        else:
            raise ArtifactUnavailable(
                f"adapter {ref.key} has neither a local path nor a storage URI with a disk tier"
            )
        work = self.stage_dir / f".{target.name}.{threading.get_ident()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        for name, data in files.items():
            (work / name).write_bytes(data)
            (work / name).chmod(0o444)
        shutil.rmtree(target, ignore_errors=True)
        work.rename(target)
        with self._lock:
            self._verified[target.name] = fingerprint(target)
        return sum(len(v) for v in files.values()), stages, vllm_shape(files)

    def _verified_files(self, target: Path, digest: str) -> dict[str, bytes] | None:
        """The files of the staged copy `target` when its bytes are those of `digest`, else None.

        Every add from a staged copy hashes it first (an artifact's digest is checked before each
        use, on every engine); what a kept copy saves is the copy from the source, not the hash.
        Its fingerprint is taken before and after, so that the hashed bytes are the fingerprint's
        (the one the re-add after an unpin checks, `_is_unchanged`)."""
        before = fingerprint(target)
        try:
            files = read_artifact(target, digest)
        except DigestMismatch:
            return None
        if fingerprint(target) != before:
            return None  # changed while it was hashed
        with self._lock:
            self._verified[target.name] = before
        return files

    def _is_unchanged(self, key: AdapterKey) -> bool:
        """Whether the staged copy of `key` is as verified (a stat per file: fit for the loop)."""
        target = self._staged(key)
        try:
            return self._verified.get(target.name) == fingerprint(target)
        except OSError:
            return False

    def _staged(self, key: AdapterKey) -> Path:
        return self.stage_dir / key.adapter_digest.removeprefix("sha256:")

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

    async def _make_room(self, incoming: Resident) -> bool:
        """Remove the policy's victim among the removable adapters that the load's tenant may push
        out (`_host_budget_victims`); False when none can go now."""
        now = self.clock()
        with self._lock:
            removable = [
                k
                for k, e in self._held.items()
                if not (e.refcount or e.adding or e.pinned or e.vllm_pinned)
            ]
            if removable and self.budgets.limits_anyone and not incoming.pinned:
                removable = self._host_budget_victims(incoming, removable)
                if not removable and incoming.ref.key not in self._host_waiting:
                    self._host_waiting.add(incoming.ref.key)  # counted once per wait
                    self._count_budget_wait(incoming.last_tenant, incoming.ref.key)
            pairs = [(k, self.entries[k]) for k in removable]
            incoming_pair = (incoming.ref.key, incoming)
            gpu_warm = set(self._gpu_warm(now))
            victim = host_cache_victim(
                self.policy, pairs, incoming_pair, self.demand, gpu_warm, now
            )
        if victim is None:
            return False
        self._host_waiting.discard(incoming.ref.key)
        await self._remove(victim, locked=True)
        return True

    async def _remove(self, key: AdapterKey, locked: bool = False) -> None:
        if not locked:
            assert self._vllm_lock is not None  # made by `start`
            async with self._vllm_lock:
                return await self._remove(key, locked=True)
        entry = self.entries.get(key)
        if entry is None or not entry.in_vllm or entry.refcount or entry.adding:
            return
        with self._lock:  # before the send yields: no request goes to vLLM with it from now
            self._set_in_vllm(entry, False)
            entry.evictions += 1
            entry.evicted_at = self.clock()
            self.num_evictions += 1
            self.recent_evictions.append(entry.evicted_at)
        self._unstage(key)
        removed = await self._send(self.engine.remove_lora(entry.lora_id))
        removed.add_done_callback(_log_failure)
        self.on_event("eviction", {"tier": "cpu"})

    def _unstage(self, key: AdapterKey) -> None:
        """The staged copy of an adapter vLLM no longer holds (vLLM reads it only to add) is kept
        for a re-add while the kept copies fit in `kept_bytes`; the least recently removed go
        first."""
        target = self._staged(key)
        if not target.is_dir() or target.name in self._kept:
            return
        entry = self.entries.get(key)
        self._kept[target.name] = max(1, entry.nbytes if entry is not None else 0)
        self._kept_total += self._kept[target.name]
        self._trim_kept()

    def _adopt_leftovers(self) -> None:
        """Staged copies that an earlier process left count as kept, the oldest first, so the
        budget bounds them too (without a fingerprint, each is hashed before its first add); its
        unfinished work directories go."""
        if not self.stage_dir.is_dir():
            return
        copies = []
        for path in self.stage_dir.iterdir():
            if path.name.startswith("."):
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_dir():
                nbytes = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
                copies.append((path.stat().st_mtime_ns, path.name, max(1, nbytes)))
        for _, name, nbytes in sorted(copies):
            self._kept[name] = nbytes
            self._kept_total += nbytes
        self._trim_kept()

    def _trim_kept(self) -> None:
        while self._kept and self._kept_total > self.kept_bytes:
            name, nbytes = self._kept.popitem(last=False)
            self._kept_total -= nbytes
            if not self._in_use(name):
                self._drop_staged(self.stage_dir / name)

    def _reuse_kept(self, key: AdapterKey) -> None:
        """A kept copy that a load staged from: vLLM holds it again, outside the kept bytes."""
        nbytes = self._kept.pop(self._staged(key).name, None)
        if nbytes is not None:
            self._kept_total -= nbytes

    def _in_use(self, name: str) -> bool:
        """Whether vLLM holds or a load reads the staged copy `name` (keys with the same digest
        share it)."""
        with self._lock:
            return any(self._staged(k).name == name for k in (*self._held, *self.loading))

    def _drop_staged(self, target: Path) -> None:
        with self._lock:
            self._verified.pop(target.name, None)
        trash = self.stage_dir / f".removed.{target.name}.{uuid.uuid4().hex}"
        with contextlib.suppress(FileNotFoundError):
            target.rename(trash)  # at once: a later load of the key stages afresh
            self._executor.submit(shutil.rmtree, trash, True)

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

    async def _restore_warm(self) -> None:
        """Add back to vLLM's host cache, ahead of its requests, an adapter of the cpu warm set that
        left it, while nothing waits, when `host_cache_restore` finds one expected back before the
        host cache turns over: into a free place, or in place of an idle adapter outside both warm
        sets. One per call; every release that leaves nothing waiting makes one. An adapter the
        operator evicted waits for its next request."""
        now = self.clock()
        with self._lock:
            if self._waits():
                return
            cpu_warm = [k for k in self._cpu_warm(now) if self.entries[k].restorable]
            if all(self.entries[k].in_vllm for k in cpu_warm):
                return  # the usual case
            removable = [
                (k, e)
                for k, e in self._held.items()
                if not (e.refcount or e.adding or e.pinned or e.vllm_pinned)
            ]
            choice = host_cache_restore(
                self.policy,
                self.demand,
                now,
                cpu_warm,
                self._held,
                self.max_cpu_loras,
                removable,
                self.entries,
                set(self._gpu_warm(now)),
                self.host_loads.short("cpu", now),
            )
            if choice is not None and self.budgets.limits_anyone:
                chosen = self.entries[choice[0]]
                mine = [choice[1]] if choice[1] is not None else []
                if choice[1] is None and self.budgets.is_over(
                    chosen.last_tenant, "cpu", self._host_usage(), max(chosen.nbytes, 1)
                ):
                    choice = None
                elif mine and not self._host_budget_victims(chosen, mine):
                    choice = None
        if choice is None:
            return
        key, victim = choice
        if victim is not None:
            await self._remove(victim)
        entry = self.entries.get(key)
        if entry is not None and not entry.in_vllm and not self._waits():
            await self._load(entry.ref)

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

    async def _follow_demand(self) -> None:
        """Pin in vLLM's device slots what `_pins_to_hold` gives, and unpin what it no longer gives
        once idle: vLLM has no unpin, so the adapter is removed and added again, from its staged
        copy. An adapter that `_may_pin` refuses now is pinned by a later call (every request,
        pin and prewarm makes one)."""
        with self._lock:
            wanted = self._pins_to_hold(self.clock())
            self._pins_wanted = set(wanted)
            to_pin = [
                k for k in wanted if self.entries[k].in_vllm and not self.entries[k].vllm_pinned
            ]
            to_unpin = [
                k
                for k in self._vllm_pins
                if k not in self._pins_wanted and not self.entries[k].refcount
            ]
        if not (to_pin or to_unpin):
            return
        assert self._vllm_lock is not None  # made by `start`
        async with self._vllm_lock:
            for key in to_unpin:
                with self._lock:  # before the send yields: no request goes to vLLM with it now
                    entry = self.entries.get(key)
                    if entry is None or entry.refcount or not entry.vllm_pinned:
                        continue
                    if key in self._pins_wanted:
                        continue
                    self._set_in_vllm(entry, False)
                await self.engine.remove_lora(entry.lora_id)
                # a copy changed since it was verified waits for the next load, which stages again
                if self._is_unchanged(key) and await self.engine.add_lora(self._request(entry)):
                    self._set_in_vllm(entry, True)
                self._room.set()
            for key in to_pin:
                with self._lock:  # counted as pinned from here (`_has_slot`), before the send
                    entry = self.entries.get(key)
                    if entry is None or not entry.in_vllm or entry.vllm_pinned:
                        continue
                    if key not in self._pins_wanted or not self._may_pin(entry):
                        continue
                    self._set_vllm_pinned(entry, True)
                pinned = False
                try:
                    pinned = await self.engine.pin_lora(entry.lora_id)
                finally:
                    if not pinned:
                        self._set_vllm_pinned(entry, False)
                        self._room.set()

    def _on_disk(self, key: AdapterKey) -> bool:
        entry = self.entries.get(key)
        if entry is not None and entry.ref.path is not None:
            return True
        if self._staged(key).is_dir():
            return True
        return self.disk is not None and self.disk.has(key.adapter_digest)


def _log_failure(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        error = future.exception()
        log.warning("adapter operation on the vLLM engine failed: %s", error)
