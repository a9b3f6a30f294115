"""The full identity of an adapter's bytes in a cache: a hit on anything less serves the wrong version."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraplex.registry.store import Pieces

RUNTIME_COMPAT_VERSION = "1"


@dataclass(frozen=True)
class AdapterKey:
    base_model_digest: str
    name: str
    revision: str
    adapter_digest: str
    runtime_compat_version: str = RUNTIME_COMPAT_VERSION

    def __str__(self) -> str:
        return f"{self.name}@{self.revision}"


@dataclass(frozen=True)
class AdapterRef:
    """What a request needs: the key, where the bytes are, and who asks (for quotas and priority)."""

    key: AdapterKey
    path: Path | None = None
    storage_uri: str | None = None
    tenant: str = "default"
    priority: int = 0
    pieces: Pieces | None = field(default=None, compare=False, repr=False)
    """The registry's piece list for the key's digest, if it has one: the load checks the bytes on several cores."""
