"""A worker's adapter residency, one class for both engines: the bookkeeping (the ledger's), the
operator's calls (pin, prewarm, evict, forget, budgets) and the reads the server, the admin API
and the metrics make, each written once here, over a `Backend` that carries out placement.

There are two backends, one for each kind of slots, both in this package: `slot_pool.py` for an
engine whose residency owns the device slots (the native engine's slot pool: host copies moved into
slots on the engine's step thread) and `runtime_cache.py` for a runtime that keeps its own host
cache and slots (vLLM: adds, removes and pins from the server's event loop). Both decide by this
package's rules (`placement.py`, `host_cache.py`, `warm.py`, `budgets.py`) and keep their records in
the ledger. What an engine gives is small: a slot pool and a loader (`SlotPool`, the native
engine's `engines/native/slots.py`), or its adapter calls and staged copies (`Runtime`, the vLLM
engine's `engines/vllm/slots.py`); the simulator gives modelled ones of each. Nothing here assumes
an event loop: every change happens under the ledger's lock, from any thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar

from loraplex.residency.budgets import TenantBudgets
from loraplex.residency.errors import CapacityExceeded
from loraplex.residency.events import Event
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.ledger import E, Ledger, Tiers


class Backend(Protocol[E]):
    """What carries out placement for one kind of slots (`slot_pool.SlotPoolBackend`,
    `runtime_cache.RuntimeCacheBackend`): where the adapters are (`tiers`), and the moves. Every
    call but `acquire`'s wait is made under the ledger's lock."""

    @property
    def tiers(self) -> Tiers: ...

    def new_entry(self, ref: AdapterRef) -> E:
        """The record of an adapter seen for the first time (added to the ledger's entries)."""

    def acquire(self, ref: AdapterRef) -> Any:
        """The request path's take of the adapter, with a reference held until `release`: the
        native engine's slot (None while it cannot have one), the vLLM engine's awaitable of
        vLLM's `LoRARequest`."""

    def release(self, key: AdapterKey, tenant: str | None) -> None: ...

    def pin_refusal(self, key: AdapterKey, tier: str) -> str | None:
        """Why a pin of `key` to `tier` cannot be kept (None: it can)."""

    def prewarm(self, ref: AdapterRef, tier: str) -> None:
        """Start bringing the adapter into host memory, and into a slot for `gpu`."""

    def drop(self, key: AdapterKey, entry: E) -> None:
        """Take the adapter out of the slots and host memory (no request holds it)."""

    def forget(self, key: AdapterKey, entry: E | None) -> None:
        """Drop the backend's own records of a key the ledger forgot."""

    def budgets_changed(self) -> None: ...

    def when_loaded(self, key: AdapterKey) -> Future: ...

    def close(self) -> None: ...


B = TypeVar("B", bound=Backend)


class Residency(Generic[E, B]):
    """An engine's adapters: `ledger` holds the records, `backend` the moves."""

    def __init__(self, ledger: Ledger[E], backend: B):
        self.ledger, self.backend = ledger, backend
        ledger.tiers = self.tiers = backend.tiers
        self.entries = ledger.entries
        self.pins = ledger.pins
        self.demand = ledger.demand
        self.loading = ledger.loading
        self.disk = ledger.disk
        self._lock = ledger._lock
        # told of each adapter `forget` drops (the native engine forgets its prefix-cache blocks)
        self.on_forget: Callable[[AdapterKey], None] = lambda key: None

    @property
    def budgets(self) -> TenantBudgets:
        return self.ledger.budgets

    @budgets.setter
    def budgets(self, budgets: TenantBudgets) -> None:
        self.set_budgets(budgets)

    @property
    def policy(self):
        return self.ledger.policy

    @policy.setter
    def policy(self, policy) -> None:
        """Another eviction policy (a test's), for every placement from now on."""
        self.ledger.policy = policy

    @property
    def clock(self) -> Callable[[], float]:
        return self.ledger.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        """A test's or a simulator's clock, for every record the residency keeps."""
        self.ledger.clock = clock

    @property
    def on_event(self) -> Callable[[Event], None]:
        return self.ledger.on_event

    @on_event.setter
    def on_event(self, callback: Callable[[Event], None]) -> None:
        self.ledger.on_event = callback

    # -- reads (any thread) ------------------------------------------------------------------------
    def tier_of(self, key: AdapterKey) -> str:
        return self.ledger.tier_of(key)

    def pinned(self, key: AdapterKey) -> str | None:
        return self.ledger.pinned(key)

    def is_loading(self, key: AdapterKey) -> bool:
        return key in self.loading

    def in_host_memory(self, key: AdapterKey) -> bool:
        return self.tiers.in_host_memory(key)

    def nbytes_of(self, key: AdapterKey) -> int:
        return self.ledger.nbytes_of(key)

    def state(self) -> dict[str, Any]:
        return self.ledger.state()

    def budget_state(self) -> dict[str, Any]:
        return self.ledger.budget_state()

    def when_loaded(self, key: AdapterKey) -> Future:
        return self.backend.when_loaded(key)

    def when_released(self, key: AdapterKey) -> Future:
        return self.ledger.when_released(key)

    # -- the request path --------------------------------------------------------------------------
    def record_request(self, ref: AdapterRef, counted: bool = True) -> str:
        """Count one request's demand and report the tier it finds its adapter in (as a hit or miss
        event too, when `counted`)."""
        return self.ledger.count_request(ref, self.backend.new_entry, counted)

    def acquire(self, ref: AdapterRef) -> Any:
        """The adapter taken for a request, with a reference held until `release` (`Backend`)."""
        return self.backend.acquire(ref)

    def release(self, key: AdapterKey, tenant: str | None = None) -> None:
        """Drop a reference `acquire` took for `tenant` (None: for any tenant holding one)."""
        self.backend.release(key, tenant)

    # -- operator calls (any thread) ---------------------------------------------------------------
    def pin(self, ref: AdapterRef, tier: str) -> None:
        """Keep the adapter resident in `tier` (gpu: in a device slot; cpu: in host memory) until
        unpinned; loads it now if needed."""
        if tier not in ("gpu", "cpu"):
            raise ValueError(f"pin tier {tier!r}: use gpu or cpu")
        with self._lock:
            self._entry(ref)
            refusal = self.backend.pin_refusal(ref.key, tier)
            if refusal is not None:
                raise CapacityExceeded(refusal)
            self.ledger.set_pin(ref.key, tier)
        self.prewarm(ref, tier)

    def prewarm(self, ref: AdapterRef, tier: str = "cpu") -> None:
        """Start loading ahead of traffic into host memory, or into a device slot when one can be
        had."""
        with self._lock:
            self._entry(ref).last_access = self.clock()
            self.backend.prewarm(ref, tier)

    def evict(self, key: AdapterKey) -> None:
        """Drop the adapter from the slots and host memory now; refused while requests use it."""
        with self._lock:
            if (entry := self.ledger.evictable(key)) is None:
                return
            self.backend.drop(key, entry)
            self.ledger.set_pin(key, None)

    def forget(self, key: AdapterKey) -> None:
        """Evict and drop every record of a key (an unloaded adapter), in one step: no request
        takes the adapter between the two."""
        with self._lock:
            self.evict(key)
            self.backend.forget(key, self.ledger.forget_records(key))
        self.on_forget(key)

    def unpin(self, key: AdapterKey) -> None:
        self.ledger.restore_pin(key, None)

    def restore_pin(self, key: AdapterKey, pinned: str | None) -> None:
        self.ledger.restore_pin(key, pinned)

    def set_budgets(self, budgets: TenantBudgets) -> None:
        """New budgets (from the registry): they apply from the next placement on; nothing is
        evicted for them."""
        self.ledger.set_budgets(budgets)
        self.backend.budgets_changed()

    def close(self) -> None:
        self.backend.close()
        if self.disk is not None:
            self.disk.close()

    def _entry(self, ref: AdapterRef) -> E:
        entry = self.entries.get(ref.key)
        if entry is None:
            entry = self.entries[ref.key] = self.backend.new_entry(ref)
        return entry
