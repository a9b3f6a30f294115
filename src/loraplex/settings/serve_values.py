"""The values of `loraplex serve`'s settings that need more than a type: the host cache's defaults
by engine and what the vLLM engine refuses, the score policy's terms by their short names, and
`--lora-modules`' NAME=DIR items."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loraplex.settings.fields import Conflict

HOST_CACHE_BYTES = 2 * 2**30
"""The native engine's host-memory adapter cache without --max-cpu-loras or --cpu-cache-bytes."""
VLLM_HOST_CACHE_PER_SLOT = 4
"""The vLLM engine's host cache without --max-cpu-loras: this many adapters per device slot."""
MIN_RESIDENCY_S = 1.0
"""The score policy's protection of a new hot adapter without --min-residency-s."""

SCORE_WEIGHTS = {
    "recency": "w_recency",
    "frequency": "w_frequency",
    "priority": "w_priority",
    "cost": "w_cost",
    "size": "w_size_per_gib",
    "preferred": "w_preferred",
}
"""`--score-weights NAME=W,...`: the score policy's keep_score terms, by their short names."""


def parse_lora_modules(raw: Any) -> tuple[tuple[str, Path], ...]:
    """`NAME=DIR` items (flags, a variable's words, a YAML list) or a YAML mapping NAME: DIR."""
    if isinstance(raw, dict):
        return tuple((str(k), Path(str(v))) for k, v in raw.items())
    items = raw.split() if isinstance(raw, str) else raw if isinstance(raw, list | tuple) else [raw]
    out = []
    for text in map(str, items):
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{text}: expected NAME=DIR")
        out.append((name, Path(path)))
    return tuple(out)


def check_vllm(s) -> None:
    """What the vLLM engine refuses in `s` (ServeSettings): it counts its host cache in
    adapters."""
    if s.cpu_cache_bytes is not None:
        raise Conflict(
            "--cpu-cache-bytes: the vLLM engine counts its host cache in adapters; "
            "use --max-cpu-loras",
            "engine",
            "cpu_cache_bytes",
        )
    if s.tenant_cpu_share < 1.0:
        raise Conflict(
            "--tenant-cpu-share: the vLLM engine's host cache is counted in adapters, not "
            "bytes; give tenants a host budget in bytes (loraplex registry tenant set T "
            "--max-cpu-bytes)",
            "engine",
            "tenant_cpu_share",
        )
    if s.max_cpu_loras is not None and s.max_cpu_loras < s.max_loras:
        raise Conflict(
            f"--max-cpu-loras {s.max_cpu_loras}: the vLLM engine keeps at least "
            f"--max-loras ({s.max_loras}) in host memory",
            "engine",
            "max_cpu_loras",
            "max_loras",
        )
