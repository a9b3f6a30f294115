"""The tables of a runtime that keeps its own host cache and device slots (vLLM): what it holds of
each adapter and who waits (`VllmTables`, the ledger's `Tiers`, read by the rules of
`host_cache.py` through a `HostSnapshot`), and what the residency's orchestration over it
(`runtime_cache.py`) asks of the engine: its staged copies (`Staging`) and its adapter calls
(`RuntimeSlots`: add, remove, pin), which `loraplex.engines.vllm.slots` gives for a running vLLM and
the simulator for a modelled one. The tables are shared by the event loop (requests) and other
threads (admin calls, the registry watcher): every change of them happens under the ledger's lock.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Protocol

from loraplex.residency import host_cache
from loraplex.residency.disk import DiskTier
from loraplex.residency.errors import AdapterUnavailable
from loraplex.residency.host_cache import HostSnapshot
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.ledger import Entry, Ledger
from loraplex.residency.policy import DemandTracker
from loraplex.residency.warm import BusyShare

WARM_PIN_LOOK_S = 0.5  # how often a request waiting for a slot looks whether a warm pin may go
# vLLM's host cache is sized in adapters (max_cpu_loras), not bytes: no byte capacity bounds a
# tenant's host-bytes budget.
HOST_BYTES_UNBOUNDED = sys.maxsize


class Staging(Protocol):
    """Where the residency stages the bytes the runtime reads (`loraplex.engines.vllm.staging`'s
    `StagedCopies`; the simulator's models it): `stage` runs on `executor`."""

    @property
    def executor(self) -> Executor: ...

    def stage(self, ref: AdapterRef) -> tuple[int, dict[str, float], str | None]:
        """The adapter's bytes made ready for an add: its size, the stages' seconds, its shape."""

    def has(self, key: AdapterKey) -> bool:
        """Whether a local copy of the key's bytes is staged."""

    def path(self, key: AdapterKey) -> PurePath: ...

    def is_unchanged(self, key: AdapterKey) -> bool: ...

    def reuse(self, key: AdapterKey) -> None: ...

    def unstage(self, key: AdapterKey, nbytes: int) -> None: ...

    def close(self) -> None: ...


class RuntimeSlots(Protocol):
    """The runtime's adapter calls (vLLM's `add_lora`, `remove_lora`, `pin_lora`: the engine's
    `VllmSlots`), sent in the order its engine core takes them: a call sent under `lock` keeps its
    place, and its result may be awaited after the lock is released."""

    lock: asyncio.Lock | None  # one add or remove sent at a time (made by `start`)

    def start(self) -> None:
        """On the server's event loop, before the first call."""

    def request(self, key: AdapterKey, lora_id: int) -> Any:
        """What the runtime is handed with a request for the adapter (vLLM's `LoRARequest`)."""

    def takes(self, lora_id: int, shape: str | None) -> bool:
        """Whether an add of these bytes is taken without a refusal to wait for."""

    def took(self, lora_id: int, shape: str | None, taken: bool) -> None: ...

    async def send(self, call: Coroutine) -> asyncio.Task:
        """`call` started, returned once its message is sent."""

    async def add(self, key: AdapterKey, lora_id: int) -> None:
        """The add; AdapterUnavailable naming the runtime's reason for an adapter it refuses."""

    async def remove(self, lora_id: int) -> asyncio.Task:
        """The remove, sent (its answer is the task's)."""

    async def pin(self, lora_id: int) -> bool: ...

    async def add_again(self, key: AdapterKey, lora_id: int) -> bool:
        """Remove and add back from its staged copy (an unpin); False when the copy changed since
        it was verified or the runtime refused it."""


class Runtime(Protocol):
    """What the residency's orchestration runs over: the staged copies and the adapter calls (a
    running vLLM's, `loraplex.engines.vllm.slots.EngineRuntime`; the simulator's)."""

    def staging(self, disk: DiskTier | None, in_use: Callable[[str], bool]) -> Staging:
        """`in_use(name)`: whether the runtime holds or a load reads the staged copy `name`."""

    def slots(self, staging: Staging) -> RuntimeSlots: ...


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


@dataclass
class Resident(Entry):
    """One adapter as loraplex tracks it on the vLLM engine: the ledger's entry, and what vLLM
    holds of it."""

    lora_id: int = 0
    active: int = (
        0  # of its references, the requests handed to vLLM (others wait for a load or slot)
    )
    in_vllm: bool = False  # added to vLLM's host cache (or its add sent, for a known adapter)
    adding: bool = False  # an add sent to vLLM whose answer has not come: never removed meanwhile
    vllm_pinned: bool = False  # pin_lora'd (or its pin sent): kept in a device slot by vLLM
    busy: BusyShare = field(default_factory=BusyShare)  # recent time with requests in vLLM
    restorable: bool = True  # added back ahead of its requests (False from an operator's evict)
    shape: str | None = None  # what vLLM's add checks of it, as a digest (`vllm_shape`)

    @property
    def in_slot(self) -> bool:
        """Holding one of vLLM's device slots as loraplex counts them: pinned, or running."""
        return self.in_vllm and (self.vllm_pinned or self.active > 0)


class VllmTables:
    """What vLLM holds of the adapters and who waits (the residency's `Tiers`), read by the rules
    through `snapshot`. The records are the ledger's."""

    def __init__(
        self,
        ledger: Ledger[Resident],
        *,
        max_loras: int,
        max_cpu_loras: int,
        reserved_slots: int = 0,
        scheduler_counts_pins: bool = False,
    ):
        self.ledger = ledger
        self.staging: Staging  # set by the residency, whose backend makes it over `in_use`
        self.entries, self.pins, self.demand = ledger.entries, ledger.pins, ledger.demand
        self.loading, self._lock = ledger.loading, ledger._lock
        self.max_loras = max_loras
        # vLLM's slots pinned outside this table (the zero adapter)
        self.reserved_slots = reserved_slots
        self.max_cpu_loras = max_cpu_loras
        # vLLM's scheduler leaves out of a batch's budget the slots that pinned adapters outside
        # it hold (loraplex's plugin, `patches.py`), so pins hold no request back here
        self.scheduler_counts_pins = scheduler_counts_pins
        # adapters handed to vLLM beyond its slots while none is pinned (`unpinned_room`): up to
        # half the slots, within half the host cache's places beyond the slots (the others take
        # the loads meanwhile)
        self.queue_ahead = min(max_loras, max(0, max_cpu_loras - max_loras)) // 2
        self.slot_waiting: dict[str, int] = {}  # per tenant, its requests waiting for a slot
        self.host_waiting: set[AdapterKey] = set()  # loads waiting for their tenant's host budget
        # Indexes of `entries` that the request path reads instead of a pass over every adapter:
        # those in vLLM's host cache, those with requests handed to vLLM, those pinned in vLLM, and
        # the last `pins_to_hold`.
        self.held: dict[AdapterKey, Resident] = {}
        self.running: set[AdapterKey] = set()
        self.vllm_pins: set[AdapterKey] = set()
        self.pins_wanted: set[AdapterKey] = set()
        self.host_loads = DemandTracker(ranked=False)  # one key, "cpu": adds that requests caused
        self.ids: dict[int, AdapterKey] = {}
        self.num_adding = 0  # adds sent to vLLM whose answer has not come

    # -- what the ledger reads (vLLM's tiers) ------------------------------------------------------
    def in_slot(self, key: AdapterKey) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.in_slot

    def in_host_memory(self, key: AdapterKey) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.in_vllm

    def in_slots(self) -> list[AdapterKey]:
        return [k for k, e in self.held.items() if e.in_slot]

    def in_host(self) -> list[AdapterKey]:
        return list(self.held)

    @property
    def num_slots(self) -> int:
        return self.max_loras

    def free_slots(self) -> int:
        return max(0, self.max_loras - len(self.in_slots()))

    def warm_sets(self, now: float) -> tuple[set[AdapterKey], set[AdapterKey]]:
        snap = self.snapshot()
        return set(host_cache.gpu_warm(snap, now)), set(host_cache.cpu_warm(snap, now))

    def adapter_row(self, entry: Resident, row: dict) -> dict:
        return {**row, "lora_int_id": entry.lora_id}

    def host_figures(self) -> dict:
        return {
            "cpu_bytes_used": sum(e.nbytes for e in self.held.values()),
            "cpu_loras_used": len(self.held),
            "cpu_loras_capacity": self.max_cpu_loras,
        }

    def staged(self, key: AdapterKey) -> bool:
        return self.staging.has(key)

    def entry(self, ref: AdapterRef) -> Resident:
        entry = self.entries.get(ref.key)
        if entry is None:
            lora_id = lora_int_id(ref.key)
            if (
                self.ids.get(lora_id, ref.key) != ref.key
            ):  # a 62-bit collision: refuse rather than mix weights
                raise AdapterUnavailable(
                    f"{ref.key}: its vLLM id collides with {self.ids[lora_id]}"
                )
            self.ids[lora_id] = ref.key
            entry = self.entries[ref.key] = Resident(ref, lora_id=lora_id)
        return entry

    def set_in_vllm(self, entry: Resident, held: bool) -> None:
        """`entry` in or out of vLLM's host cache (out of it, not pinned in vLLM either)."""
        with self._lock:
            entry.in_vllm = held
            if held:
                self.held[entry.ref.key] = entry
            else:
                self.set_vllm_pinned(entry, False)
                self.held.pop(entry.ref.key, None)

    def set_vllm_pinned(self, entry: Resident, pinned: bool) -> None:
        entry.vllm_pinned = pinned
        if pinned:
            self.vllm_pins.add(entry.ref.key)
        else:
            self.vllm_pins.discard(entry.ref.key)

    def snapshot(self) -> HostSnapshot:
        """What the rules read (`loraplex.residency.host_cache`): these tables as they are now."""
        ledger = self.ledger
        return HostSnapshot(
            self.entries,
            self.held,
            self.running,
            self.vllm_pins,
            self.pins_wanted,
            self.pins,
            self.loading,
            self.slot_waiting,
            self.host_waiting,
            self.num_adding,
            self.demand,
            self.host_loads,
            self.max_loras,
            self.max_cpu_loras,
            self.reserved_slots,
            self.scheduler_counts_pins,
            self.queue_ahead,
            ledger.policy,
            ledger.budgets,
        )

    def in_use(self, name: str) -> bool:
        """Whether vLLM holds or a load reads the staged copy `name` (keys with the same digest
        share it)."""
        with self._lock:
            return any(self.staging.path(k).name == name for k in (*self.held, *self.loading))
