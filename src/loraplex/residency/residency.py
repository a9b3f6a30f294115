"""The residency as the server, the admin API and the metrics read it (`AdapterResidency`), one for
both engines: the reads and the operator's pin changes, answered by the ledger (`ledger.Ledger`).

Each engine's residency is one of these, and adds what moves its adapters: the native one
(`engines/native/residency.py`) over its slot pool and host copies, the vLLM one
(`engines/vllm/residency.py`) over vLLM's host cache and pins. Their shared tables (`entries`,
`pins`, `demand`, `loading`) are the ledger's own.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic

from loraplex.residency.budgets import TenantBudgets
from loraplex.residency.events import Event
from loraplex.residency.key import AdapterKey
from loraplex.residency.ledger import E, Ledger


class Residency(Generic[E]):
    """An engine's adapters as readers see them; `ledger` holds the records."""

    def __init__(self, ledger: Ledger[E]):
        self.ledger = ledger
        self.entries = ledger.entries
        self.pins = ledger.pins
        self.demand = ledger.demand
        self.loading = ledger.loading
        self.policy = ledger.policy
        self.disk = ledger.disk
        self._lock = ledger._lock

    @property
    def budgets(self) -> TenantBudgets:
        return self.ledger.budgets

    @budgets.setter
    def budgets(self, budgets: TenantBudgets) -> None:
        self.set_budgets(budgets)

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

    def tier_of(self, key: AdapterKey) -> str:
        return self.ledger.tier_of(key)

    def pinned(self, key: AdapterKey) -> str | None:
        return self.ledger.pinned(key)

    def is_loading(self, key: AdapterKey) -> bool:
        return key in self.loading

    def in_host_memory(self, key: AdapterKey) -> bool:
        return self.ledger.tiers.in_host_memory(key)

    def nbytes_of(self, key: AdapterKey) -> int:
        return self.ledger.nbytes_of(key)

    def state(self) -> dict[str, Any]:
        return self.ledger.state()

    def budget_state(self) -> dict[str, Any]:
        return self.ledger.budget_state()

    def when_loaded(self, key: AdapterKey) -> Future:
        return self.ledger.when_loaded(key)

    def when_released(self, key: AdapterKey) -> Future:
        return self.ledger.when_released(key)

    def unpin(self, key: AdapterKey) -> None:
        self.ledger.restore_pin(key, None)

    def restore_pin(self, key: AdapterKey, pinned: str | None) -> None:
        self.ledger.restore_pin(key, pinned)

    def set_budgets(self, budgets: TenantBudgets) -> None:
        """New budgets (from the registry): they apply from the next placement on; nothing is
        evicted for them."""
        self.ledger.set_budgets(budgets)
