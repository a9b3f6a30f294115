"""Sizes in bytes, as flags and files write them (`512MiB`); importable by every package."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def size_pattern() -> str:
    """A regular expression of the texts `parse_size` reads (JSON Schema's dialect: no flags)."""
    units = "|".join("".join(f"[{c.lower()}{c.upper()}]" for c in u) for u in _UNITS if u)
    return rf"^\s*[0-9]*\.?[0-9]+\s*({units})?\s*$"


def parse_size(text: str | int) -> int:
    """Bytes from `512MiB`, `4GiB`, `1.5GB` or a plain integer."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match[2].lower() not in _UNITS:
        raise ValueError(
            f"bad size {text!r}: use a number with an optional unit such as 512MiB or 4GiB"
        )
    return int(float(match[1]) * _UNITS[match[2].lower()])


def format_size(nbytes: int) -> str:
    """`512MiB`, `1.5GiB`: the largest binary unit it reaches, to a tenth (parse_size reads it)."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit.lower()]
        if nbytes >= scale:
            return f"{nbytes / scale:.1f}".removesuffix(".0") + unit
    return str(nbytes)
