"""Pure traffic arithmetic: which revision a request gets, given the weights (no database here)."""

from __future__ import annotations

import hashlib
import random


def user_point(name: str, user: str) -> float:
    """A point in [0, 1) fixed by (name, user): the same user lands on the same revision while
    weights hold."""
    digest = hashlib.sha256(f"{name}\0{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def choose(weights: list[tuple[str, int]], point: float) -> str:
    """The revision whose slice of the cumulative weights holds `point` (weights need not sum to
    100)."""
    total = sum(w for _, w in weights)
    if total <= 0:
        raise ValueError("no revision has traffic")
    target = point * total
    cumulative = 0
    for revision, weight in weights:
        cumulative += weight
        if target < cumulative:
            return revision
    return weights[-1][0]  # point * total rounded up to total


def pick(
    name: str, weights: list[tuple[str, int]], user: str | None, rng: random.Random | None = None
) -> str:
    """Sticky by `user` when given, random otherwise."""
    point = user_point(name, user) if user is not None else (rng or random).random()
    return choose(weights, point)


def gateway_model(name: str, revision: str, serving: frozenset[str] | None) -> str:
    """The `model` a gateway sends for this revision: the bare name while it is the name's only
    serving revision, else `name@revision` (the targets `registry export k8s` writes for a split,
    and what a client pins)."""
    return name if serving is None or serving == {revision} else f"{name}@{revision}"
