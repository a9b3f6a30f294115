"""What a residency reports as it works, for the metrics, the audit of loads and the server's
reactions (a corrupt artifact quarantined): one record type per event, handed to its `on_event`.

The records are frozen dataclasses of plain values, so they cross the native engine's process
boundary as they are (`engines/native/wire.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.residency.key import AdapterKey


@dataclass(frozen=True)
class Lookup:
    """A request found its adapter in `tier`: a hit in a slot or host memory, else a miss."""

    tier: str

    @property
    def hit(self) -> bool:
        return self.tier in ("gpu", "cpu")


@dataclass(frozen=True)
class LoadStage:
    """One stage of a load took `seconds`: download, disk, h2d, activation (or the server's
    resolve, with no key)."""

    stage: str
    seconds: float
    key: AdapterKey | None = None


@dataclass(frozen=True)
class LoadFailed:
    """A load of `key` failed: `error` names its kind (`AdapterRejected`: the engine refused it)."""

    key: AdapterKey
    error: str
    exception: BaseException


@dataclass(frozen=True)
class Eviction:
    """An adapter left `tier` (gpu: its slot; cpu: host memory) to make room."""

    tier: str


@dataclass(frozen=True)
class ReloadAfterEviction:
    """An adapter came back within the thrash window after its eviction."""

    key: AdapterKey


@dataclass(frozen=True)
class BudgetWait:
    """A request of `tenant` for `key` waits because of its tenant's budget."""

    tenant: str
    key: AdapterKey


@dataclass(frozen=True)
class PinRefused:
    """A pin made before the adapter's bytes were known does not fit once they are: `error` says
    why, and the adapter stays cached, unpinned."""

    key: AdapterKey
    tier: str
    error: str


Event = Lookup | LoadStage | LoadFailed | Eviction | ReloadAfterEviction | BudgetWait | PinRefused
