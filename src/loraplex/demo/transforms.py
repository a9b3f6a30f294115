"""The string transforms the demo adapters learn, and the random inputs they are checked on (no
torch)."""

from __future__ import annotations

import codecs
import random
import string
from collections.abc import Callable

INPUT_ALPHABET = string.ascii_lowercase
"""Inputs are lowercase letters; every transform's output stays within `ascii_letters`."""
OUTPUT_ALPHABET = string.ascii_letters
MIN_LEN, MAX_LEN = 3, 12


def _double_letters(text: str) -> str:
    return "".join(ch * 2 for ch in text)


TRANSFORMS: dict[str, Callable[[str], str]] = {
    "copy": lambda text: text,  # the base model, no adapter
    "reverse": lambda text: text[::-1],
    "rot13": lambda text: codecs.encode(text, "rot13"),
    "double-letters": _double_letters,
    "rotate": lambda text: text[1:] + text[:1],  # the first letter moves to the end
}


def is_distinguishing(text: str) -> bool:
    """True when every transform gives a different output, so a wrong adapter always gives a wrong
    answer."""
    outputs = {fn(text) for fn in TRANSFORMS.values()}
    return len(outputs) == len(TRANSFORMS)


def random_string(rng: random.Random, length: int, alphabet: str = INPUT_ALPHABET) -> str:
    return "".join(rng.choices(alphabet, k=length))


def random_inputs(n: int, seed: int) -> list[str]:
    """`n` random lowercase strings of 3-12 letters on which all transforms differ (no palindromes,
    say)."""
    rng = random.Random(f"inputs-{seed}")
    inputs: list[str] = []
    while len(inputs) < n:
        text = random_string(rng, rng.randint(MIN_LEN, MAX_LEN))
        if is_distinguishing(text):
            inputs.append(text)
    return inputs
