"""The first half of every load, the same on both engines: an adapter's bytes from its revision's
local path or through the disk tier (downloaded from the remote store when the tier has no sound
copy), checked against the revision's digest and pieces before anything keeps them. The engine
does the second half with the checked bytes: the native engine packs them into a host copy as
they are hashed (`use`), the vLLM engine writes them where vLLM reads them."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loraplex.artifacts import ArtifactError, DigestMismatch, read_artifact
from loraplex.residency.disk import DiskTier
from loraplex.residency.errors import AdapterUnavailable, ArtifactCorrupt
from loraplex.residency.key import AdapterRef


@dataclass
class Fetched:
    result: Any  # the files' bytes by name, or what `use` made of them
    source: str  # the tier the bytes came from: disk or remote
    stages: dict[str, float]  # seconds per load stage: disk, and download when there was one


def fetch(ref: AdapterRef, disk: DiskTier | None, use: Callable | None = None) -> Fetched:
    """The adapter's digest-checked bytes (`use`: see `read_artifact`). Raises ArtifactCorrupt when
    they do not hash to the digest, AdapterUnavailable when they cannot be had."""
    start = time.perf_counter()
    try:
        if ref.path is not None:
            result = read_artifact(ref.path, ref.key.adapter_digest, use=use, pieces=ref.pieces)
            return Fetched(result, "disk", {"disk": time.perf_counter() - start})
        if disk is None or not ref.storage_uri:
            raise AdapterUnavailable(
                f"adapter {ref.key}: no local path and no storage URI to load it from",
                f"adapter {ref.key} could not be loaded",
            )
        result, download_s = disk.read(
            ref.storage_uri, ref.key.adapter_digest, use=use, pieces=ref.pieces
        )
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
    # the disk stage is the read's time without the download's
    stages = {"disk": time.perf_counter() - start - (download_s or 0.0)}
    if download_s is None:
        return Fetched(result, "disk", stages)
    stages["download"] = download_s
    return Fetched(result, "remote", stages)
