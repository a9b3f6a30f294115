"""The native engine's load of an adapter: its checked bytes (`loraplex.residency.fetch`) packed
into a host copy, on a load thread of the residency."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.host_memory import release_freed
from loraplex.residency.disk import DiskTier
from loraplex.residency.events import Event, LoadStage
from loraplex.residency.fetch import fetch
from loraplex.residency.key import AdapterRef


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


def load_adapter(
    ref: AdapterRef,
    pack: Callable[[dict[str, memoryview], Callable[[str, int], None]], object],
    disk: DiskTier | None,
    on_event: Callable[[Event], None],
) -> Loaded:
    """A load thread's work: the adapter's checked bytes (`fetch`), packed into a host copy as they
    are hashed (`pack`: see read_artifact's `use`)."""
    fetched = fetch(ref, disk, use=pack)
    for stage, seconds in fetched.stages.items():
        on_event(LoadStage(stage, seconds, ref.key))
    release_freed()  # the read buffer, freed on this thread, leaves the process's memory
    return Loaded(fetched.result, fetched.source, fetched.stages)
