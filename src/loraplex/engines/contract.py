"""What the server, the admin API, the metrics and the pin reconciler need of an engine and of its
adapters' residency: the protocols the native engine (in this process or in its own) and the vLLM
engine declare, and the records that cross the native engine's process boundary."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from loraplex.residency.budgets import TenantBudgets
from loraplex.residency.events import Event
from loraplex.residency.key import AdapterKey, AdapterRef


@dataclass(frozen=True)
class Residency:
    """Where one adapter is, as the engine last reported it."""

    tier: str
    """gpu, cpu, disk or remote."""
    pinned: str | None
    """The tier it is pinned to, if any."""
    loading: bool
    in_host_memory: bool
    in_use: bool
    """A request holds it."""


@dataclass
class ResidencySnapshot:
    """Every adapter the native engine's cache knows, numbered so that the newest of those the
    two sockets bring wins."""

    seq: int
    slots: list[AdapterKey | None]
    residency: dict[AdapterKey, Residency]


class AdapterResidency(Protocol):
    """An engine's adapter operations and residency, read by the server, the admin API, the
    metrics and the pin reconciler."""

    budgets: TenantBudgets
    """The tenants' residency budgets last applied."""
    on_event: Callable[[Event], None]
    """Called with each residency event (hit, miss, load, eviction, ...) for the metrics."""

    def tier_of(self, key: AdapterKey) -> str: ...
    def pinned(self, key: AdapterKey) -> str | None: ...
    def is_loading(self, key: AdapterKey) -> bool: ...
    def in_host_memory(self, key: AdapterKey) -> bool: ...
    def pin(self, ref: AdapterRef, tier: str) -> None: ...
    def unpin(self, key: AdapterKey) -> None: ...
    def restore_pin(self, key: AdapterKey, pinned: str | None) -> None: ...
    def prewarm(self, ref: AdapterRef, tier: str = "cpu") -> None: ...
    def evict(self, key: AdapterKey) -> None: ...
    def forget(self, key: AdapterKey) -> None: ...
    def set_budgets(self, budgets: TenantBudgets) -> None: ...
    def budget_state(self) -> dict[str, Any]: ...
    def state(self) -> dict[str, Any]:
        """`/admin/state`'s residency: every adapter and the slots."""
        ...

    def when_loaded(self, key: AdapterKey) -> Future[Any]:
        """Done once no load of `key` is in progress."""
        ...

    def when_released(self, key: AdapterKey) -> Future[Any]:
        """Done once no request holds `key`."""
        ...


class Engine(Protocol):
    """What every engine gives the server besides generation, whose paths differ by `kind`
    (native: `generate` streams; vllm: vLLM's own serving layer)."""

    kind: str
    """native or vllm."""
    adapters: AdapterResidency
    max_model_len: int
    base_model_digest: str

    def live_figures(self) -> dict[str, Any]:
        """Waiting and running requests, KV use, the adapters running and waiting, the slots:
        what `/admin/state`, the metrics and gateways read."""
        ...
