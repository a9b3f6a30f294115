"""The tables of a runtime that keeps its own host cache and device slots (vLLM): what it holds of
each adapter and who waits (`VllmTables`, the ledger's `Tiers`, read by the rules of `host_cache.py`
through a `HostSnapshot`), and what the residency's orchestration over it (`runtime_cache.py`) runs
over: the runtime's staged copies (`Staging`) and its own adapter calls (`AdapterCalls`: add,
remove, pin, sent in order by `RuntimeSlots`), which `loraplex.engines.vllm.slots` gives for a
running vLLM and the simulator for a modelled one. The tables are shared by the event loop
(requests) and other threads (admin calls, the registry watcher): every change of them happens under
the ledger's lock.
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


class AdapterCalls(Protocol):
    """A runtime's own adapter calls, as vLLM's `AsyncLLM` has them (the simulator's modelled
    engine core has them too): each sends one message to the engine core, which runs them in the
    order they were sent."""

    async def add_lora(self, request: Any) -> bool: ...

    async def remove_lora(self, lora_id: int) -> bool: ...

    async def pin_lora(self, lora_id: int) -> bool: ...


class Runtime(Protocol):
    """What the residency runs over: the runtime's adapter calls (`engine`), what it is handed with
    a request for an adapter (`request`) and the staged copies it reads (`staging`). A running
    vLLM's is `loraplex.engines.vllm.slots.EngineRuntime`; the simulator has its own."""

    @property
    def engine(self) -> AdapterCalls: ...

    def request(self, key: AdapterKey, lora_id: int, path: str) -> Any:
        """What the runtime is handed for the adapter: its id and its staged copy (vLLM's
        `LoRARequest`)."""

    def staging(self, disk: DiskTier | None, in_use: Callable[[str], bool]) -> Staging:
        """`in_use(name)`: whether the runtime holds or a load reads the staged copy `name`."""


class RuntimeSlots:
    """The runtime's host cache and device slots through its adapter calls (`add_lora`,
    `remove_lora`, `pin_lora`), for adapters staged in `staging`: an add or remove sent under
    `lock` keeps its place in the engine core's order, and its result may be awaited after the
    lock is released."""

    def __init__(self, runtime: Runtime, staging: Staging):
        self.runtime, self.engine = runtime, runtime.engine
        self.staging = staging
        self.lock: asyncio.Lock | None = None  # one add or remove sent at a time (`start`)
        self._taken: set[int] = set()  # ids the runtime has added once (an id means the same bytes)
        self._taken_shapes: set[str] = set()  # the `vllm_shape`s of those

    def start(self) -> None:
        """On the server's event loop, before the first call."""
        self.lock = asyncio.Lock()

    def request(self, key: AdapterKey, lora_id: int) -> Any:
        """What the runtime is handed for the adapter: its id and its staged copy."""
        return self.runtime.request(key, lora_id, str(self.staging.path(key)))

    def takes(self, lora_id: int, shape: str | None) -> bool:
        """Whether the runtime takes an add of these bytes without a refusal to wait for: it added
        them before, or an adapter of the same shape (`vllm_shape`: the modules and ranks vLLM
        checks)."""
        return lora_id in self._taken or shape in self._taken_shapes

    def took(self, lora_id: int, shape: str | None, taken: bool) -> None:
        """The answer to an add: taken, or refused (the next add of its shape waits again)."""
        if taken:
            self._taken.add(lora_id)
            if shape is not None:
                self._taken_shapes.add(shape)
        else:
            self._taken.discard(lora_id)
            if shape is not None:
                self._taken_shapes.discard(shape)

    async def send(self, call: Coroutine) -> asyncio.Task:
        """`call` started, returned once its message is sent (its place in the order is kept)."""
        task = asyncio.ensure_future(call)
        await asyncio.sleep(0)  # the task's first step sends the message
        return task

    async def add(self, key: AdapterKey, lora_id: int) -> None:
        """The add; AdapterUnavailable naming the runtime's reason for an adapter it refuses (a
        module vLLM cannot serve, a rank over its limit)."""
        try:
            added = await self.engine.add_lora(self.request(key, lora_id))
        except Exception as exc:  # vLLM raises several kinds for an adapter it cannot take
            first = str(exc).splitlines()[0] if str(exc) else ""
            added, reason = False, f"{type(exc).__name__}: {first}"
        else:
            reason = "add_lora returned False"
        if not added:
            raise AdapterUnavailable(
                f"vLLM refused adapter {key}: {reason}",
                f"adapter {key} could not be loaded by the engine",
            )

    async def remove(self, lora_id: int) -> asyncio.Task:
        """The remove, sent (its answer is the task's)."""
        return await self.send(self.engine.remove_lora(lora_id))

    async def pin(self, lora_id: int) -> bool:
        """The pin: kept in a device slot until removed."""
        return bool(await self.engine.pin_lora(lora_id))

    async def add_again(self, key: AdapterKey, lora_id: int) -> bool:
        """Remove and add back from its staged copy (vLLM has no unpin); False when the copy
        changed since it was verified (the next load stages it again) or the runtime refused
        it."""
        await self.engine.remove_lora(lora_id)
        if not self.staging.is_unchanged(key):
            return False
        return bool(await self.engine.add_lora(self.request(key, lora_id)))


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
