"""The full identity of an adapter's bytes in a cache: a hit on anything less serves the wrong
version."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loraplex.artifacts import Pieces

RUNTIME_COMPAT_VERSION = "1"


@dataclass(frozen=True)
class AdapterKey:
    base_model_digest: str
    name: str
    revision: str
    adapter_digest: str
    runtime_compat_version: str = RUNTIME_COMPAT_VERSION

    def __post_init__(self):
        # Hashed once: the cache looks keys up in several dicts per request, at every step for each
        # waiting one.
        object.__setattr__(
            self,
            "_hash",
            hash(
                (
                    self.base_model_digest,
                    self.name,
                    self.revision,
                    self.adapter_digest,
                    self.runtime_compat_version,
                )
            ),
        )

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(
        self,
    ):
        # rebuilt, so hashed again where it is unpickled (str hashes differ between processes)
        return type(self), (
            self.base_model_digest,
            self.name,
            self.revision,
            self.adapter_digest,
            self.runtime_compat_version,
        )

    def __str__(self) -> str:
        return f"{self.name}@{self.revision}"


@dataclass(frozen=True)
class AdapterRef:
    """What a request needs: the key, where the bytes are, and who asks (for quotas and
    priority)."""

    key: AdapterKey
    path: Path | None = None
    storage_uri: str | None = None
    tenant: str = "default"
    priority: int = 0
    pieces: Pieces | None = field(default=None, compare=False, repr=False)
    """The registry's piece list for the key's digest, if it has one: the load checks the bytes on
    several cores."""
