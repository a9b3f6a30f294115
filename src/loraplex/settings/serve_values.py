"""The values of `loraplex serve`'s settings that need more than a type: the host cache's defaults
by engine, the score policy's terms by their short names, and `--lora-modules`' NAME=DIR items."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
