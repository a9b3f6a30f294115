"""The native engine's places for adapters: its device slots (the model's slot pool) over host
copies (packed, in host memory), and the load that brings an adapter's bytes from disk or the
remote store into a host copy. These are the native residency's `Tiers`; which adapter goes where
is placement's to decide (`loraplex.residency.placement`), and `residency.NativeResidency` carries
it out."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.artifacts import ArtifactError, DigestMismatch, read_artifact
from loraplex.residency.disk import DiskTier
from loraplex.residency.errors import AdapterUnavailable, ArtifactCorrupt
from loraplex.residency.events import Event, LoadStage
from loraplex.residency.key import AdapterKey, AdapterRef
from loraplex.residency.ledger import Entry

RATE_SMOOTHING = 0.2  # weight of the newest load in each stage's measured seconds per byte


class SlotPool(Protocol):
    num_slots: int

    def set_slot(self, slot: int, packed) -> float | None:
        """Write the host copy into the slot; a pool that models its copies (the simulator's)
        returns the seconds the copy takes, any other None (the residency times it)."""

    def clear_slot(self, slot: int) -> None: ...


class HostCopy(Protocol):
    """An adapter's host copy as the residency sees it (the engine's `PackedAdapter`, the
    simulator's `SimPacked`)."""

    @property
    def nbytes(self) -> int: ...


@dataclass
class Loaded:
    packed: HostCopy
    source: str  # tier the bytes came from: disk or remote
    stages: dict[str, float] = field(default_factory=dict)


class NativeSlots:
    """Which adapter holds each slot, the host copies and their bytes, and the measured cost of
    each load stage. `warm_sets` is the residency's (placement reads the whole residency)."""

    def __init__(self, pool: SlotPool, cpu_bytes: int, max_cpu_loras: int | None):
        self.pool = pool
        self.cpu_bytes = cpu_bytes
        self.max_cpu_loras = max_cpu_loras
        self.slots: list[AdapterKey | None] = [None] * pool.num_slots
        # changed only by put_cpu and drop_cpu, which keep the total and move `version`
        self.cpu: dict[AdapterKey, HostCopy] = {}
        self.cpu_bytes_used = 0
        self.version = 0
        # measured per load stage (download, disk, h2d)
        self.seconds_per_byte: dict[str, float] = {}
        self.warm_sets: Callable[[float], tuple[set[AdapterKey], set[AdapterKey]]]

    # -- the ledger's view (`Tiers`) ---------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def in_slot(self, key: AdapterKey) -> bool:
        return key in self.slots

    def in_host_memory(self, key: AdapterKey) -> bool:
        return key in self.cpu

    def in_slots(self) -> list[AdapterKey]:
        return [k for k in self.slots if k is not None]

    def in_host(self) -> list[AdapterKey]:
        return list(self.cpu)

    def free_slots(self) -> int:
        return self.slots.count(None)

    def staged(self, key: AdapterKey) -> bool:
        return False

    def adapter_row(self, entry: Entry, row: dict) -> dict:
        return row

    def host_figures(self) -> dict:
        return {"cpu_bytes_used": self.cpu_bytes_used, "cpu_bytes_capacity": self.cpu_bytes}

    # -- moves -------------------------------------------------------------------------------------
    def slot_of(self, key: AdapterKey) -> int | None:
        return self.slots.index(key) if key in self.slots else None

    def fill(self, key: AdapterKey, slot: int) -> float:
        """Copy the key's host copy into `slot`, which is free; the seconds the copy took."""
        start = time.perf_counter()
        modeled = self.pool.set_slot(slot, self.cpu[key])
        seconds = time.perf_counter() - start if modeled is None else modeled
        self.slots[slot] = key
        return seconds

    def clear(self, slot: int) -> AdapterKey:
        """Empty `slot`; the key that held it."""
        key = self.slots[slot]
        assert key is not None, f"clear of the empty slot {slot}"
        self.pool.clear_slot(slot)
        self.slots[slot] = None
        return key

    def put_cpu(self, key: AdapterKey, packed: HostCopy) -> None:
        self.drop_cpu(key)
        self.cpu[key] = packed
        self.cpu_bytes_used += packed.nbytes
        self.version += 1

    def drop_cpu(self, key: AdapterKey) -> None:
        if key in self.cpu:
            self.cpu_bytes_used -= self.cpu.pop(key).nbytes
            self.version += 1

    def measure(self, stage: str, seconds: float, nbytes: int) -> None:
        if nbytes > 0:
            old = self.seconds_per_byte.get(stage)
            new = seconds / nbytes
            self.seconds_per_byte[stage] = (
                new if old is None else old + RATE_SMOOTHING * (new - old)
            )


def load_adapter(
    ref: AdapterRef,
    pack: Callable[[dict[str, memoryview], Callable[[str, int], None]], object],
    disk: DiskTier | None,
    on_event: Callable[[Event], None],
) -> Loaded:
    """A load thread's work: the bytes from disk or the remote store, digest checked, packed into a
    host copy (`pack`: see read_artifact's `use`)."""
    stages = {}
    try:
        if ref.path is not None:
            start = time.perf_counter()
            # one read; packed while the digest check runs, kept only if it matches
            packed = read_artifact(ref.path, ref.key.adapter_digest, use=pack, pieces=ref.pieces)
            stages["disk"] = time.perf_counter() - start
            source = "disk"
        elif disk is not None and ref.storage_uri:
            start = time.perf_counter()
            packed, download_s = disk.read(
                ref.storage_uri, ref.key.adapter_digest, use=pack, pieces=ref.pieces
            )
            stages["disk"] = time.perf_counter() - start - (download_s or 0.0)
            if download_s is not None:
                stages["download"] = download_s
            source = "disk" if download_s is None else "remote"
        else:
            raise AdapterUnavailable(
                f"adapter {ref.key}: no local path and no storage URI to load it from"
            )
    except AdapterUnavailable:
        raise
    except DigestMismatch as exc:
        raise ArtifactCorrupt(
            f"adapter {ref.key}: {exc}",
            f"adapter {ref.key} failed its digest check and is not served",
        ) from exc
    except (ArtifactError, OSError, ValueError) as exc:
        raise AdapterUnavailable(
            f"adapter {ref.key} could not be loaded: {exc}",
            f"adapter {ref.key} could not be loaded; try again later",
        ) from exc
    for stage, seconds in stages.items():
        on_event(LoadStage(stage, seconds, ref.key))
    return Loaded(packed, source, stages)
