"""The vLLM engine's backend of the residency: vLLM's adapter calls (add, remove, pin: `VllmSlots`)
over the digest-verified copies it reads (`staging.py`), sent in the order its engine core takes
them, and `vllm_residency`, the residency of a running vLLM. Which adapters vLLM holds, and when
they move, is the residency's (`loraplex.residency.runtime_cache`, over the tables of
`loraplex.residency.runtime_tables`); `VllmSlots` carries out its calls.

vLLM's engine core runs the calls in the order they were sent, so a call sent under `lock` keeps
its place and its result may be awaited after the lock is released.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.engines.vllm.staging import StagedCopies
from loraplex.residency.budgets import TenantBudgets
from loraplex.residency.disk import DiskTier
from loraplex.residency.errors import AdapterUnavailable
from loraplex.residency.key import AdapterKey
from loraplex.residency.ledger import Ledger
from loraplex.residency.residency import Residency
from loraplex.residency.runtime_cache import RuntimeCacheBackend
from loraplex.residency.runtime_tables import HOST_BYTES_UNBOUNDED, Resident, Runtime, Staging

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

__all__ = ["HOST_BYTES_UNBOUNDED", "EngineRuntime", "VllmSlots", "vllm_residency"]


@dataclass
class EngineRuntime:
    """A running vLLM engine (its `AsyncLLM`) and the directory of the copies it reads: what the
    residency runs over in a server."""

    engine: Any
    stage_dir: Path
    load_threads: int = 2
    kept_bytes: int = 0  # staged copies kept beyond vLLM's host cache

    def staging(self, disk: DiskTier | None, in_use: Callable[[str], bool]) -> StagedCopies:
        return StagedCopies(
            self.stage_dir,
            disk=disk,
            kept_bytes=self.kept_bytes,
            threads=self.load_threads,
            in_use=in_use,
        )

    def slots(self, staging: Staging) -> VllmSlots:
        return VllmSlots(self.engine, staging)


class VllmSlots:
    """vLLM's host cache and device slots, as its `AsyncLLM` exposes them (`add_lora`,
    `remove_lora`, `pin_lora`), for adapters staged in `staging`."""

    def __init__(self, engine, staging: Staging):
        self.engine = engine  # vLLM's AsyncLLM
        self.staging = staging
        self.lock: asyncio.Lock | None = None  # one add or remove sent at a time (`start`)
        self._taken: set[int] = set()  # ids vLLM has added once (an id means the same bytes)
        self._taken_shapes: set[str] = set()  # the `vllm_shape`s of those

    def start(self) -> None:
        """On the server's event loop, before the first call."""
        self.lock = asyncio.Lock()

    def request(self, key: AdapterKey, lora_id: int) -> LoRARequest:
        """What vLLM is handed for the adapter: its id and its staged copy."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(str(key), lora_id, str(self.staging.path(key)))

    def takes(self, lora_id: int, shape: str | None) -> bool:
        """Whether vLLM takes an add of these bytes without a refusal to wait for: it added them
        before, or an adapter of the same shape (`vllm_shape`: the modules and ranks it checks)."""
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
        """`call` started, returned once its message is sent (its place in vLLM's order is kept)."""
        task = asyncio.ensure_future(call)
        await asyncio.sleep(0)  # the task's first step sends the message
        return task

    async def add(self, key: AdapterKey, lora_id: int) -> None:
        """vLLM's add; AdapterUnavailable naming vLLM's reason for an adapter it refuses (a module
        it cannot serve, a rank over its limit)."""
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
        """vLLM's remove, sent (its answer is the task's)."""
        return await self.send(self.engine.remove_lora(lora_id))

    async def pin(self, lora_id: int) -> bool:
        """vLLM's pin: kept in a device slot until removed."""
        return bool(await self.engine.pin_lora(lora_id))

    async def add_again(self, key: AdapterKey, lora_id: int) -> bool:
        """Remove and add back from its staged copy (vLLM has no unpin); False when the copy
        changed since it was verified (the next load stages it again) or vLLM refused it."""
        await self.engine.remove_lora(lora_id)
        if not self.staging.is_unchanged(key):
            return False
        return bool(await self.engine.add_lora(self.request(key, lora_id)))


def vllm_residency(
    runtime: Runtime,
    *,
    max_loras: int,
    max_cpu_loras: int,
    disk: DiskTier | None = None,
    policy=None,
    budgets: TenantBudgets | None = None,
    reserved_slots: int = 0,
    scheduler_counts_pins: bool = False,
    clock: Callable[[], float] = time.monotonic,
) -> Residency[Resident, RuntimeCacheBackend]:
    """The residency over vLLM (`runtime`: a running engine's, `EngineRuntime`; the simulator's)."""
    ledger: Ledger[Resident] = Ledger(
        policy=policy,
        budgets=budgets or TenantBudgets(max_loras, HOST_BYTES_UNBOUNDED),
        disk=disk,
        clock=clock,
    )
    backend = RuntimeCacheBackend(
        ledger,
        runtime,
        max_loras=max_loras,
        max_cpu_loras=max_cpu_loras,
        reserved_slots=reserved_slots,
        scheduler_counts_pins=scheduler_counts_pins,
    )
    return Residency(ledger, backend)
