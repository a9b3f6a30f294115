"""The vLLM engine's backend of the residency: a running vLLM (`EngineRuntime`: its `AsyncLLM`,
whose `add_lora`, `remove_lora` and `pin_lora` are the calls the residency makes, and the
`LoRARequest` it is handed for an adapter) over the digest-verified copies it reads (`staging.py`),
and `vllm_residency`, the residency of a running vLLM. Which adapters vLLM holds, and when they
move, is the residency's (`loraplex.residency.runtime_cache`, over `loraplex.residency.runtime`'s
tables and its `RuntimeSlots`, which send vLLM's calls in the order its engine core takes them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loraplex.engines.vllm.staging import StagedCopies
from loraplex.residency.budgets import TenantBudgets
from loraplex.residency.disk import DiskTier
from loraplex.residency.key import AdapterKey
from loraplex.residency.ledger import Ledger
from loraplex.residency.residency import Residency
from loraplex.residency.runtime import HOST_BYTES_UNBOUNDED, Resident, Runtime
from loraplex.residency.runtime_cache import RuntimeCacheBackend

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

__all__ = ["HOST_BYTES_UNBOUNDED", "EngineRuntime", "vllm_residency"]


@dataclass
class EngineRuntime:
    """A running vLLM engine (its `AsyncLLM`) and the directory of the copies it reads: what the
    residency runs over in a server."""

    engine: Any  # vLLM's AsyncLLM
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

    def request(self, key: AdapterKey, lora_id: int, path: str) -> LoRARequest:
        """What vLLM is handed for the adapter: its id and its staged copy."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(str(key), lora_id, path)


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
