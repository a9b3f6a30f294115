"""What placement decides, for a residency to carry out in order: the records both engines' rules
return (`placement.py` for a slot pool with host copies, `host_cache.py` for a runtime that keeps
its own host cache and slots)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.residency.key import AdapterKey


@dataclass(frozen=True, slots=True)
class Load:
    """Start loading the adapter's host copy, counted for `tenant`."""

    key: AdapterKey
    tenant: str


@dataclass(frozen=True, slots=True)
class Evict:
    """Clear the adapter's slot (tier gpu) or drop its host copy (tier cpu)."""

    key: AdapterKey
    tier: str


@dataclass(frozen=True, slots=True)
class Activate:
    """Copy the adapter's host copy into `slot`; `restored`: ahead of its requests."""

    key: AdapterKey
    slot: int
    restored: bool = False


@dataclass(frozen=True, slots=True)
class Wait:
    """The request for the adapter waits; reason "budget": its tenant's budget holds it back."""

    key: AdapterKey
    reason: str
    tenant: str


@dataclass(frozen=True, slots=True)
class Pin:
    """Have the runtime keep the adapter in a device slot (vLLM's `pin_lora`)."""

    key: AdapterKey


@dataclass(frozen=True, slots=True)
class Unpin:
    """Let the runtime's slots take the pinned adapter's place again (on vLLM: a remove and an add
    again, from its staged copy)."""

    key: AdapterKey


Decision = Load | Evict | Activate | Wait | Pin | Unpin
