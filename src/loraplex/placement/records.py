"""The placement policy's plain records: a worker and an adapter as the controller sees them, and a
move it decides."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

_EMPTY: Mapping[str, float] = MappingProxyType({})


@dataclass(frozen=True)
class WorkerView:
    """One worker, as the controller sees it from `/admin/state`."""

    name: str
    pool: str
    base: str
    max_rank: int
    slots: int
    """How many adapters it holds warm (its device slots)."""
    host_bytes: int
    """The bytes of adapter weights it may hold warm."""
    draining: bool = False
    placed: frozenset[str] = frozenset()
    """Adapter keys (`name@rev`) the controller has placed there."""
    demand: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    """Adapter key -> requests per second in the worker's demand window."""
    tenants: frozenset[str] = frozenset()
    """The tenants its pool is dedicated to; empty: a shared pool."""


@dataclass(frozen=True)
class AdapterView:
    key: str
    base: str
    rank: int
    nbytes: int
    tenant: str | None = None
    """Its owner; None: a shared adapter, placed on shared pools only."""


@dataclass(frozen=True)
class Move:
    kind: Literal["place", "release"]
    adapter: str
    worker: str
