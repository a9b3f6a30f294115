"""The native engine's load of an adapter: its bytes from disk or the remote store, the digest
checked, packed into a host copy (on a load thread of the residency)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.artifacts import ArtifactError, DigestMismatch, read_artifact
from loraplex.host_memory import release_freed
from loraplex.residency.disk import DiskTier
from loraplex.residency.errors import AdapterUnavailable, ArtifactCorrupt
from loraplex.residency.events import Event, LoadStage
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
    release_freed()  # the read buffer, freed on this thread, leaves the process's memory
    return Loaded(packed, source, stages)
