"""The simulated device and tiers a simulated worker's real `Residency` (native backend) runs
over: keys compared by identity, host copies that are only their size, a slot pool whose writes
cost a modelled host-to-device copy, and a disk cache of artifacts by size."""

from __future__ import annotations

import operator
from dataclasses import dataclass

from loraplex.residency.key import AdapterKey
from loraplex.sim.calibration import TierCost


@dataclass(frozen=True, eq=False)
class SimKey(AdapterKey):
    """An AdapterKey compared by identity: the simulation makes exactly one key object per adapter
    revision, and the cache compares and hashes keys millions of times (slot lists, dicts)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __post_init__(self):
        # the router's views name keys on every poll
        object.__setattr__(self, "_label", super().__str__())

    def __str__(self) -> str:
        return self._label


_label = operator.attrgetter("_label")  # str() of SimKeys without a Python call per key


@dataclass(frozen=True, slots=True)
class SimPacked:
    """A host copy as the cache sees it: only its size matters."""

    nbytes: int


class SimPool:
    """The slot pool: a slot write costs a host-to-device copy, charged to the worker's current
    step."""

    def __init__(self, num_slots: int, h2d: TierCost):
        self.num_slots = num_slots
        self.h2d = h2d
        self.contents: list[SimPacked | None] = [None] * num_slots
        self.uncharged_s = 0.0
        self.copies = 0
        self.copy_seconds = 0.0

    def set_slot(self, slot: int, packed: SimPacked) -> float:
        seconds = self.h2d.seconds(packed.nbytes)
        self.contents[slot] = packed
        self.uncharged_s += seconds
        self.copies += 1
        self.copy_seconds += seconds
        return seconds

    def clear_slot(self, slot: int) -> None:
        self.contents[slot] = None

    def take_uncharged(self) -> float:
        seconds, self.uncharged_s = self.uncharged_s, 0.0
        return seconds


class SimDisk:
    """The worker's artifact cache: least recently used artifacts go when over budget (as
    `cache.disk`)."""

    def __init__(self, max_bytes: int | None):
        self.max_bytes = max_bytes
        self.sizes: dict[str, int] = {}  # digest -> bytes, least recently used first
        self.used = 0
        self.peak = 0

    def has(self, digest: str) -> bool:
        return digest in self.sizes

    def use(self, digest: str, nbytes: int) -> None:
        if digest in self.sizes:
            self.sizes[digest] = self.sizes.pop(digest)
            return
        self.sizes[digest] = nbytes
        self.used += nbytes
        while self.max_bytes is not None and self.used > self.max_bytes and len(self.sizes) > 1:
            oldest = next(iter(self.sizes))
            self.used -= self.sizes.pop(oldest)
        self.peak = max(self.peak, self.used)

    def close(self) -> None:
        """What `Residency.close` calls on its disk tier: a simulated one holds no connection
        or file."""
